#!/usr/bin/python3
"""tests/deploy/check_deploy.py BIN_DIR — the deploy/ manifests, checked without a cluster.

1. Static: every manifest parses; kustomization.yaml lists exactly the manifests present; every
   Service selects the pods of a Deployment and targets a named port its container declares;
   every container port a probe uses exists; the proxy discovers the headless Services by name.
2. Live: the pods' commands (init container included) run on loopback, exactly as the manifests
   give them, with only the cluster-specific values rewritten: /models → a temp dir, the secret
   file → a temp file holding the Secret's token, 0.0.0.0 / $(POD_IP) → 127.0.0.1, fixed ports →
   free ones, Service names → localhost, --kv-cache-memory → 256M and the demo preset → tiny
   (CI memory and sanitizer-build start-up time; the served name stays). One completion
   through the proxy must come back with tokens, and each node's /pd/info must show the
   manifest's pipe and mode. Everything started is stopped. Exit 0 only if every check passed.
"""
import glob
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy")
failures = []


def check(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    if not cond:
        failures.append(what)


def load():
    docs = {}
    for path in sorted(glob.glob(os.path.join(DEPLOY, "*.yaml"))):
        with open(path) as f:
            docs[os.path.basename(path)] = [d for d in yaml.safe_load_all(f) if d is not None]
    return docs


def static_checks(docs):
    kust = docs.pop("kustomization.yaml")[0]
    check(sorted(kust["resources"]) == sorted(docs), "kustomization.yaml lists every manifest: %s" % sorted(docs))
    objs = [d for ds in docs.values() for d in ds]
    deps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
    svcs = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    secrets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Secret"}
    for name, s in svcs.items():
        sel = s["spec"]["selector"]
        match = [d for d in deps.values() if all(d["spec"]["template"]["metadata"]["labels"].get(k) == v
                                                 for k, v in sel.items())]
        check(len(match) == 1, "Service %s selects one Deployment" % name)
        if match:
            c = match[0]["spec"]["template"]["spec"]["containers"][0]
            names = {p["name"] for p in c.get("ports", [])}
            for p in s["spec"]["ports"]:
                check(p["targetPort"] in names, "Service %s port %s targets a declared container port" %
                      (name, p["name"]))
    for name, d in deps.items():
        spec = d["spec"]["template"]["spec"]
        labels = d["spec"]["template"]["metadata"]["labels"]
        check(all(labels.get(k) == v for k, v in d["spec"]["selector"]["matchLabels"].items()),
              "Deployment %s selector matches its pod labels" % name)
        for c in spec["containers"]:
            names = {p["name"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe"):
                if probe in c:
                    check(c[probe]["httpGet"]["port"] in names, "%s %s uses a declared port" % (name, probe))
        for v in spec.get("volumes", []):
            if "secret" in v:
                check(v["secret"]["secretName"] in secrets, "%s mounts a Secret the manifests define" % name)
    pols = [o for o in objs if o["kind"] == "NetworkPolicy"]
    check(len(pols) >= 1, "a NetworkPolicy restricts who reaches the nodes")

    def selects(sel, d):
        labels = d["spec"]["template"]["metadata"]["labels"]
        ok = all(labels.get(k) == v for k, v in sel.get("matchLabels", {}).items())
        for e in sel.get("matchExpressions", []):
            ok = ok and e["operator"] == "In" and labels.get(e["key"]) in e["values"]
        return ok

    for p in pols:
        sel = p["spec"]["podSelector"]
        guarded = sorted(n for n, d in deps.items() if selects(sel, d))
        check(guarded == ["pd-decode", "pd-prefill"], "NetworkPolicy %s guards the P/D pods: %s" %
              (p["metadata"]["name"], guarded))
        for rule in p["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                srcs = sorted(n for n, d in deps.items() if selects(peer["podSelector"], d))
                check(srcs and "pd-proxy" not in srcs or srcs == ["pd-proxy"],
                      "NetworkPolicy %s: a rule admits %s" % (p["metadata"]["name"], srcs))
                if srcs == ["pd-proxy"]:
                    ports = [x["port"] for x in rule.get("ports", [])]
                    names = {q["name"] for d in guarded
                             for q in deps[d]["spec"]["template"]["spec"]["containers"][0]["ports"]}
                    check(ports == ["http"] and "http" in names, "the proxy may reach only the nodes' http port")
    proxy = deps["pd-proxy"]["spec"]["template"]["spec"]["containers"][0]["args"]
    for role in ("prefill", "decode"):
        arg = [a for a in proxy if a.startswith("--discover-%s=" % role)]
        host = arg[0].split("=", 1)[1].split(":")[0] if arg else ""
        check(host in svcs and svcs[host]["spec"].get("clusterIP") == "None",
              "the proxy discovers %s through the headless Service %r" % (role, host))
    return deps, secrets


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def http(port, path, body=None, timeout=60):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path),
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read()


def wait_ready(port, proc, secs=120):
    end = time.time() + secs
    while time.time() < end:
        if proc.poll() is not None:
            return False
        try:
            if http(port, "/health", timeout=2)[0] == 200:
                return True
        except Exception:
            pass
        time.sleep(0.2)
    return False


def rewrite(args, tmp, token_path, ports, env):
    out = []
    for a in args:
        for k, v in env.items():
            a = a.replace("$(%s)" % k, v)
        a = a.replace("/models", os.path.join(tmp, "models")).replace("/etc/pdserve/token", token_path)
        a = a.replace("0.0.0.0:7000", "127.0.0.1:0").replace("=0.0.0.0", "=127.0.0.1")
        m = re.match(r"--port=(\d+)$", a)
        if m:
            a = "--port=%d" % ports["self"]
        m = re.match(r"--discover-(prefill|decode)=([\w.-]+):(\d+)$", a)
        if m:
            a = "--discover-%s=localhost:%d" % (m.group(1), ports[m.group(1)])
        if a.startswith("--kv-cache-memory="):
            a = "--kv-cache-memory=256M"
        if a == "demo" and out and out[-1] == "--preset":
            a = "tiny"  # the same pipeline with a model sanitizer builds start in seconds
        out.append(a)
    return out


def live(deps, secrets, bindir):
    procs = []
    tmp = tempfile.mkdtemp(prefix="pd-deploy-")
    os.mkdir(os.path.join(tmp, "models"))  # the emptyDir volume
    token_path = os.path.join(tmp, "token")
    with open(token_path, "w") as f:
        f.write(list(secrets.values())[0]["stringData"]["token"])
    ports = {"prefill": free_port(), "decode": free_port(), "proxy": free_port()}
    try:
        for role in ("prefill", "decode", "proxy"):
            spec = deps["pd-" + role]["spec"]["template"]["spec"]
            env = {"POD_IP": "127.0.0.1"}
            for ic in spec.get("initContainers", []):
                cmd = [os.path.join(bindir, ic["command"][0])] + rewrite(ic["command"][1:], tmp, token_path, {}, env)
                out_dir = cmd[cmd.index("--out") + 1] if "--out" in cmd else None
                if out_dir is not None and os.path.isdir(out_dir):
                    continue  # both pools' init containers make the same model
                r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
                if r.returncode != 0:
                    sys.stdout.write(r.stderr.decode()[-2000:])
                check(r.returncode == 0, "pd-%s init container %s ran" % (role, ic["name"]))
            c = spec["containers"][0]
            for attempt in range(3):
                args = rewrite(c["args"], tmp, token_path, dict(ports, self=ports[role]), env)
                log = open(os.path.join(tmp, role + ".log"), "w")
                p = subprocess.Popen([os.path.join(bindir, c["command"][0])] + args, stdout=log, stderr=log)
                ok = wait_ready(ports[role], p)
                with open(os.path.join(tmp, role + ".log")) as f:
                    lost = not ok and p.poll() is not None and "cannot listen" in f.read()
                if not lost:
                    break
                # free_port() only found a free port; another process took it while this one loaded
                ports[role] = free_port()
            procs.append((role, p))
            if not ok:
                with open(os.path.join(tmp, role + ".log")) as f:
                    sys.stdout.write(f.read()[-3000:])
            check(ok, "pd-%s starts with the manifest's args and answers /health" % role)
            if not ok:
                return
            if role != "proxy":
                info = json.loads(http(ports[role], "/pd/info")[1])
                want = {a.split("=", 1)[0][5:]: a.split("=", 1)[1] for a in c["args"] if a.startswith("--kv-")}
                check(info.get("pipe") == want.get("pipe") and info.get("transfer_mode") == want.get("transfer-mode"),
                      "pd-%s /pd/info: pipe %s, mode %s" % (role, info.get("pipe"), info.get("transfer_mode")))
        time.sleep(1.5)  # the proxy's first discovery and probe round
        st, body = http(ports["proxy"], "/v1/completions",
                        {"model": "demo", "prompt": "deploy smoke test", "max_tokens": 4, "temperature": 0})
        out = json.loads(body)
        check(st == 200 and out["usage"]["completion_tokens"] == 4,
              "a completion through the proxy (prefill → decode): HTTP %d, %s tokens" %
              (st, out.get("usage", {}).get("completion_tokens")))
        metrics = http(ports["decode"], "/metrics")[1].decode()
        m = re.search(r'^pd:kv_transfers_completed_total\{kind="pull_load"\} (\S+)$', metrics, re.M)
        done = float(m.group(1)) if m else 0
        check(done >= 1, "the decode loaded the prompt's KV from the prefill (cluster token, advertised "
              "address, tcp pipe): %.0f transfer(s)" % done)
    finally:
        for _, p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for role, p in reversed(procs):
            try:
                rc = p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = p.wait()
            with open(os.path.join(tmp, role + ".log"), errors="replace") as f:
                text = f.read()
            san = re.search(r"(ThreadSanitizer|AddressSanitizer|runtime error)", text)
            if san:
                i = max(0, san.start() - 200)
                sys.stdout.write(text[i:i + 3000])
            check(rc == 0 and san is None, "pd-%s stopped cleanly on SIGTERM (exit %d%s)" %
                  (role, rc, ", sanitizer report in its log" if san else ""))
        subprocess.run(["rm", "-rf", tmp])


def main():
    if len(sys.argv) != 2:
        print("usage: check_deploy.py BIN_DIR")
        return 2
    docs = load()
    deps, secrets = static_checks(docs)
    live(deps, secrets, sys.argv[1])
    print("%d failed" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
