#!/usr/bin/python3
"""tests/faults/run_faults.py BIN_DIR [--short] [--seed N] [--seconds S] [--modes pull:tcp,push:ucx,...]

`make faults` (long form) and CTest `faults_short` (--short): whole P/D clusters on loopback — two
prefills, two decodes and pd-proxy per transfer mode × pipe — under closed-loop load with unique
prompts (so KV really moves), while faults are injected at seeded random moments:

  kill-prefill / kill-decode / kill-proxy   SIGKILL, then a restart on the same HTTP port
  stop-prefill / stop-decode                SIGSTOP past the heartbeat timeout, then SIGCONT
  reset-control                             a control connection (each prefill's is reached through a
                                            relay) forwarded half a chunk, then reset on both sides
  churn-decode                              --churn N (10) SIGKILL + restarts of a random decode in a
                                            row: the prefills' fds, RSS and threads must stay flat
  expire-lease                              the decodes stopped 0.7 s, past prefill 1's 0.4 s hold timeout
                                            and short of the heartbeat death: its queued reads find
                                            their leases expired (STALE) and recompute

--conditional N runs the same with KV events on every node and the proxy routing kv-aware, prompts
under N tokens prefilled by a decode alone (`make faults` runs N = 48 after the plain run).

Every 200 answer is compared token for token with pd-serve's answer for the same prompt (greedy).
Every other request is streamed, so the proxy's first-token handover runs under the faults too; a
stream that does not end with [DONE] or carries an error event is a clean failure.
Outcomes per request: ok, near-tie (different tokens, but where they part the two tokens' raw
logprobs are within 1e-4 and the rest is what pd-serve continues from there: fp32 results depend
on the batch a request ran in, on pd-serve as on the cluster), wrong (200 but different tokens,
not a near-tie), clean failure (an HTTP error or a reset
connection), hung (no answer within 60 s). After the load drains: each live node's blocks in use
(pd:kv_blocks_used), fds, RSS and threads, compared with the same node after warm-up.

Prints a table fault × mode × pipe → outcomes and the leak figures. Exit 0 only when there are no
wrong and no hung answers, every fault took effect (a cut was made; a lease expired or a read
was STALE), every pool is free after drain (leases nobody reads end at the 5 s hold
timeout used here), and every process that was not restarted keeps its fds within 4, its private
RSS (RssAnon) within 64 MiB and its thread count at the warm-up figures (shared memory grows as
UCX peers' mapped KV pages get touched: reported, not judged). Every process started is stopped.
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import (MODEL_NAME, ClientThreads, Cluster, Node, http, metric_sum, near_tie,  # noqa: E402
                     near_tie_selfcheck, report, socket_fds, wait_free)

MAX_TOKENS = 6
# a lease nobody will read (its decode failed while the prefill was unreachable) ends at the hold
# timeout: 5 s here, so "free after drain" means nothing is pinned beyond it; prefill 1 holds for
# 0.4 s only, so that a decode stopped for 0.7 s finds its queued reads' leases expired
FAST = ["--kv-heartbeat-interval", "0.2", "--kv-heartbeat-misses", "5", "--kv-handshake-timeout", "2",
        "--kv-load-timeout", "10"]  # KV prefaulted: its pages count from the start
HOLD = [5, 0.4]
# evidence that an expire-lease fault took effect: leases that ended unread, reads answered STALE,
# transfers failed
EXPIRY_SIGNS = ("pd:kv_leases_expired_total", "pd:kv_stale_reads_total", "pd:kv_transfers_failed_total")


class Load(ClientThreads):
    """Closed-loop clients with unique prompts; every answer checked against pd-serve's."""

    def __init__(self, proxy_port, serve_port, seed, clients=3, conversations=False):
        self.proxy_port, self.serve_port = proxy_port, serve_port
        self.rng = random.Random(seed)
        # conversations: a client's next prompt is its last prompt, pd-serve's answer and a few new
        # tokens (the history's KV is on the nodes that served it: prefix hits, the offload tier, and
        # peer-to-peer fetches), a new conversation past 360 tokens
        self.conversations = conversations
        self.history = [[] for _ in range(clients)]
        self.lock = threading.Lock()
        self.counts = {"ok": 0, "near-tie": 0, "wrong": 0, "clean failure": 0, "hung": 0}
        super().__init__(clients)

    def prompt(self, i):
        with self.lock:
            if self.conversations and 0 < len(self.history[i]) < 360:
                return self.history[i] + [self.rng.randint(3, 250) for _ in range(self.rng.randint(4, 24))]
            n = self.rng.randint(5, 120)
            return [self.rng.randint(3, 250) for _ in range(n)]

    @staticmethod
    def finish_reasons(out):
        """The finish_reason values a streamed answer's events carried, in order (for the log)."""
        reasons = []
        for ev in out.decode(errors="replace").split("\n\n"):
            try:
                j = json.loads(ev[6:]) if ev.startswith("data: {") else {}
            except ValueError:
                continue
            reasons += [c["finish_reason"] for c in j.get("choices", []) if c.get("finish_reason")]
        return reasons

    @staticmethod
    def streamed_tokens(out):
        """The token ids of a streamed answer, or None when it did not end with [DONE] or carried an
        error event (a clean failure: the stream was cut or the request failed)."""
        got, done = [], False
        for ev in out.decode().split("\n\n"):
            if not ev.startswith("data: "):
                continue
            if ev[6:] == "[DONE]":
                done = True
                continue
            j = json.loads(ev[6:])
            if "error" in j:
                return None
            for c in j.get("choices", []):
                got += c.get("token_ids", [])
        return got if done else None

    def run(self, i):
        n = 0
        while not self.stopping:
            ids = self.prompt(i)
            body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": MAX_TOKENS, "return_token_ids": True,
                    "ignore_eos": True, "temperature": 0}
            try:
                ref = json.loads(http(self.serve_port, "/v1/completions", body)[1])["choices"][0]["token_ids"]
            except Exception:
                continue  # the reference server is never faulted; retry with another prompt
            self.history[i] = ids + ref  # the next turn (conversations)
            n += 1
            stream = n % 2 == 0  # every other request streamed: the proxy's first-token handover
            t0 = time.time()
            outcome = "clean failure"
            try:
                st, out = http(self.proxy_port, "/v1/completions", dict(body, stream=True) if stream else body,
                               timeout=60)
                got = self.streamed_tokens(out) if stream else json.loads(out)["choices"][0]["token_ids"]
                outcome = "clean failure" if got is None else "ok" if got == ref else "wrong"
                tie = near_tie(self.serve_port, ids, ref, got) if outcome == "wrong" else None
                if outcome == "wrong":  # the evidence, for the log: which prompt, both answers
                    outcome = "near-tie" if tie else outcome
                    # a streamed answer's events as they came (which leg's, how it ended)
                    why = " finish_reasons=%s at %.3f events=%s" % (self.finish_reasons(out), time.time(), out.decode(errors="replace").replace("\n\n", " | ")) if stream else ""
                    print("%s%s prompt=%s pd-serve=%s proxy=%s%s%s" % ("NEAR-TIE" if tie else "WRONG", " (streamed)" if stream else "", ids, ref, got, why, ": " + tie if tie else ""), file=sys.stderr, flush=True)
            except urllib.error.HTTPError:
                outcome = "clean failure"
            except Exception:
                outcome = "hung" if time.time() - t0 >= 59 else "clean failure"
            with self.lock:
                self.counts[outcome] += 1


