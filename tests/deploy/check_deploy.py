#!/usr/bin/python3
"""tests/deploy/check_deploy.py BIN_DIR NPM_DIR — deploy/ checked without a cluster.

deploy/ is copied to a temporary directory whose base/secrets/ gets random secrets (the operator's
files are never read), then:
1. Render: `kubectl kustomize` renders every overlay (cpu, gpu, gpu-hostnetwork, xpyd).
2. Schemas: every rendered object validates against the Kubernetes OpenAPI schemas
   (kubernetes-models; KEDA's and the Prometheus Operator's CRDs), tests/deploy/validate_k8s.mjs.
3. Our rules, per overlay: every container (init ones too) has resource requests and a memory
   limit, a non-root, read-only, no-escalation, capability-free securityContext; every server
   container has startup/readiness/liveness probes on declared ports; P/D pods mount /dev/shm
   (Memory) and drain within the grace period (preStop + --drain-timeout); decode rolls out
   maxSurge 1 / maxUnavailable 0; every pool has a PodDisruptionBudget, topology spread and
   Prometheus annotations; the proxy runs 2 replicas; Services select one Deployment's pods and
   target declared ports; the NetworkPolicy admits the KV ports (kv*) only from pool members and the
   HTTP port to the proxy; every flag of every command exists in that binary's --help; autoscalers
   target existing Deployments and query only metrics the nodes export
   (tests/reference/vllm_metrics.txt); no committed manifest holds a Secret value.
4. Live: the cpu overlay's pods (init container included) run on loopback exactly as rendered, with
   only the cluster-specific values rewritten (/models, the secret files and env, 0.0.0.0 and
   $(POD_IP) → 127.0.0.1, fixed ports → free ones, Service names → localhost, --kv-cache-memory →
   256M, the demo preset → tiny). Through the proxy: no key → 401, the key → a completion whose KV
   moved prefill → decode. The Grafana dashboard (deploy/grafana) queries only metrics the live
   nodes and proxy export. Everything started is stopped. Exit 0 only if every check passed.
"""
import base64
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "faults"))
from cluster import free_port  # noqa: E402

OVERLAYS = ("cpu", "gpu", "gpu-hostnetwork", "xpyd")
NPM_PACKAGES = "kubernetes-models@5.1.0 @kubernetes-models/keda@2.0.0 @kubernetes-models/prometheus-operator@6.0.0"
failures = []


