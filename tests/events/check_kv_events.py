"""tests/events/check_kv_events.py BUILD_DIR — KV cache events (--kv-events-config) as a vLLM-style
subscriber sees them: a pd-prefill node publishes on ZMQ (loopback, ports it picks); this script
subscribes with pyzmq, decodes with msgpack (the reference decoders, not our code) and checks:

  * the batches' sequence numbers run 0, 1, 2, ... with no gap, seq 0 being AllBlocksCleared;
  * BlockStored events carry the prompt's full blocks (token ids, block size, parent chaining: a
    prompt's first block has no parent, a later event continues from the hash it names);
  * a repeated prompt stores nothing (a prefix hit); one that shares a first block stores only the
    rest, chained onto that block's hash;
  * with few KV blocks, BlockRemoved only ever names hashes that were stored and not yet removed;
  * the replay endpoint returns every buffered batch from a sequence number, byte for byte as
    published, then the end mark; malformed replay requests are dropped and the node goes on;
  * a restarted node starts again at seq 0 with AllBlocksCleared;
  * a bad --kv-events-config stops the node at start with a message naming the flag.

Loopback only; every process started here is stopped."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import msgpack
import zmq

BUILD = sys.argv[1] if len(sys.argv) > 1 else "build"
BIN = os.path.join(BUILD, "bin")
BS = 16


def http(port, path, body=None):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path),
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def start_node(work, model, tag, events_cfg, extra=()):
    port_file = os.path.join(work, tag + ".port")
    log = open(os.path.join(work, tag + ".log"), "w")
    args = [os.path.join(BIN, "pd-prefill"), "--model", model, "--served-model-name", "m", "--port", "0",
            "--port-file", port_file, "--kv-cache-memory", "128M", "--threads", "1", "--max-model-len", "256",
            "--num-blocks-override", "24", "--kv-pipe", "tcp", "--no-kv-prefault",
            "--insecure-no-kv-auth",  # one node, no peers: the flag's own path
            "--kv-events-config", json.dumps(events_cfg)] + list(extra)
    p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while time.time() < deadline:
        if p.poll() is not None:
            return p, None
        if os.path.exists(port_file) and open(port_file).read().strip():
            return p, int(open(port_file).read())
        time.sleep(0.1)
    p.kill()
    raise SystemExit("kv events: %s did not start" % tag)


def stop(p):
    p.terminate()
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


class Subscriber:
    def __init__(self, ctx, info):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(info["kv_events_endpoint"])
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.connect(info["kv_events_replay_endpoint"])
        self.batches = {}  # seq -> payload bytes

    def poll(self, wait_s):
        """Every batch that arrives within wait_s (returns as soon as the stream is quiet 0.3 s)."""
        got = []
        deadline = time.time() + wait_s
        while time.time() < deadline:
            if not self.sub.poll(300):
                if got:
                    break
                continue
            topic, seq, payload = self.sub.recv_multipart()
            s = int.from_bytes(seq, "big")
            self.batches[s] = payload
            got.append((s, payload))
        return got

    def replay(self, start):
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            if not self.dealer.poll(5000):
                raise AssertionError("replay: no answer")
            frames = self.dealer.recv_multipart()
            assert len(frames) == 3 and frames[0] == b"", frames
            s = int.from_bytes(frames[1], "big", signed=True)
            if s == -1:
                assert frames[2] == b""
                return out
            out.append((s, frames[2]))

    def close(self):
        self.sub.close(0)
        self.dealer.close(0)


def events_of(payload):
    batch = msgpack.unpackb(payload, raw=False)
    assert isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[0], float), batch
    return batch[1]


def complete(port, prompt):
    return http(port, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0,
                                          "ignore_eos": True})


def main():
    work = tempfile.mkdtemp(prefix="pd-events-")
    procs = []
    ctx = zmq.Context()
    try:
        model = os.path.join(work, "model")
        subprocess.run([os.path.join(BIN, "pd-mkmodel"), "--out", model, "--preset", "tiny", "--arch", "llama",
                        "--seed", "3"], check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PD_LOG_LEVEL="warn"))
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*",
               "replay_endpoint": "tcp://127.0.0.1:*", "buffer_steps": 4096, "topic": "kv@test"}

        # a bad config stops the node at start, naming the flag
        p, port = start_node(work, model, "bad", dict(cfg, surprise=1))
        assert port is None and p.wait(30) != 0, "a node with an unknown --kv-events-config key started"
        assert "--kv-events-config" in open(os.path.join(work, "bad.log")).read()

        p, port = start_node(work, model, "node", cfg)
        procs.append(p)
        info = http(port, "/pd/info")
        assert info["kv_events_endpoint"].startswith("tcp://127.0.0.1:"), info
        sub = Subscriber(ctx, info)
        time.sleep(0.3)  # the SUB connection is up before the first request's events

        # seq 0 went out before anyone subscribed: replay has it
        first = sub.replay(0)
        assert first and first[0][0] == 0 and events_of(first[0][1]) == [["AllBlocksCleared"]], first

        live = {}    # hash -> token ids (stored, not removed)
        parent_of = {}

        def apply(batches):
            for s, payload in batches:
                for ev in events_of(payload):
                    kind = ev[0]
                    if kind == "BlockStored":
                        hashes, parent, toks, bs, lora, medium = ev[1:7]
                        assert bs == BS and lora is None and medium == "CPU", ev
                        assert len(toks) == BS * len(hashes), ev
                        assert parent is None or parent in live, "stored after an unknown parent %r" % parent
                        prev = parent
                        for k, h in enumerate(hashes):
                            assert h not in live, "hash %d stored twice without removal" % h
                            live[h] = toks[k * BS:(k + 1) * BS]
                            parent_of[h] = prev
                            prev = h
                    elif kind == "BlockRemoved":
                        hashes, medium = ev[1:3]
                        for h in hashes:
                            assert h in live, "removal of hash %d that is not stored" % h
                            del live[h]
                    else:
                        assert kind == "AllBlocksCleared", ev
                        live.clear()

        def chain_of(prompt):
            """The stored hashes covering prompt's full blocks, by following token ids."""
            out, prev = [], None
            for b in range(len(prompt) // BS):
                want = prompt[b * BS:(b + 1) * BS]
                hit = [h for h, t in live.items() if t == want and parent_of[h] == prev]
                if not hit:
                    break
                out.append(hit[0])
                prev = hit[0]
            return out

        apply(first)
        a = [3 + (i * 7) % 240 for i in range(40)]           # 2 full blocks + 8 tokens
        complete(port, a)
        got = sub.poll(5)
        apply(got)
        assert len(chain_of(a)) == 2, "prompt a's two full blocks are not stored as a chain: %r" % got
        complete(port, a)                                    # a prefix hit: nothing new
        assert not [e for s, p in sub.poll(1.5) for e in events_of(p) if e[0] == "BlockStored"]
        b = a[:BS] + [5 + (i * 11) % 240 for i in range(24)]  # shares a's first block
        complete(port, b)
        got = sub.poll(5)
        stored = [e for s, p in got for e in events_of(p) if e[0] == "BlockStored"]
        apply(got)
        assert len(stored) == 1 and len(stored[0][1]) == 1, stored
        assert stored[0][2] == chain_of(a)[0], "b's second block is not chained onto a's first"

        # 23 usable blocks: distinct prompts evict earlier ones
        for k in range(12):
            complete(port, [7 + (k * 31 + i * 13) % 240 for i in range(40)])
            apply(sub.poll(5))
        removed = sum(len(e[1]) for p in sub.batches.values() for e in events_of(p) if e[0] == "BlockRemoved")
        assert removed > 0, "no BlockRemoved with 24 KV blocks"
        seqs = sorted(sub.batches)
        assert seqs == list(range(1, seqs[-1] + 1)), "sequence gap: %r" % seqs

        # replay from the middle returns the published bytes, then the end mark
        mid = seqs[len(seqs) // 2]
        rep = sub.replay(mid)
        assert [s for s, _ in rep] == list(range(mid, seqs[-1] + 1)), [s for s, _ in rep]
        assert all(sub.batches[s] == payload for s, payload in rep), "a replayed batch differs"
        # malformed replay requests are dropped; the node answers the next good one
        sub.dealer.send_multipart([b"", b"xyz"])
        sub.dealer.send_multipart([b"", b"1", b"2", b"3"])
        assert [s for s, _ in sub.replay(seqs[-1])] == [seqs[-1]]
        sub.close()

        # a restarted node starts over at seq 0 with AllBlocksCleared
        stop(p)
        procs.remove(p)
        p, port = start_node(work, model, "node2", cfg)
        procs.append(p)
        sub = Subscriber(ctx, http(port, "/pd/info"))
        again = sub.replay(0)
        assert again[0][0] == 0 and events_of(again[0][1]) == [["AllBlocksCleared"]], again
        sub.close()
        stop(p)
        procs.remove(p)

        # --kv-offload-tier: a block the pool evicts is stored in the tier ("CPU_TIER", no parent,
        # no token ids, as vLLM's offloading connector reports its CPU tier) and, when a prompt needs
        # it again, stored in the pool again from there (cached_tokens counts it)
        p, port = start_node(work, model, "tier", cfg, ["--kv-offload-tier", "host", "--kv-offload-size", "16M"])
        procs.append(p)
        sub = Subscriber(ctx, http(port, "/pd/info"))
        time.sleep(0.3)
        pool, tier, pool_chains = set(), set(), []

        def apply_media(batches):
            for s, payload in batches:
                for ev in events_of(payload):
                    if ev[0] == "BlockStored":
                        hashes, parent, toks, bs, lora, medium = ev[1:7]
                        if medium == "CPU_TIER":
                            assert parent is None and toks == [] and bs == BS, ev
                            for h in hashes:
                                assert h not in tier, "tier stored %d twice" % h
                                assert h in seen_pool, "the tier stored %d, never in the pool" % h
                                tier.add(h)
                        else:
                            assert medium == "CPU" and len(toks) == BS * len(hashes), ev
                            pool.update(hashes)
                            seen_pool.update(hashes)
                            pool_chains.append(hashes)
                    elif ev[0] == "BlockRemoved":
                        hashes, medium = ev[1:3]
                        live_set = tier if medium == "CPU_TIER" else pool
                        assert medium in ("CPU", "CPU_TIER"), ev
                        for h in hashes:
                            assert h in live_set, "%s removal of %d not stored there" % (medium, h)
                            live_set.discard(h)

        seen_pool = set()
        apply_media(sub.replay(0))
        first = [9 + (i * 5) % 240 for i in range(40)]
        complete(port, first)
        apply_media(sub.poll(5))
        first_chain = [h for c in pool_chains for h in c][:2]
        for k in range(12):
            complete(port, [7 + (k * 31 + i * 13) % 240 for i in range(40)])
            apply_media(sub.poll(5))
        assert set(first_chain) <= tier and not set(first_chain) & pool, "the first prompt's blocks are not in the tier only"
        r = complete(port, first)
        apply_media(sub.poll(5))
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BS, r["usage"]
        assert set(first_chain) <= pool, "the tier's blocks were not stored in the pool again"
        metrics = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=30).read().decode()
        hits = [float(l.split()[1]) for l in metrics.splitlines() if l.startswith("pd:kv_offload_hits_total ")]
        assert hits and hits[0] >= 2, hits
        loads = [float(l.split()[1]) for l in metrics.splitlines() if l.startswith("pd:kv_offload_load_seconds_count ")]
        assert loads and loads[0] == hits[0], (loads, hits)  # one latency observed per block loaded
        sub.close()
        print("kv events: OK (%d batches, %d hashes live, %d removed; tier: %d held)" %
              (len(seqs) + 1, len(live), removed, len(tier)))
    finally:
        for p in procs:
            stop(p)
        ctx.destroy(linger=0)  # an assertion may leave sockets open: term() would wait on them
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
