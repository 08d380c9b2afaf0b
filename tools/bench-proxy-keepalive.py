#!/usr/bin/env python3
"""tools/bench-proxy-keepalive.py [BIN_DIR] [MODEL] — pd-proxy's upstream keep-alive (issue 53):
1 prefill + 1 decode (pull over tcp) behind pd-proxy with --upstream-idle-connections 0 (a new
connection per leg) and 4 (the default), two rounds in alternating order; 220 sequential
non-streamed requests of 2 tokens each (the first 20 not counted): the median and mean time per
request through the proxy. Loopback only; stops what it starts."""
import http.client
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "faults"))
from cluster import Cluster  # noqa: E402
FAST = ["--kv-heartbeat-interval", "0.2", "--kv-heartbeat-misses", "5", "--kv-handshake-timeout", "2", "--kv-load-timeout", "10"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
bindir = sys.argv[1] if len(sys.argv) > 1 else "build/bin"
model = sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "models", "sotu-demo")
res = {}
tmp = tempfile.mkdtemp()
for rnd in range(2):
    for idle in (["0"], ["4"]) if rnd == 0 else (["4"], ["0"]):
        c = Cluster(bindir, tmp, model, "pull", "tcp", FAST, nprefill=1, ndecode=1, tag="ka%s%d" % (idle[0], rnd),
                    proxy_extra=["--upstream-idle-connections", idle[0]])
        try:
            conn = http.client.HTTPConnection("127.0.0.1", c.proxy.port)
            lat = []
            for i in range(220):
                body = json.dumps({"model": "m", "prompt": "The state of the Union %d" % i, "max_tokens": 2, "temperature": 0})
                t = time.perf_counter()
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                r = conn.getresponse(); r.read()
                assert r.status == 200, r.status
                if i >= 20: lat.append(time.perf_counter() - t)
            res.setdefault(idle[0], []).append((statistics.median(lat) * 1e3, statistics.mean(lat) * 1e3))
        finally:
            c.stop()
shutil.rmtree(tmp, ignore_errors=True)
for k, v in res.items():
    print("idle %s: median/mean ms per request: %s" % (k, " ".join("%.3f/%.3f" % x for x in v)))
