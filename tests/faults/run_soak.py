#!/usr/bin/python3
"""tests/faults/run_soak.py BIN_DIR [--seconds S] [--short] [--mode pull] [--pipe tcp] [--no-rss]

`make soak SOAK_SECONDS=600` (and CTest `soak_short`): 1 prefill + 1 decode + pd-proxy on loopback
with a cluster token, driven for S seconds by open-loop Poisson arrivals at 80% of the throughput a
calibration run measured (just under saturation), with unique prompts so KV really moves, while a
hostile side opens connections to every port the three processes listen on (HTTP, KV control, the
tcp pipe's data port): connect-and-close, garbage, half a frame held open for 2 s, malformed HTTP
and JSON.

Every answer must be a 200; one in four is compared token for token with pd-serve's (a near-tie,
as run_faults.py and cluster.near_tie say, is counted, not failed). After warm-up
the fds, private RSS (RssAnon) and threads of each process are taken; after the run and a drain,
each must be within 5% of that (fds and threads: +2 of slack; RSS: +1 MiB, as pd-proxy's whole
private RSS is under 1 MiB and malloc's arenas alone move it by 30%), and both block pools must be
empty. Prints the figures; exit 0 only when all of that holds. Every
process started is stopped.
"""
import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import (MODEL_NAME, Cluster, Node, http, listening_ports, metric, near_tie, socket_fds,  # noqa: E402
                     near_tie_selfcheck, wait_free)

FAST = ["--kv-heartbeat-interval", "0.2", "--kv-heartbeat-misses", "5", "--kv-handshake-timeout", "2",
        "--kv-load-timeout", "10", "--kv-hold-timeout", "5"]
MAX_TOKENS = 8
CHECK_EVERY = 4