def check(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    if not cond:
        failures.append(what)
    return cond


def render(deploy, overlay):
    r = subprocess.run(["kubectl", "kustomize", os.path.join(deploy, "overlays", overlay)],
                       capture_output=True, text=True, timeout=120)
    check(r.returncode == 0, "kubectl kustomize renders overlays/%s%s" % (overlay, (": " + r.stderr[-500:]) if r.returncode else ""))
    return [d for d in yaml.safe_load_all(r.stdout) if d] if r.returncode == 0 else []


def validate_schemas(overlay, objs, npm_dir, tmp):
    path = os.path.join(tmp, overlay + ".json")
    with open(path, "w") as f:
        json.dump(objs, f)
    r = subprocess.run(["node", os.path.join(ROOT, "tests", "deploy", "validate_k8s.mjs"), path, npm_dir],
                       capture_output=True, text=True, timeout=120)
    bad = [line for line in r.stdout.splitlines() if not line.startswith("ok")]
    check(r.returncode == 0 and not bad and len(r.stdout.splitlines()) == len(objs),
          "overlays/%s: %d objects valid against the Kubernetes schemas%s" %
          (overlay, len(objs), (": " + "; ".join(bad)[:800] + r.stderr[-300:]) if r.returncode else ""))


def by_kind(objs, kind):
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def selects(sel, labels):
    ok = all(labels.get(k) == v for k, v in sel.get("matchLabels", {}).items())
    for e in sel.get("matchExpressions", []):
        ok = ok and e["operator"] == "In" and labels.get(e["key"]) in e["values"]
    return ok


def flag_of(arg):
    return arg.split("=", 1)[0] if arg.startswith("--") else None


_help = {}


def help_text(bindir, binary):
    if binary not in _help:
        r = subprocess.run([os.path.join(bindir, binary), "--help"], capture_output=True, text=True, timeout=30)
        _help[binary] = r.stdout + r.stderr
    return _help[binary]


def exported_metric_names():
    names = set()
    with open(os.path.join(ROOT, "tests", "reference", "vllm_metrics.txt")) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                names.add(line.split()[0])
    return names


def container_rules(overlay, dname, spec, c, init):
    what = "%s: %s container %s" % (overlay, dname, c["name"])
    res = c.get("resources", {})
    check("requests" in res and "memory" in res.get("limits", {}), what + " has requests and a memory limit")
    sc = c.get("securityContext", {})
    psc = spec.get("securityContext", {})
    check(psc.get("runAsNonRoot") is True and sc.get("allowPrivilegeEscalation") is False and
          sc.get("readOnlyRootFilesystem") is True and "ALL" in sc.get("capabilities", {}).get("drop", []),
          what + " runs non-root, read-only root fs, no privilege escalation, capabilities dropped")
    if init:
        return
    ports = {p["name"] for p in c.get("ports", [])}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c.get(probe)
        check(p is not None and p["httpGet"]["port"] in ports, "%s has a %s on a declared port" % (what, probe))


def static_checks(overlay, objs, bindir, metric_names):
    deps = by_kind(objs, "Deployment")
    svcs = by_kind(objs, "Service")
    check(sorted(deps) == ["pd-decode", "pd-prefill", "pd-proxy"], "%s: the three Deployments" % overlay)
    if sorted(deps) != ["pd-decode", "pd-prefill", "pd-proxy"]:
        return
    check(deps["pd-proxy"]["spec"]["replicas"] >= 2, "%s: the proxy runs %d replicas" %
          (overlay, deps["pd-proxy"]["spec"]["replicas"]))
    ru = deps["pd-decode"]["spec"].get("strategy", {}).get("rollingUpdate", {})
    check(ru.get("maxSurge") == 1 and ru.get("maxUnavailable") == 0, "%s: decode rolls out maxSurge 1, "
          "maxUnavailable 0" % overlay)
    pdbs = by_kind(objs, "PodDisruptionBudget")
    for dname, d in deps.items():
        tmpl = d["spec"]["template"]
        spec, labels = tmpl["spec"], tmpl["metadata"]["labels"]
        check(selects(d["spec"]["selector"], labels), "%s: %s selector matches its pod labels" % (overlay, dname))
        check(any(selects(p["spec"]["selector"], labels) for p in pdbs.values()),
              "%s: a PodDisruptionBudget covers %s" % (overlay, dname))
        check(bool(spec.get("topologySpreadConstraints")) or
              bool(spec.get("affinity", {}).get("podAntiAffinity")), "%s: %s pods spread over hosts" % (overlay, dname))
        ann = tmpl["metadata"].get("annotations", {})
        check(ann.get("prometheus.io/scrape") == "true" and ann.get("prometheus.io/path") == "/metrics",
              "%s: %s pods carry the Prometheus scrape annotations" % (overlay, dname))
        for init, cs in ((True, spec.get("initContainers", [])), (False, spec["containers"])):
            for c in cs:
                container_rules(overlay, dname, spec, c, init)
                binary = c["command"][0]
                flags = [flag_of(a) for a in c["command"][1:] + c.get("args", []) if flag_of(a)]
                text = help_text(bindir, binary)
                missing = [f for f in flags if re.search(re.escape(f) + r"[ ,=\n]", text) is None]
                check(not missing, "%s: %s's flags exist in `%s --help`%s" %
                      (overlay, c["name"], binary, (": missing " + ", ".join(missing)) if missing else ""))
        if dname != "pd-proxy":
            c = spec["containers"][0]
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            vols = {v["name"]: v for v in spec.get("volumes", [])}
            shm = vols.get(mounts.get("/dev/shm"), {}).get("emptyDir", {})
            check(shm.get("medium") == "Memory", "%s: %s mounts a Memory emptyDir on /dev/shm" % (overlay, dname))
            drain = [float(a.split("=")[1]) for a in c["args"] if a.startswith("--drain-timeout=")]
            pre = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
            pre_s = float(pre[1]) if pre[:1] == ["sleep"] else 0
            grace = spec.get("terminationGracePeriodSeconds", 30)
            check(drain and pre_s > 0 and pre_s + drain[0] < grace, "%s: %s drains within its grace period "
                  "(preStop %gs + drain %gs < %ds)" % (overlay, dname, pre_s, drain[0] if drain else -1, grace))
    for name, s in svcs.items():
        match = [d for d in deps.values() if selects({"matchLabels": s["spec"]["selector"]},
                                                     d["spec"]["template"]["metadata"]["labels"])]
        check(len(match) == 1, "%s: Service %s selects one Deployment" % (overlay, name))
        if match:
            names = {p["name"] for p in match[0]["spec"]["template"]["spec"]["containers"][0].get("ports", [])}
            for p in s["spec"]["ports"]:
                check(p["targetPort"] in names, "%s: Service %s port %s targets a declared port" % (overlay, name, p["name"]))
    proxy = deps["pd-proxy"]["spec"]["template"]["spec"]["containers"][0]["args"]
    for role in ("prefill", "decode"):
        arg = [a for a in proxy if a.startswith("--discover-%s=" % role)]
        host = arg[0].split("=", 1)[1].split(":")[0] if arg else ""
        check(host in svcs and svcs[host]["spec"].get("clusterIP") == "None",
              "%s: the proxy discovers %s through the headless Service %r" % (overlay, role, host))
    network_rules(overlay, objs, deps)
    autoscaler_rules(overlay, objs, deps, metric_names)


def network_rules(overlay, objs, deps):
    pool = {"pd-prefill", "pd-decode"}
    host_net = all(deps[d]["spec"]["template"]["spec"].get("hostNetwork") for d in pool)
    pols = list(by_kind(objs, "NetworkPolicy").values())
    for d in sorted(pool):
        c = deps[d]["spec"]["template"]["spec"]["containers"][0]
        kv_ports = {p["name"] for p in c["ports"] if p["name"].startswith("kv")}
        labels = deps[d]["spec"]["template"]["metadata"]["labels"]
        mine = [p for p in pols if selects(p["spec"]["podSelector"], labels)]
        if host_net:
            check(True, "%s: %s uses the host's network (NetworkPolicy does not apply; firewall the host "
                  "ports)" % (overlay, d))
            continue
        check(bool(mine), "%s: a NetworkPolicy guards %s" % (overlay, d))
        covered, leaks = set(), []
        for p in mine:
            for rule in p["spec"].get("ingress", []):
                ports = {x["port"] for x in rule.get("ports", [])} or (kv_ports | {"*"})
                peers = rule.get("from", [])
                pool_only = bool(peers) and all(
                    "podSelector" in peer and "namespaceSelector" not in peer and
                    {n for n in deps if selects(peer["podSelector"], deps[n]["spec"]["template"]["metadata"]["labels"])}
                    <= pool for peer in peers)
                for kp in kv_ports & ports:
                    if pool_only:
                        covered.add(kp)
                    else:
                        leaks.append(kp)
        check(covered == kv_ports and not leaks, "%s: %s's KV ports %s are open to pool members only%s" %
              (overlay, d, sorted(kv_ports), (" (also admitted: %s)" % leaks) if leaks else ""))


def autoscaler_rules(overlay, objs, deps, metric_names):
    scaled = list(by_kind(objs, "ScaledObject").values()) + list(by_kind(objs, "HorizontalPodAutoscaler").values())
    check(len(scaled) >= 2, "%s: the pools autoscale (%d autoscalers)" % (overlay, len(scaled)))
    for s in scaled:
        target = s["spec"]["scaleTargetRef"]["name"]
        check(target in deps and target != "pd-proxy", "%s: %s %s scales Deployment %s" %
              (overlay, s["kind"], s["metadata"]["name"], target))
        for t in s["spec"].get("triggers", []):
            used = {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"[a-z_]+:[a-z0-9_:]+", t["metadata"]["query"])}
            check(used and used <= metric_names, "%s: %s %s queries exported metrics: %s" %
                  (overlay, s["kind"], s["metadata"]["name"], sorted(used)))
        for m in s["spec"].get("metrics", []):  # HPA: prometheus-adapter's vllm_x is the nodes' vllm:x
            name = m.get("pods", {}).get("metric", {}).get("name", "")
            check(name.replace("vllm_", "vllm:", 1) in metric_names, "%s: HPA %s scales on %s, an exported "
                  "metric (as the adapter names it)" % (overlay, s["metadata"]["name"], name))


