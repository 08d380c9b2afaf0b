#!/usr/bin/python3
"""tests/deploy/check_pdctl.py BIN_DIR — deploy/local/pdctl end to end, on loopback.

A cluster from a config (tiny model, tcp pipe, 1 prefill + 1 decode + proxy) comes up; four
closed-loop clients send completions through the proxy the whole time while the decode pool is
scaled 1 → 2 → 1. No request may fail; the second decode must have served requests while it was
in the pool; status must report every process healthy; down must stop every process it started.
Exit 0 only if every check passed.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PDCTL = os.path.join(ROOT, "deploy", "local", "pdctl")
failures = []


def check(cond, what):
    print(("ok    " if cond else "FAIL  ") + what, flush=True)
    if not cond:
        failures.append(what)
    return cond


def pdctl(cfg, *args, timeout=240):
    r = subprocess.run([sys.executable, PDCTL, "-c", cfg] + list(args), capture_output=True, text=True,
                       timeout=timeout)
    sys.stdout.write(r.stdout + r.stderr)
    return r


class Load:
    """Closed-loop clients; every answer must be a 200 with the tokens asked for."""

    def __init__(self, port, clients=4):
        self.port, self.stop, self.ok, self.bad = port, False, 0, []
        self.mu = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(i,)) for i in range(clients)]

    def run(self, i):
        n = 0
        while not self.stop:
            body = {"model": "tiny", "prompt": "client %d request %d: %s" % (i, n, "x" * (n % 40)),
                    "max_tokens": 8, "ignore_eos": True}
            req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % self.port,
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    out = json.loads(r.read())
                good = out["usage"]["completion_tokens"] == 8
                why = "" if good else "short answer %s" % out["usage"]
            except urllib.error.HTTPError as e:
                good, why = False, "HTTP %d %s" % (e.code, e.read()[:200])
            except Exception as e:  # noqa: BLE001 (any failure is a failed request)
                good, why = False, repr(e)
            with self.mu:
                if good:
                    self.ok += 1
                else:
                    self.bad.append(why)
            n += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        for t in self.threads:
            t.join(timeout=90)

    def count(self):
        with self.mu:
            return self.ok


def served(port):
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
            text = r.read().decode()
    except Exception:
        return -1
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))


def proxy_metrics(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=5) as r:
        return r.read().decode()


def series_sum(text, name):
    return sum(float(v) for v in re.findall(r"^%s(?:\{[^}]*\})? (\S+)$" % re.escape(name), text, re.M))


def router_gauges(port, nodes):
    """The vLLM router's names on the proxy: healthy_pods_total counts the pools' members, and
    requests in prefill / decode show up per server while the load runs; promtool accepts the page."""
    in_flight = 0
    for _ in range(40):
        text = proxy_metrics(port)
        in_flight = max(in_flight, series_sum(text, "vllm:num_decoding_requests") +
                        series_sum(text, "vllm:num_prefill_requests"))
        time.sleep(0.05)
    check(series_sum(text, "vllm:healthy_pods_total") == nodes, "the proxy's vllm:healthy_pods_total is %d "
          "(%.0f)" % (nodes, series_sum(text, "vllm:healthy_pods_total")))
    check(in_flight > 0, "the proxy's vllm:num_prefill_requests / num_decoding_requests see the load (max %.0f)"
          % in_flight)
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    lint = [line for line in (r.stdout + r.stderr).splitlines() if line and "should not contain ':'" not in line
            and not line.startswith("vllm:healthy_pods_total non-counter")]  # the vLLM router's own name
    check(r.returncode in (0, 3) and not lint, "promtool accepts the proxy's /metrics%s" %
          ((": " + "; ".join(lint[:3])) if lint else ""))


def main():
    bindir = os.path.abspath(sys.argv[1])
    tmp = tempfile.mkdtemp(prefix="pd-pdctl-")
    cfg = os.path.join(tmp, "cluster.yaml")
    with open(cfg, "w") as f:
        f.write("bin_dir: %s\nrun_dir: %s/run\nmodel: %s/model\nmodel_preset: tiny\nserved_model_name: tiny\n"
                "drain_timeout: 10\nkv: {pipe: tcp, mode: pull}\n"
                "prefill: {count: 1, args: [--kv-cache-memory=256M, --threads=1, --drain-timeout=10]}\n"
                "decode: {count: 1, args: [--kv-cache-memory=256M, --threads=1, --drain-timeout=10]}\n"
                "proxy: {discover_interval: 0.3, args: [--health-interval=0.3, --policy=round-robin]}\n"
                % (bindir, tmp, tmp))
    pids = []
    try:
        r = pdctl(cfg, "up")
        m = re.search(r"PROXY_URL=http://127.0.0.1:(\d+)", r.stdout)
        if not check(r.returncode == 0 and m, "pdctl up: 1 prefill, 1 decode, proxy"):
            return 1
        port = int(m.group(1))
        state = json.load(open(os.path.join(tmp, "run", "state.json")))
        pids = [p["pid"] for p in state["procs"]]
        check(pdctl(cfg, "status").returncode == 0, "pdctl status: every process healthy")
        with Load(port) as load:
            time.sleep(2)
            router_gauges(port, 2)
            before = load.count()
            check(before > 0, "requests flow through the proxy before scaling (%d)" % before)
            r = pdctl(cfg, "scale", "decode", "2")
            check(r.returncode == 0, "pdctl scale decode 2 under load")
            state = json.load(open(os.path.join(tmp, "run", "state.json")))
            second = [p for p in state["procs"] if p["role"] == "decode" and p["idx"] == 1]
            pids += [p["pid"] for p in second]
            time.sleep(3)
            router_gauges(port, 3)
            n2 = served(second[0]["port"]) if second else -1
            check(n2 > 0, "the second decode served requests while in the pool (%.0f)" % n2)
            r = pdctl(cfg, "scale", "decode", "1")
            check(r.returncode == 0, "pdctl scale decode 1 under load (the second decode drained)")
            time.sleep(2)
            total = load.count()
        check(not load.bad, "no request failed while the pool grew and shrank (%d ok, %d failed%s)" %
              (load.ok, len(load.bad), (": " + "; ".join(load.bad[:3])) if load.bad else ""))
        check(total - before > 20, "requests kept flowing through the scaling (%d)" % (total - before))
        check(pdctl(cfg, "status").returncode == 0, "pdctl status after scaling: every process healthy")
        check(pdctl(cfg, "down").returncode == 0, "pdctl down")
        time.sleep(0.5)
        left = [pid for pid in pids if os.path.exists("/proc/%d" % pid) and
                open("/proc/%d/stat" % pid).read().split()[2] != "Z"]
        check(not left, "every process pdctl started has exited (%s)" % left)
        logs = sorted(f for f in os.listdir(os.path.join(tmp, "run")) if f.endswith(".log"))
        check(logs == ["decode-0.log", "decode-1.log", "prefill-0.log", "proxy.log"], "one log per process: %s" % logs)
    finally:
        pdctl(cfg, "down")
        for pid in pids:  # whatever is still there (a failed step) is not left behind
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)
    print("%d failed" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
