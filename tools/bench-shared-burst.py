#!/usr/bin/env python3
"""tools/bench-shared-burst.py BIN_DIR MODEL_DIR [N] — N (8) concurrent requests with one 480-token prompt
through 1 prefill + 1 decode + pd-proxy (pull, ucx, loopback, tests/faults/cluster.py), then the decode's
KV bytes received (pd:kv_transfer_bytes_total), remote loads put off for another's
(pd:kv_load_waits_total) and prefix-cache hits. Checks every answer is the same. Stops what it started."""
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "faults"))
import cluster as C  # noqa: E402


def main():
    bindir, model = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    tmp = tempfile.mkdtemp(prefix="pd-burst-")
    cl = C.Cluster(bindir, tmp, model, "pull", "ucx", [], nprefill=1, ndecode=1, tag="burst")
    try:
        prompt = [(i * 37 + 11) % 1500 + 5 for i in range(480)]
        body = {"model": C.MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        t0 = time.time()
        with ThreadPoolExecutor(n) as ex:
            outs = list(ex.map(lambda _: C.http(cl.proxy.port, "/v1/completions", body), range(n)))
        secs = time.time() - t0
        codes = [o[0] for o in outs]
        texts = {json.loads(o[1])["choices"][0]["text"] for o in outs if o[0] == 200}
        m = C.metrics(cl.decodes[0].port)
        print("%d requests: HTTP %s in %.2f s, %d distinct answer(s)" % (n, sorted(set(codes)), secs, len(texts)))
        for k in ("pd:kv_transfer_bytes_total", "pd:kv_load_waits_total", "vllm:prefix_cache_hits_total"):
            print("decode %s %.0f" % (k, m.get(k, float("nan"))))
        if codes != [200] * n or len(texts) != 1:
            sys.exit("bench-shared-burst: failed requests or differing answers (logs in %s)" % tmp)
    finally:
        cl.stop()


if __name__ == "__main__":
    main()