def committed_secrets():
    for path in glob.glob(os.path.join(ROOT, "deploy", "**", "*.yaml"), recursive=True):
        with open(path) as f:
            for d in yaml.safe_load_all(f):
                if d and d.get("kind") == "Secret":
                    check(False, "%s commits a Secret" % os.path.relpath(path, ROOT))
    check(True, "no committed manifest holds a Secret (they come from secretGenerator)")


# ---------------------------------------------------------------------------------------- live

def http(port, path, body=None, timeout=60, key=None):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = "Bearer " + key
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path),
                                 data=None if body is None else json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_ready(port, proc, path="/health", secs=120):
    end = time.time() + secs
    while time.time() < end:
        if proc.poll() is not None:
            return False
        try:
            if http(port, path, timeout=2)[0] == 200:
                return True
        except Exception:
            pass
        time.sleep(0.2)
    return False


def rewrite(args, tmp, ports, env):
    out = []
    for a in args:
        for k, v in env.items():
            a = a.replace("$(%s)" % k, v)
        a = a.replace("/models", os.path.join(tmp, "models")).replace("/etc/pdserve/token", os.path.join(tmp, "token"))
        a = a.replace("0.0.0.0:7000", "127.0.0.1:0").replace("=0.0.0.0", "=127.0.0.1")
        if re.match(r"--port=\d+$", a):
            a = "--port=0"  # the process picks a free port and writes it to --port-file (start)
        if re.match(r"--kv-data-port=\d+$", a):
            a = "--kv-data-port=%d" % free_port()
        m = re.match(r"--discover-(prefill|decode)=([\w.-]+):(\d+)$", a)
        if m:
            a = "--discover-%s=localhost:%d" % (m.group(1), ports[m.group(1)])
        if a.startswith("--kv-cache-memory="):
            a = "--kv-cache-memory=256M"
        if a == "demo" and out and out[-1] == "--preset":
            a = "tiny"  # the same pipeline with a model sanitizer builds start in seconds
        out.append(a)
    return out