def tier_corruptions(cluster):
    return sum(metric_sum(n.port, "pd:kv_offload_corrupt_blocks_total") for n in cluster.nodes())


def corrupt_tiers(cluster, tmp, rng):
    """Overwrites 16 bytes at every 4 KiB of each node's tier file past its header: each slot starts at
    such an offset (its pages first), so every block held there fails its checksum when read."""
    for n in cluster.nodes():
        path = os.path.join(tmp, n.tag + ".tier")
        if not os.path.exists(path):
            continue
        fd = os.open(path, os.O_WRONLY)
        try:
            for off in range(4096, os.fstat(fd).st_size, 4096):
                os.pwrite(fd, bytes(rng.randrange(256) for _ in range(16)), off)
        finally:
            os.close(fd)


def expiry_signs(cluster):
    return sum(metric_sum(n.port, m) for n in cluster.nodes() for m in EXPIRY_SIGNS)


def inject(cluster, fault, rng, spawn, churn, tmp):
    """Injects fault (spawn(n) starts n more clients and returns their Load); returns why it did not take
    effect, or None."""
    if fault == "corrupt-tier":  # --p2p: the nodes' offload tiers are corrupted under load
        # again every 0.25 s (a slot written since holds good data again) until a load finds one
        before = tier_corruptions(cluster)
        side = spawn(2)  # more conversations: their histories leave the pools for the tiers and return
        end = time.time() + 6
        while time.time() < end and tier_corruptions(cluster) == before:
            corrupt_tiers(cluster, tmp, rng)
            time.sleep(0.25)
        side.finish()
        if tier_corruptions(cluster) == before:
            return "no corrupted tier block was read in 6 s"
    if fault == "churn-decode":  # the prefills see `churn` peer deaths; judged after drain as always
        for _ in range(churn):
            node = rng.choice(cluster.decodes)
            node.kill()
            node.start()
            time.sleep(0.2)  # the proxy's next probe round; the load reaches the new decode
    elif fault.startswith("kill-"):
        role = fault[5:]
        node = cluster.proxy if role == "proxy" else rng.choice(cluster.prefills if role == "prefill"
                                                               else cluster.decodes)
        node.kill()
        time.sleep(0.3)
        node.start()
    elif fault.startswith("stop-"):
        node = rng.choice(cluster.prefills if fault == "stop-prefill" else cluster.decodes)
        os.kill(node.proc.pid, signal.SIGSTOP)
        time.sleep(1.6)  # past 5 missed heartbeats of 0.2 s
        os.kill(node.proc.pid, signal.SIGCONT)
    elif fault == "reset-control":
        relay = rng.choice(cluster.relays)
        before = relay.cuts
        relay.cut()  # heartbeats cross every control connection each 0.2 s
        end = time.time() + 2
        while relay.cuts == before and time.time() < end:
            time.sleep(0.01)
        if relay.cuts == before:
            return "no control connection carried a frame to cut"
    elif fault == "expire-lease":
        # a second try when the first window caught no finished prefill (a sanitizer build can take
        # longer than the 0.3 s between the hold and the stop's end to prefill a new request)
        for attempt in range(2):
            before = expiry_signs(cluster)
            for n in cluster.decodes:  # both: round-robin may pair one decode with one prefill only
                os.kill(n.proc.pid, signal.SIGSTOP)
            # new requests meanwhile: in push mode the clients' requests already hold their
            # reservations, so only a request that reaches a prefill now waits for a reservation
            # past the hold
            side = spawn(2)
            time.sleep(0.7)  # past prefill 1's 0.4 s hold, short of the 1 s heartbeat death
            for n in cluster.decodes:
                os.kill(n.proc.pid, signal.SIGCONT)
            side.finish()
            time.sleep(0.5)
            if expiry_signs(cluster) != before:
                return None
        return "no lease expired, no read was STALE and no transfer failed (two tries)"
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bindir")
    ap.add_argument("--short", action="store_true", help="the seeded subset make check runs")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=None, help="load per fault (default 6, short 3)")
    ap.add_argument("--modes", default=None, help="mode:pipe list (default all four; short pull:tcp)")
    ap.add_argument("--faults", default=None, help="comma-separated subset of the faults")
    ap.add_argument("--churn", type=int, default=10, help="decode deaths in churn-decode (default 10)")
    ap.add_argument("--conditional", type=int, default=0, metavar="N",
                    help="nodes publish KV events and the proxy routes kv-aware with "
                    "--pd-local-prefill-threshold N: prompts under N tokens are prefilled by a decode alone")
    ap.add_argument("--p2p", action="store_true",
                    help="conversations (each turn the last prompt, its answer and new tokens) on nodes with a "
                    "disk offload tier (a pool of 64 blocks) and KV events, pd-proxy fetching prefixes peer to "
                    "peer (--pd-prefix-fetch-min-blocks 1); adds corrupt-tier (every tier file overwritten "
                    "under load), and kill-decode kills lenders")
    ap.add_argument("--no-rss", action="store_true",
                    help="report private RSS but do not judge it (sanitizer builds: ASan's quarantine and "
                    "shadow memory grow with every allocation)")
    args = ap.parse_args()
    secs = args.seconds or (3.0 if args.short else 6.0)
    modes = [m.split(":") for m in (args.modes or ("pull:tcp,push:ucx" if args.short else
                                                   "pull:tcp,push:tcp,pull:ucx,push:ucx")).split(",")]
    faults = (["kill-prefill", "stop-decode", "reset-control", "expire-lease"] if args.short else
              ["none", "kill-prefill", "kill-decode", "kill-proxy", "stop-prefill", "stop-decode", "reset-control",
               "expire-lease", "churn-decode"])
    if args.p2p and not args.faults:
        faults = ["none", "corrupt-tier", "kill-decode", "stop-decode", "kill-prefill"]
    if args.faults:
        faults = args.faults.split(",")
    node_extra, proxy_extra = [], []
    tmp = tempfile.mkdtemp(prefix="pd-faults-")
    if args.conditional > 0:
        # the replay ring is bounded by design (vLLM's default of 10000 batches held 55-77 MB here, which
        # tripped the private-RSS check on every prefill, before and after 2026-11-24's changes): a
        # short ring keeps that check about leaks
        node_extra = ["--kv-events-config", json.dumps({"enable_kv_cache_events": True,
                                                        "endpoint": "tcp://127.0.0.1:*",
                                                        "replay_endpoint": "tcp://127.0.0.1:*",
                                                        "buffer_steps": 500})]
        proxy_extra = ["--policy", "kv-aware", "--pd-local-prefill-threshold", str(args.conditional)]
    if args.p2p:
        node_extra = ["--kv-events-config", json.dumps({"enable_kv_cache_events": True,
                                                        "endpoint": "tcp://127.0.0.1:*",
                                                        "replay_endpoint": "tcp://127.0.0.1:*",
                                                        "buffer_steps": 500}),
                      "--num-blocks-override", "64", "--kv-offload-tier", "disk", "--kv-offload-size", "16M",
                      "--kv-offload-path", os.path.join(tmp, "{node}.tier"), "--kv-prefix-fetch", "always",
                      # decodes lend too: a lend whose reader was killed before the proxy's release reached
                      # the lender ends at the hold timeout, 5 s as the prefills' (theirs come after this)
                      "--kv-hold-timeout", "5"]
        proxy_extra = ["--pd-prefix-fetch-min-blocks", "1"]
    rng = random.Random(args.seed)
    model = os.path.join(tmp, "model")
    subprocess.run([os.path.join(args.bindir, "pd-mkmodel"), "--preset", "tiny", "--seed", "3", "--out", model],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    serve = Node(tmp, "serve", [os.path.join(args.bindir, "pd-serve"), "--model", model, "--served-model-name",
                                MODEL_NAME, "--kv-cache-memory", "256M", "--threads", "1", "--max-model-len", "512"])
    rows, failed = [], []
    clusters = []
    try:
        serve.start()
        why = near_tie_selfcheck(serve.port)
        if why is not None:
            failed.append("the near-tie judge: " + why)
        for mode, pipe in modes:
            c = Cluster(args.bindir, tmp, model, mode, pipe, FAST, hold_timeouts=HOLD, extra=node_extra,
                        proxy_extra=proxy_extra)
            clusters.append(c)
            warm = Load(c.proxy.port, serve.port, rng.randint(0, 1 << 30), conversations=args.p2p)
            warm.start()
            time.sleep(1.5)
            warm.finish()
            base = {n.tag: n.figures() for n in c.nodes()}
            rows += [("warm-up", mode, pipe, {"node": n.tag, **base[n.tag]}) for n in c.nodes()]
            for fault in faults:
                load = Load(c.proxy.port, serve.port, rng.randint(0, 1 << 30), conversations=args.p2p)
                load.start()
                time.sleep(rng.uniform(0.3, secs / 2))
                sides = []

                def spawn(n):
                    sides.append(Load(c.proxy.port, serve.port, rng.randint(0, 1 << 30), clients=n,
                                      conversations=args.p2p))
                    sides[-1].start()
                    return sides[-1]

                why = inject(c, fault, rng, spawn, args.churn, tmp) if fault != "none" else None
                if why is not None:
                    failed.append("%s %s/%s did not take effect: %s" % (fault, mode, pipe, why))
                time.sleep(secs / 2)
                load.finish()
                for side in sides:
                    side.finish()
                    for k, v in side.counts.items():
                        load.counts[k] += v
                rows.append((fault, mode, pipe, dict(load.counts)))
                if load.counts["wrong"] or load.counts["hung"]:
                    failed.append("%s %s/%s: %d wrong, %d hung" % (fault, mode, pipe, load.counts["wrong"],
                                                                  load.counts["hung"]))
                time.sleep(1.0)  # restarted nodes rejoin the proxy's pools
            if args.p2p:  # the fetches, the tiers and their corruption all happened (proxy: since its last start)
                seen = {"lent": metric_sum(c.proxy.port, 'pd_proxy:prefix_fetches_total{result="lent"}'),
                        "tier hits": sum(metric_sum(n.port, "pd:kv_offload_hits_total") for n in c.nodes()),
                        "tier corrupt": tier_corruptions(c)}
                rows.append(("p2p", mode, pipe, seen))
                if not seen["tier hits"] or not seen["lent"]:
                    failed.append("%s/%s: %s" % (mode, pipe, "no offload tier hit" if not seen["tier hits"]
                                                 else "no prefix was lent"))
            if args.conditional > 0:  # both paths ran (counted since the proxy's last start)
                where = {w: metric_sum(c.proxy.port, 'pd_proxy:prefills_total{where="%s"}' % w)
                         for w in ("local", "remote")}
                rows.append(("prefilled", mode, pipe, where))
                if not where["local"] or not where["remote"]:
                    failed.append("%s/%s: prefills local %s, remote %s: one path never ran" %
                                  (mode, pipe, where["local"], where["remote"]))
            for n in c.nodes():
                used = wait_free(n.port)
                if used != 0:
                    failed.append("%s: %s blocks still used after drain" % (n.tag, used))
                f = n.figures()
                b = base.get(n.tag)
                restarted = b is None or n.proc.pid != b["pid"]  # a restarted process has no baseline
                rows.append(("after drain", mode, pipe, {"node": n.tag, **f}))
                if not restarted:
                    if f["fds"] > b["fds"] + 4:
                        failed.append("%s: fds %d -> %d; its TCP sockets now: %s" %
                                      (n.tag, b["fds"], f["fds"], "; ".join(socket_fds(f["pid"]))))
                    if not args.no_rss and f["rss_anon_kib"] > b["rss_anon_kib"] + 64 * 1024:
                        failed.append("%s: private RSS %d -> %d KiB" % (n.tag, b["rss_anon_kib"], f["rss_anon_kib"]))
                    if f["threads"] > b["threads"]:
                        failed.append("%s: threads %d -> %d" % (n.tag, b["threads"], f["threads"]))
            c.stop()
    finally:
        for c in clusters:
            c.stop()
        serve.stop()
    return report("fault", rows, failed, tmp, "faults")


if __name__ == "__main__":
    sys.exit(main())
