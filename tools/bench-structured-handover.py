#!/usr/bin/env python3
"""tools/bench-structured-handover.py BIN_DIR [MODE PIPE [N]] — the P/D second token of structured
streams whose schema the decode has not seen: 1 prefill + 1 decode (MODE/PIPE, default pull tcp)
behind pd-proxy, demo-preset model, N (default 10) streamed chat requests one at a time, each under a
json_schema with property names new to the cluster (so the decode has not walked its grammar),
greedy, 12 tokens. The first token comes from the prefill (first-token handover), the second from the
decode: prints the p50 and max of second − first and the p50 of third − second (the decode's steady
step). Run it once per build to compare them; loopback only, stops what it starts."""
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "faults"))
from cluster import Cluster  # noqa: E402
FAST = ["--kv-heartbeat-interval", "0.2", "--kv-heartbeat-misses", "5", "--kv-handshake-timeout", "2",
        "--kv-load-timeout", "10"]


def stream_times(port, i):
    """The arrival times of the token events of request i (schema i)."""
    schema = {"type": "object", "properties": {"k%d_%s" % (i, c): {"type": "string"} for c in "abcdef"},
              "required": ["k%d_a" % i]}
    body = {"model": "m", "stream": True, "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "Give me record %d as JSON" % i}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "r%d" % i, "schema": schema}}}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    times, buf = [], b""
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            ev = ev.decode()
            if not ev.startswith("data: ") or ev == "data: [DONE]":
                continue
            choices = json.loads(ev[6:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                times.append(time.time())
    c.close()
    return times


def main():
    bindir = sys.argv[1]
    mode, pipe = (sys.argv[2], sys.argv[3]) if len(sys.argv) > 3 else ("pull", "tcp")
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 10
    tmp = tempfile.mkdtemp(prefix="pd-structured-handover-")
    model = os.path.join(tmp, "model")
    subprocess.run([os.path.join(bindir, "pd-mkmodel"), "--preset", "demo", "--seed", "3", "--out", model],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    c = Cluster(bindir, tmp, model, mode, pipe, FAST, nprefill=1, ndecode=1,
                extra=["--max-model-len", "4096", "--max-num-batched-tokens", "512", "--kv-cache-memory", "1G"])
    gaps = []
    try:
        stream_times(c.proxy.port, 10 ** 6)  # connections up
        for i in range(n):
            t = stream_times(c.proxy.port, i)
            if len(t) >= 3:
                gaps.append((t[1] - t[0], t[2] - t[1]))
    finally:
        c.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if not gaps:
        print("no stream had 3 token events")
        return 1
    second = sorted(g[0] for g in gaps)
    third = sorted(g[1] for g in gaps)
    print("%s %s/%s: %d requests; second - first token p50 %.1f ms, max %.1f; third - second p50 %.1f ms" % (
        bindir, mode, pipe, len(gaps), 1e3 * second[len(second) // 2], 1e3 * second[-1],
        1e3 * third[len(third) // 2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