def container_env(c, secrets):
    """The container's env as the kubelet would set it: values, the pod IP, Secret keys."""
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e.get("valueFrom", {}):
            env[e["name"]] = "127.0.0.1"
        elif "secretKeyRef" in e.get("valueFrom", {}):
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = base64.b64decode(secrets[ref["name"]]["data"][ref["key"]]).decode()
    return env


def start(role, c, bindir, tmp, ports, secrets):
    """Starts the container's command; the HTTP port is the one the process bound and wrote to its
    --port-file (a port picked here could be taken by another process before the bind, and another
    server's /health would then answer). Sets ports[role]; returns (process, answered)."""
    env = container_env(c, secrets)
    port_file = os.path.join(tmp, role + ".port")
    for attempt in range(3):  # the fixed --kv-data-port (a free port here) can be taken before the bind
        args = rewrite(c["args"], tmp, ports, env) + ["--port-file", port_file]
        log_path = os.path.join(tmp, role + ".log")
        with open(log_path, "w") as log:
            p = subprocess.Popen([os.path.join(bindir, c["command"][0])] + args, stdout=log, stderr=log,
                                 env=dict(os.environ, **env))
        end = time.time() + 120
        while time.time() < end and p.poll() is None and not os.path.exists(port_file):
            time.sleep(0.1)
        if os.path.exists(port_file):
            with open(port_file) as f:
                ports[role] = int(f.read())
            return p, wait_ready(ports[role], p, "/version" if role == "proxy" else "/health")
        with open(log_path) as f:
            if p.poll() is None or "cannot listen" not in f.read():
                break
    return p, False