class Traffic:
    """Requests through the proxy; outcomes counted, every CHECK_EVERY-th compared with pd-serve."""

    def __init__(self, proxy_port, serve_port, seed):
        self.proxy_port, self.serve_port = proxy_port, serve_port
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.n = 0
        self.counts = {"ok": 0, "checked": 0, "near-tie": 0, "wrong": 0, "failed": 0}
        self.failures = []

    def one(self):
        with self.lock:
            self.n += 1
            check = self.n % CHECK_EVERY == 0
            ids = [self.rng.randint(3, 250) for _ in range(self.rng.randint(16, 200))]
        body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": MAX_TOKENS, "return_token_ids": True,
                "ignore_eos": True, "temperature": 0}
        outcome, why = "ok", None
        try:
            got = json.loads(http(self.proxy_port, "/v1/completions", body, timeout=60)[1])["choices"][0]["token_ids"]
            if check:
                ref = json.loads(http(self.serve_port, "/v1/completions", body)[1])["choices"][0]["token_ids"]
                outcome = "wrong" if got != ref else "ok"
                tie = near_tie(self.serve_port, ids, ref, got) if outcome == "wrong" else None
                if outcome == "wrong":  # the evidence, for the log: which prompt, both answers
                    outcome = "near-tie" if tie else outcome
                    print("%s prompt=%s pd-serve=%s proxy=%s%s" % ("NEAR-TIE" if tie else "WRONG", ids, ref, got,
                                                                   ": " + tie if tie else ""), file=sys.stderr, flush=True)
        except urllib.error.HTTPError as e:
            outcome, why = "failed", "HTTP %d: %s" % (e.code, e.read()[:200])
        except Exception as e:  # reset, timeout
            outcome, why = "failed", repr(e)
        with self.lock:
            self.counts[outcome] += 1
            self.counts["checked"] += check and outcome != "failed"
            if why and len(self.failures) < 10:
                self.failures.append(why)
        return outcome

    def closed_loop(self, clients, secs):
        """Requests answered per second by `clients` back-to-back clients."""
        end = time.time() + secs
        done = [0]

        def run():
            while time.time() < end:
                if self.one() == "ok":
                    with self.lock:
                        done[0] += 1

        ts = [threading.Thread(target=run) for _ in range(clients)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return done[0] / secs

    def open_loop(self, rate, secs, progress=None):
        """Poisson arrivals at rate per second for secs (each in a pool thread)."""
        end = time.time() + secs
        next_report = time.time() + 30
        with ThreadPoolExecutor(max_workers=64) as pool:
            t = time.time()
            while t < end:
                t += self.rng.expovariate(rate)
                delay = t - time.time()
                if delay > 0:
                    time.sleep(delay)
                pool.submit(self.one)
                if progress and time.time() >= next_report:
                    next_report += 30
                    progress()


class Hostile:
    """Unauthenticated traffic on every listening port, `rate` connections per second."""

    def __init__(self, ports, http_ports, rate, seed):
        self.ports, self.http_ports, self.rate = ports, set(http_ports), rate
        self.rng = random.Random(seed)
        self.count = 0
        self.held = []  # (close at, socket): half frames kept open
        self.stopping = False
        self.thread = threading.Thread(target=self.run)

    def attack(self, port):
        s = socket.socket()
        s.settimeout(1)
        try:
            s.connect(("127.0.0.1", port))
            kind = self.rng.randrange(4)
            if kind == 0:
                pass  # connect and close
            elif kind == 1:
                s.sendall(bytes(self.rng.randrange(256) for _ in range(self.rng.randint(1, 300))))
            elif kind == 2:  # half a frame (a length that promises more), held open
                s.sendall(b"\x00\x00\x01\x00\x01" if port not in self.http_ports else b"POST /v1/completions HTTP/1.1\r\n")
                self.held.append((time.time() + 2, s))
                return
            elif port in self.http_ports:  # a malformed request
                body = self.rng.choice([b"{", b'{"prompt": [1, 2], "max_tokens": "x"}', b"\x00\xff" * 10])
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                s.recv(4096)
            else:
                s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        except OSError:
            pass
        s.close()

    def run(self):
        while not self.stopping:
            self.attack(self.rng.choice(self.ports))
            self.count += 1
            now = time.time()
            while self.held and self.held[0][0] <= now:
                self.held.pop(0)[1].close()
            time.sleep(1.0 / self.rate)
        for _, s in self.held:
            s.close()

    def start(self):
        self.thread.start()

    def stop(self):
        self.stopping = True
        self.thread.join()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bindir")
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--short", action="store_true", help="20 s, the form make check runs")
    ap.add_argument("--mode", default="pull")
    ap.add_argument("--pipe", default="tcp")
    ap.add_argument("--hostile-rate", type=float, default=None, help="hostile connections per second "
                    "(default: enough for 10,000 in the run, at least 50/s)")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--no-rss", action="store_true", help="report private RSS, do not judge it (sanitizers)")
    args = ap.parse_args()
    secs = 20.0 if args.short else args.seconds
    cal_secs, warm_secs = (4.0, 4.0) if args.short else (10.0, max(10.0, secs / 20))
    hostile_rate = args.hostile_rate or max(50.0, 10000.0 / secs)
    rng = random.Random(args.seed)
    tmp = tempfile.mkdtemp(prefix="pd-soak-")
    model = os.path.join(tmp, "model")
    token = os.path.join(tmp, "token")
    with open(token, "w") as f:
        f.write("%032x" % rng.getrandbits(128))

    subprocess.run([os.path.join(args.bindir, "pd-mkmodel"), "--preset", "tiny", "--seed", "3", "--out", model],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    serve = Node(tmp, "serve", [os.path.join(args.bindir, "pd-serve"), "--model", model, "--served-model-name",
                                MODEL_NAME, "--kv-cache-memory", "256M", "--threads", "1", "--max-model-len", "512"])
    cluster, failed, rows = None, [], []
    try:
        serve.start()
        why = near_tie_selfcheck(serve.port)
        if why is not None:
            failed.append("the near-tie judge: " + why)
        cluster = Cluster(args.bindir, tmp, model, args.mode, args.pipe, FAST, nprefill=1, ndecode=1,
                          extra=["--cluster-token-file", token], tag="soak")
        procs = [cluster.prefills[0], cluster.decodes[0], cluster.proxy]
        traffic = Traffic(cluster.proxy.port, serve.port, rng.randint(0, 1 << 30))
        capacity = traffic.closed_loop(4, cal_secs)
        rate = max(1.0, 0.8 * capacity)
        print("soak: capacity %.1f req/s (4 closed-loop clients, %.0f s); driving %.1f req/s for %.0f s with "
              "%.0f hostile connections/s" % (capacity, cal_secs, rate, secs, hostile_rate), flush=True)
        traffic.open_loop(rate, warm_secs)
        time.sleep(1)
        base = {n.tag: n.figures() for n in procs}  # warm, before any hostile connection
        before = dict(traffic.counts)
        ports = [p for n in procs for p in listening_ports(n.proc.pid)]
        hostile = Hostile(ports, [n.port for n in procs], hostile_rate, rng.randint(0, 1 << 30))
        hostile.start()
        t0 = time.time()

        def progress():
            c = traffic.counts
            print("soak: %4.0f s  requests ok %d failed %d wrong %d  hostile connections %d" %
                  (time.time() - t0, c["ok"], c["failed"], c["wrong"], hostile.count), flush=True)

        traffic.open_loop(rate, secs, progress)
        hostile.stop()
        for n in cluster.nodes():
            used = wait_free(n.port)
            if used != 0:
                failed.append("%s: %s blocks still used after drain" % (n.tag, used))
        time.sleep(1)
        for n in procs:
            b, f = base[n.tag], n.figures()
            rows.append((n.tag, b, f))
            if f["fds"] > b["fds"]:
                print("soak: %s holds %d more fds than when warm; its TCP sockets: %s" %
                      (n.tag, f["fds"] - b["fds"], "; ".join(socket_fds(f["pid"]))), flush=True)
                print("  new: %s" % sorted((k, v) for k, v in f["links"].items() if b["links"].get(k) != v))
            if f["fds"] > max(b["fds"] * 1.05, b["fds"] + 2):
                failed.append("%s: fds %d -> %d; its TCP sockets now: %s" % (n.tag, b["fds"], f["fds"],
                                                                          "; ".join(socket_fds(f["pid"]))))
            if not args.no_rss and f["rss_anon_kib"] > max(b["rss_anon_kib"] * 1.05, b["rss_anon_kib"] + 1024):
                failed.append("%s: private RSS %d -> %d KiB" % (n.tag, b["rss_anon_kib"], f["rss_anon_kib"]))
            if f["threads"] > b["threads"] + 2:
                failed.append("%s: threads %d -> %d" % (n.tag, b["threads"], f["threads"]))
        c = traffic.counts
        run = {k: c[k] - before[k] for k in c}
        if c["failed"] or c["wrong"]:
            failed.append("%d failed, %d wrong requests (first: %s)" % (c["failed"], c["wrong"], traffic.failures[:3]))
        if traffic.counts["checked"] == 0:
            failed.append("no answer was compared with pd-serve's")
        print("soak: %.0f s at %.1f req/s: %d requests answered in the run (%d compared with pd-serve), %d failed, "
              "%d wrong, %d near-ties; %d hostile connections on %d ports" % (secs, rate, run["ok"] + run["wrong"] + run["near-tie"],
                                                                  run["checked"], c["failed"], c["wrong"], c["near-tie"],
                                                                  hostile.count, len(ports)))
        print("%-14s %21s %27s %17s" % ("process", "fds warm -> end", "private RSS KiB warm -> end",
                                        "threads"))
        for tag, b, f in rows:
            print("%-14s %10d -> %-8d %12d -> %-12d %6d -> %-6d" % (tag, b["fds"], f["fds"], b["rss_anon_kib"],
                                                                 f["rss_anon_kib"], b["threads"], f["threads"]))
        print("soak: blocks used after drain: %s" % ", ".join("%s %s" % (n.tag, metric(n.port, "pd:kv_blocks_used"))
                                                              for n in cluster.nodes()))
    finally:
        if cluster is not None:
            cluster.stop()
        serve.stop()
    for f in failed:
        print("FAIL  " + f)
    print("soak: %d failed (logs in %s)" % (len(failed), tmp))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