def live(objs, bindir, tmp):
    deps, secrets = by_kind(objs, "Deployment"), by_kind(objs, "Secret")
    with open(os.path.join(tmp, "token"), "wb") as f:
        f.write(base64.b64decode([s for n, s in secrets.items() if n.startswith("pdserve-cluster-token")][0]
                                 ["data"]["token"]))
    key = base64.b64decode([s for n, s in secrets.items() if n.startswith("pdserve-keys")][0]["data"]["api-key"]).decode()
    os.makedirs(os.path.join(tmp, "models"), exist_ok=True)  # the emptyDir volume
    ports = {}  # role → the HTTP port its process bound
    procs = []
    try:
        for role in ("prefill", "decode", "proxy"):
            spec = deps["pd-" + role]["spec"]["template"]["spec"]
            for ic in spec.get("initContainers", []):
                cmd = [os.path.join(bindir, ic["command"][0])] + rewrite(ic["command"][1:], tmp, {}, {})
                out_dir = cmd[cmd.index("--out") + 1] if "--out" in cmd else None
                if out_dir is not None and os.path.isdir(out_dir):
                    continue  # both pools' init containers make the same model
                r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
                if r.returncode != 0:
                    sys.stdout.write(r.stderr.decode()[-2000:])
                check(r.returncode == 0, "pd-%s init container %s ran" % (role, ic["name"]))
            c = spec["containers"][0]
            p, ok = start(role, c, bindir, tmp, ports, secrets)
            procs.append((role, p))
            if not ok:
                with open(os.path.join(tmp, role + ".log")) as f:
                    sys.stdout.write(f.read()[-3000:])
            if not check(ok, "pd-%s starts with the overlay's args and env and answers" % role):
                return
            if role != "proxy":
                info = json.loads(http(ports[role], "/pd/info")[1])
                want = {a.split("=", 1)[0][5:]: a.split("=", 1)[1] for a in c["args"] if a.startswith("--kv-")}
                check(info.get("pipe") == want.get("pipe") and info.get("transfer_mode") == want.get("transfer-mode"),
                      "pd-%s /pd/info: pipe %s, mode %s" % (role, info.get("pipe"), info.get("transfer_mode")))
        end = time.time() + 30  # the proxy's first discovery and probe rounds
        while time.time() < end and http(ports["proxy"], "/health", timeout=5)[0] != 200:
            time.sleep(0.2)
        body = {"model": "demo", "prompt": "deploy smoke test", "max_tokens": 4, "temperature": 0}
        st, _ = http(ports["proxy"], "/v1/completions", body)
        check(st == 401, "the proxy refuses a request without the Secret's API key: HTTP %d" % st)
        st, _ = http(ports["decode"], "/v1/completions", body)
        check(st == 401, "a node refuses a request without the key (VLLM_API_KEY from the Secret): HTTP %d" % st)
        st, out = http(ports["proxy"], "/v1/completions", body, key=key)
        out = json.loads(out)
        check(st == 200 and out["usage"]["completion_tokens"] == 4,
              "a keyed completion through the proxy (prefill → decode): HTTP %d, %s tokens" %
              (st, out.get("usage", {}).get("completion_tokens")))
        scraped = {}
        for role in ("prefill", "decode", "proxy"):
            scraped[role] = http(ports[role], "/metrics")[1].decode()
        m = re.search(r'^pd:kv_transfers_completed_total\{kind="pull_load"\} (\S+)$', scraped["decode"], re.M)
        done = float(m.group(1)) if m else 0
        check(done >= 1, "the decode loaded the prompt's KV from the prefill (cluster token, advertised "
              "address, fixed tcp data port): %.0f transfer(s)" % done)
        dashboard(scraped)
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


def dashboard(scraped):
    names = set()
    for text in scraped.values():
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                names.add(line.split()[2])
    path = os.path.join(ROOT, "deploy", "grafana", "pdserve-dashboard.json")
    with open(path) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"[a-z_]+:[a-z0-9_:]+", e)}
    missing = sorted(used - names)
    check(len(dash["panels"]) >= 10 and used and not missing,
          "the Grafana dashboard's %d panels query %d metrics, all exported by the live nodes and proxy%s" %
          (len(dash["panels"]), len(used), (": missing " + ", ".join(missing)) if missing else ""))


def main():
    if len(sys.argv) != 3:
        print("usage: check_deploy.py BIN_DIR NPM_DIR")
        return 2
    bindir, npm_dir = sys.argv[1], sys.argv[2]
    for tool in ("kubectl", "node", "npm"):
        if not check(shutil.which(tool) is not None, "%s is installed (tools/install-deps.sh)" % tool):
            return 1
    r = subprocess.run([os.path.join(ROOT, "tests", "reference", "npm_install.sh"), npm_dir] + NPM_PACKAGES.split(),
                       capture_output=True, text=True, timeout=300)
    if not check(r.returncode == 0, "npm installed %s%s" % (NPM_PACKAGES, (": " + r.stdout[-500:]) if r.returncode else "")):
        return 1
    tmp = tempfile.mkdtemp(prefix="pd-deploy-")
    try:
        deploy = os.path.join(tmp, "deploy")
        shutil.copytree(os.path.join(ROOT, "deploy"), deploy,
                        ignore=shutil.ignore_patterns("cluster-token", "api-key"))  # never the operator's
        for name in ("cluster-token", "api-key"):
            with open(os.path.join(deploy, "base", "secrets", name), "w") as f:
                f.write(base64.b64encode(os.urandom(24)).decode())
        # components/hpa, the autoscaling alternative to KEDA, rendered through a test-only overlay
        os.makedirs(os.path.join(deploy, "overlays", "cpu-hpa"))
        with open(os.path.join(deploy, "overlays", "cpu-hpa", "kustomization.yaml"), "w") as f:
            f.write("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [../../base]\n"
                    "components: [../../components/monitoring, ../../components/hpa]\n")
        committed_secrets()
        metric_names = exported_metric_names()
        rendered = {}
        for overlay in OVERLAYS + ("cpu-hpa",):
            objs = render(deploy, overlay)
            if objs:
                rendered[overlay] = objs
                validate_schemas(overlay, objs, npm_dir, tmp)
                static_checks(overlay, objs, bindir, metric_names)
        if "cpu" in rendered:
            live(rendered["cpu"], bindir, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("%d failed" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
