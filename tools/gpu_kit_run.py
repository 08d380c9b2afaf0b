#!/usr/bin/env python3
"""tools/gpu_kit_run.py — the checks `tools/gpu-kit run` makes on a GPU machine (issue 47), writing
OUT/report.md (rewritten after every section, so a cut-off run still leaves what it found) and
OUT/logs/. Sections, each bounded in time:

  machine    nvidia-smi, the CPU's flags, nvcc, torch and transformers versions
  selftest   pd-gpu-selftest: every op against the CPU reference, the tiny model end to end, timing rows
  greedy     pd-serve --device cuda against --device cpu, greedy, on the tiny, demo and 565 M models:
             random prompts, prompts sharing a prefix (prefix hits) and long ones (chunked prefill); a
             parting where the CPU server's two candidates are within GPU_TIE is a near-tie, not wrong
  pd         pd-prefill + pd-decode + pd-proxy on the one GPU, KV over tcp and ucx (host staging: the
             kit's UCX has no CUDA transports), pull and push, against pd-serve on the same device
  hf         HF transformers on the GPU as an independent reference: log p(prompt token | prefix) of
             pd-serve (prompt_logprobs) against transformers' on the same safetensors, Llama- and
             Qwen3-shaped
  quality    held-out perplexity of the trained demo model (models/sotu-demo) through pd-serve --device
             cuda's prompt_logprobs (tools/eval-ppl.py) against PyTorch's forward of the same weights
             (fp32 and bf16 math; within 1e-3 in mean NLL)
  bench      same-run ceilings (device-to-device copy, cuBLAS bf16 GEMM through torch), pd-bench
             against pd-serve --device cuda, and the CPU rows if the host has AMX

--dry-run (tools/gpu-kit check, no GPU): the same harness on the CPU (cpu against cpu-at-1-thread),
so a kit is proven before a GPU machine is at hand. Loopback only; every process started is stopped.
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "faults"))
from cluster import MODEL_NAME, Cluster, Node, http, raw_logprob  # noqa: E402

GPU_TIE = 2e-3  # fp32 on two devices: a parting between tokens this close in raw logprob is a near-tie
FAST = ["--kv-heartbeat-interval", "0.2", "--kv-heartbeat-misses", "5", "--kv-handshake-timeout", "2",
        "--kv-load-timeout", "20"]
HF_TIMEOUT = 120  # seconds for one transformers reference run
DEADLINE = [time.time() + 450]  # the whole run: --budget seconds (the device tool allows 600 per command)


class Report:
    def __init__(self, out):
        self.out = out
        self.logs = os.path.join(out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.sections = []  # (name, status, lines)
        self.t0 = time.time()

    def add(self, name, status, lines):
        self.sections.append((name, status, lines))
        print("gpu-kit: %-9s %s (%.0f s in)" % (name, status, time.time() - self.t0), flush=True)
        for line in lines:
            print("  " + line, flush=True)
        self.write()

    def write(self):
        with open(os.path.join(self.out, "report.md"), "w") as f:
            f.write("# pdserve GPU kit report — %s\n\n" % time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
            f.write("| section | status |\n|---|---|\n")
            for name, status, _ in self.sections:
                f.write("| %s | %s |\n" % (name, status))
            for name, status, lines in self.sections:
                f.write("\n## %s — %s\n\n" % (name, status))
                for line in lines:
                    f.write("- %s\n" % line if not line.startswith("|") and not line.startswith("    ") else line + "\n")
            f.write("\nTotal %.0f s.\n" % (time.time() - self.t0))


def run(cmd, log, timeout, env=None):
    """(exit status, output) of cmd; the output also goes to logs/<log>.log. 124 on timeout (its own,
    or the run's deadline, whichever is first)."""
    timeout = max(1, min(timeout, DEADLINE[0] - time.time()))
    with open(log, "w") as f:
        f.write("$ %s\n" % " ".join(cmd))
        f.flush()
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, env=env)
            out = p.stdout.decode(errors="replace")
            rc = p.returncode
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") + "\n(timed out after %d s)\n" % timeout
            rc = 124
        except OSError as e:
            out, rc = "cannot run: %s\n" % e, 127
        f.write(out)
    return rc, out


class Kit:
    def __init__(self, args):
        self.args = args
        self.bin = os.path.join(args.kit, "bin")
        self.dry = args.dry_run
        self.rep = Report(args.out)
        self.tmp = tempfile.mkdtemp(prefix="pd-kit-run-")
        self.models = {}
        self.host_env = dict(os.environ)  # torch runs with the host's libraries, not the kit's
        self.gpu = False

    def b(self, name):
        return os.path.join(self.bin, name)

    def log(self, name):
        return os.path.join(self.rep.logs, name + ".log")

    def set_library_path(self):
        """The kit's libraries first, then the host's CUDA libraries the kit leaves out."""
        want = ["libcublas.so.13", "libcublasLt.so.13", "libnccl.so.2"]
        dirs = []
        roots = glob.glob("/usr/local/cuda*/lib64") + glob.glob("/usr/local/cuda*/lib") + \
            glob.glob("/usr/local/cuda*/targets/x86_64-linux/lib")
        rc, out = run([sys.executable, "-c", "import site; print('\\n'.join(site.getsitepackages()))"],
                      self.log("site"), 30, env=self.host_env)
        for sp in out.split():
            roots += glob.glob(os.path.join(sp, "nvidia", "*", "lib")) + glob.glob(os.path.join(sp, "nvidia", "*",
                                                                                                   "*", "lib"))
        found = {}
        for d in roots:
            for w in want:
                if w not in found and os.path.exists(os.path.join(d, w)):
                    found[w] = d
                    if d not in dirs:
                        dirs.append(d)
        path = [os.path.join(self.args.kit, "lib")] + dirs
        os.environ["LD_LIBRARY_PATH"] = ":".join(path + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":")
                                                         if p])
        return ["%s from %s" % (w, found.get(w, "NOT FOUND")) for w in want]

    # ------------------------------------------------------------------ sections

    def machine(self):
        lines = self.set_library_path()
        rc, out = run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                       "--format=csv,noheader"], self.log("nvidia-smi"), 30)
        self.gpu = rc == 0 and out.strip() != ""
        lines.insert(0, "GPU: %s" % (out.strip() if self.gpu else "none (nvidia-smi: %s)" % out.strip()[:120]))
        cpu = open("/proc/cpuinfo").read()
        model = [line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("model name")]
        flags = set(([line for line in cpu.splitlines() if line.startswith("flags")] or [":"])[0].split(":")[1].split())
        lines.append("CPU: %s, %d cores; %s" % (model[0] if model else "?", os.cpu_count(),
                                                " ".join(f for f in ["avx2", "avx512f", "avx512_bf16", "amx_tile",
                                                                     "amx_bf16"] if f in flags)))
        self.amx = "amx_tile" in flags
        rc, out = run(["nvcc", "--version"], self.log("nvcc"), 30)
        lines.append("nvcc: %s" % (out.strip().splitlines()[-1] if rc == 0 else "absent"))
        rc, out = run([sys.executable, "-c", "import torch, transformers; print(torch.__version__, "
                       "transformers.__version__, torch.cuda.is_available())"], self.log("torch"), 60,
                      env=self.host_env)
        self.torch = rc == 0
        lines.append("torch, transformers, cuda: %s" % (out.strip().splitlines()[-1] if rc == 0 else "not importable"))
        run(["nvidia-smi"], self.log("nvidia-smi-full"), 30)
        return "ok" if self.gpu or self.dry else "FAIL (no GPU)", lines

    def make_models(self):
        specs = [("tiny", ["--preset", "tiny", "--seed", "3"]), ("demo", ["--preset", "demo"]),
                 ("qwen3", ["--preset", "demo", "--arch", "qwen3", "--seed", "5"])]
        if not self.dry:  # the make bench shape: weights far beyond any cache
            specs.append(("565m", ["--preset", "demo", "--hidden", "1536", "--layers", "16", "--heads", "12",
                                   "--kv-heads", "4", "--intermediate", "5632", "--vocab", "16000", "--dtype",
                                   "bf16"]))
        lines, ok = [], True
        sotu = os.path.join(ROOT, "models", "sotu-demo")
        if os.path.exists(os.path.join(sotu, "model.safetensors")):
            self.models["sotu"] = sotu
            lines.append("sotu: the trained demo model, models/sotu-demo")
        for name, a in specs:
            d = os.path.join(self.tmp, name)
            rc, out = run([self.b("pd-mkmodel"), "--out", d] + a, self.log("mkmodel-" + name), 120)
            ok &= rc == 0
            if rc == 0:
                self.models[name] = d
            lines.append("%s: pd-mkmodel %s -> %s" % (name, " ".join(a), "ok" if rc == 0 else "exit %d" % rc))
        return "ok" if ok else "FAIL", lines

    def selftest(self):
        lines, status = [], "ok"
        for model in ["demo", "565m"]:
            if model not in self.models:
                continue
            rc, out = run([self.b("pd-gpu-selftest"), "--tiny", self.models["tiny"], "--model", self.models[model]],
                          self.log("selftest-" + model), 120 if model == "demo" else 90)
            tail = [line for line in out.splitlines() if line.strip()][-12:]
            if rc == 77:
                return ("skipped (no CUDA device)" if self.dry else "FAIL (pd-gpu-selftest sees no device)"), tail
            if rc != 0:
                status = "FAIL"
            lines.append("with --model %s: exit %d" % (model, rc))
            lines += ["    " + line for line in tail]
        return status, lines

    def serve(self, tag, model, device, extra=(), memory=None):
        """pd-serve on loopback; memory: its memory flags (default: a fixed plan, so several share a GPU)"""
        memory = memory or ["--kv-cache-memory", "6G" if model == "565m" else "1G"]
        n = Node(self.tmp, tag, [self.b("pd-serve"), "--model", self.models[model], "--served-model-name", MODEL_NAME,
                                 "--device", device] + memory + ["--max-model-len", "512" if model == "sotu" else "1024",
                                 "--max-num-batched-tokens", "64"] + list(extra))
        try:
            n.start()
        except Exception as e:  # the report says why: the server's last lines
            n.stop()
            tail = open(os.path.join(self.tmp, tag + ".log"), errors="replace").read().strip().splitlines()[-3:]
            raise RuntimeError("%s: %s; its log ends: %s" % (tag, e, " | ".join(tail))) from None
        return n

    def prompts(self, vocab_hi):
        import random
        rng = random.Random(7)
        shared = [rng.randint(3, vocab_hi) for _ in range(160)]
        out = [[rng.randint(3, vocab_hi) for _ in range(n)] for n in (5, 17, 64, 130, 300, 700)]
        out += [shared + [rng.randint(3, vocab_hi) for _ in range(n)] for n in (3, 40, 90)]  # prefix hits
        return out

    def greedy_all(self, port, prompts, n):
        res = []
        for p in prompts:  # one at a time: the shared-prefix ones find the first one's blocks cached
            body = {"model": MODEL_NAME, "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True, "logprobs": 1}
            c = json.loads(http(port, "/v1/completions", body, timeout=120)[1])["choices"][0]
            res.append((c["token_ids"], c["logprobs"]["token_logprobs"]))
        return res

    def compare(self, ref_port, ref, got, prompts):
        """(equal, near-ties, wrong, max |logprob diff| over equal prefixes, detail lines)"""
        equal = ties = wrong = 0
        worst, detail = 0.0, []
        for p, (rt, rl), (gt, gl) in zip(prompts, ref, got):
            k = 0
            while k < min(len(rt), len(gt)) and rt[k] == gt[k]:
                worst = max(worst, abs(rl[k] - gl[k]))
                k += 1
            if rt == gt:
                equal += 1
                continue
            a = raw_logprob(ref_port, p + rt[:k], rt[k], gt[k])
            b = raw_logprob(ref_port, p + rt[:k], gt[k], rt[k])
            gap = abs(a - b) if a is not None and b is not None else None
            if gap is not None and gap < GPU_TIE:
                ties += 1
            else:
                wrong += 1
            detail.append("prompt of %d: parts at token %d (%d vs %d), raw logprob gap %s" %
                          (len(p), k, rt[k], gt[k], "%.2e" % gap if gap is not None else "?"))
        return equal, ties, wrong, worst, detail

    def greedy(self):
        lines, status = [], "ok"
        dev = "cpu" if self.dry else "cuda"
        for model in ["tiny", "demo", "565m"]:
            if model not in self.models:
                continue
            vocab = json.load(open(os.path.join(self.models[model], "config.json")))["vocab_size"] - 1
            prompts = self.prompts(min(vocab, 30000))
            try:  # each model on its own: one that fails still leaves the others' figures
                cpu = self.serve("greedy-cpu-" + model, model, "cpu")
                try:
                    gpu = self.serve("greedy-%s-%s" % (dev, model), model, dev,
                                     ["--threads", "1"] if self.dry else [])
                    try:
                        t = time.time()
                        got = self.greedy_all(gpu.port, prompts, 24)
                        gpu_s = time.time() - t
                        hits = metric_text(gpu.port, "vllm:prefix_cache_hits_total")
                    finally:
                        gpu.stop()
                    ref = self.greedy_all(cpu.port, prompts, 24)
                    eq, ties, wrong, worst, detail = self.compare(cpu.port, ref, got, prompts)
                finally:
                    cpu.stop()
            except Exception as e:
                status = "FAIL"
                lines.append("%s: %s" % (model, repr(e)[:400]))
                continue
            status = "FAIL" if wrong else status
            lines.append("%s: %d prompts x 24 tokens, %s vs cpu: %d equal, %d near-ties (gap < %g), %d wrong; "
                         "max |logprob diff| on equal tokens %.2e; prefix-cache hit tokens on %s: %s; %.1f s" %
                         (model, len(prompts), dev, eq, ties, GPU_TIE, wrong, worst, dev, hits, gpu_s))
            lines += ["    " + d for d in detail]
        return status, lines

    def pd(self):
        lines, status = [], "ok"
        dev = "cpu" if self.dry else "cuda"
        model = "demo"
        prompts = self.prompts(200)[:5]  # within the cluster's --max-model-len 512
        ref_node = self.serve("pd-ref", model, dev)
        try:
            ref = self.greedy_all(ref_node.port, prompts, 16)
            for mode, pipe in [("pull", "tcp"), ("push", "tcp"), ("pull", "ucx"), ("push", "ucx")]:
                c = None
                try:
                    c = Cluster(self.bin, self.tmp, self.models[model], mode, pipe, FAST, nprefill=1, ndecode=1,
                                extra=["--device", dev], tag="pd-%s-%s" % (mode, pipe))
                    t = time.time()
                    got = self.greedy_all(c.proxy.port, prompts, 16)
                    secs = time.time() - t
                    xfers = "%s completed, %s failed" % (metric_text(c.decodes[0].port, "pd:kv_transfers_completed_total"),
                                                         metric_text(c.decodes[0].port, "pd:kv_transfers_failed_total"))
                    eq, ties, wrong, worst, detail = self.compare(ref_node.port, ref, got, prompts)
                    if wrong or xfers.startswith("0 ") or xfers.startswith("absent"):
                        status = "FAIL"  # no transfer: the proxy did not disaggregate
                    lines.append("%s over %s on %s: %d equal, %d near-ties, %d wrong vs pd-serve on %s; "
                                 "decode KV transfers %s; %.1f s" % (mode, pipe, dev, eq, ties, wrong, dev, xfers, secs))
                    lines += ["    " + d for d in detail]
                except Exception as e:
                    status = "FAIL"
                    lines.append("%s over %s: %s" % (mode, pipe, repr(e)[:300]))
                finally:
                    if c is not None:
                        c.stop()
        finally:
            ref_node.stop()
        lines.append("nccl: not run: NCCL needs two GPUs for a prefill and a decode rank (one here); "
                     "test_pipe_nccl is in the kit for a two-GPU machine")
        return status, lines

    def tier(self):
        """the KV offload tier behind a device KV (pinned host memory): a pool of 72 blocks evicts the
        prompts' prefixes into it, the second pass loads them back; greedy tokens equal a node's without
        a tier, and the tier served hits"""
        lines, status = [], "ok"
        dev = "cpu" if self.dry else "cuda"
        prompts = self.prompts(200)
        small = ["--num-blocks-override", "72"]
        ref_node = self.serve("tier-ref", "demo", dev, small)
        try:
            ref = self.greedy_all(ref_node.port, prompts, 16)
        finally:
            ref_node.stop()
        node = self.serve("tier-host", "demo", dev, small + ["--kv-offload-tier", "host", "--kv-offload-size", "256M"])
        try:
            t = time.time()
            first = self.greedy_all(node.port, prompts, 16)
            again = self.greedy_all(node.port, prompts, 16)  # their prefixes are in the tier now
            secs = time.time() - t
            hits = metric_text(node.port, "pd:kv_offload_hits_total")
            saved = metric_text(node.port, "pd:kv_offload_saved_blocks_total")
            rate = (float(metric_text(node.port, "pd:kv_offload_bytes_read_total")) /
                    max(float(metric_text(node.port, "pd:kv_offload_read_seconds_total")), 1e-9) / 1e9
                    if hits not in ("absent", "0") else 0)
        finally:
            node.stop()
        same = sum(1 for r, a, b in zip(ref, first, again) if r[0] == a[0] == b[0])
        if same != len(prompts) or hits in ("absent", "0"):
            status = "FAIL"
        lines.append("demo on %s, 72-block pool, host tier: %d of %d prompts' greedy tokens equal the tier-less node's "
                     "(both passes); blocks saved %s, tier hits %s, load rate %.2f GB/s; %.1f s" %
                     (dev, same, len(prompts), saved, hits, rate, secs))
        return status, lines

    def hf(self):
        if not self.torch and not self.dry:
            return "FAIL (torch/transformers not importable)", []
        lines, status = [], "ok"
        dev = "cpu" if self.dry else "cuda"
        for model in ["demo", "qwen3"]:
            prompts = self.prompts(200)[1:5]
            ours_dev = dev
            try:
                node = self.serve("hf-" + model, model, dev, ["--kv-cache-dtype", "fp32"])  # transformers' fp32
            except Exception as e:  # still compare the CPU path with transformers on the GPU
                status = "FAIL"
                lines.append("%s: pd-serve --device %s: %s" % (model, dev, repr(e)[:300]))
                ours_dev = "cpu"
                node = self.serve("hf-cpu-" + model, model, "cpu", ["--kv-cache-dtype", "fp32"])
            try:
                ours = []
                for p in prompts:
                    body = {"model": MODEL_NAME, "prompt": p, "max_tokens": 1, "temperature": 0,
                            "prompt_logprobs": 1, "return_token_ids": True}
                    c = json.loads(http(node.port, "/v1/completions", body, timeout=120)[1])["choices"][0]
                    ours.append([None] + [e[str(t)]["logprob"] for e, t in zip(c["prompt_logprobs"][1:], p[1:])])
            finally:
                node.stop()
            q = os.path.join(self.tmp, "hf-%s.json" % model)
            json.dump({"model": self.models[model], "prompts": prompts, "device": dev,
                       "reference": "transformers" if self.torch else "numpy"}, open(q, "w"))
            rc, out = run([sys.executable, os.path.join(ROOT, "tools", "gpu_kit_hf.py"), q], self.log("hf-" + model),
                          HF_TIMEOUT, env=self.host_env)
            if rc != 0:
                status = "FAIL"
                lines.append("%s: transformers exit %d: %s" % (model, rc, out.strip().splitlines()[-1:] or ""))
                continue
            theirs = json.loads(out.strip().splitlines()[-1])
            worst, n = 0.0, 0
            for a, b in zip(ours, theirs["logprobs"]):
                for x, y in zip(a[1:], b[1:]):
                    worst = max(worst, abs(x - y))
                    n += 1
            if worst > 1e-2 or n == 0:
                status = "FAIL"
            lines.append("%s (%s): %d prompt-token logprobs, pd-serve --device %s vs %s on %s: "
                         "max |diff| %.2e" % (model, theirs["arch"], n, ours_dev, theirs["version"], theirs["device"],
                                              worst))
        return status, lines

    def quality(self):
        if "sotu" not in self.models:
            return "FAIL (models/sotu-demo is missing)", []
        lines, status = [], "ok"
        dev = "cpu" if self.dry else "cuda"
        for label, extra in (("fp32", []), ("bf16 math", ["--matmul-precision", "bf16"])):
            node = self.serve("ppl-%s-%s" % (dev, label.replace(" ", "-")), "sotu", dev, extra)
            try:
                rc, out = run([sys.executable, os.path.join(ROOT, "tools", "eval-ppl.py"), "--url",
                               "http://127.0.0.1:%d" % node.port, "--text",
                               os.path.join(self.models["sotu"], "heldout-sample.txt"), "--model", MODEL_NAME,
                               "--torch", self.models["sotu"], "--tol", "1e-3", "--label", label],
                              self.log("ppl-" + label.replace(" ", "-")), 180, env=self.host_env)
            finally:
                node.stop()
            try:
                r = json.loads(out.strip().splitlines()[-1])
                lines.append("%s: pd-serve --device %s held-out perplexity %.4f over %d tokens, PyTorch (CPU) %.4f: "
                             "mean NLL difference %+.2e" % (label, dev, r["ppl"], r["tokens"], r["torch_ppl"],
                                                             r["nll_diff"]))
            except (ValueError, KeyError, IndexError):
                lines.append("%s: eval-ppl exit %d: %s" % (label, rc, out.strip().splitlines()[-1:] or ""))
            if rc != 0:
                status = "FAIL"
        return status, lines

    def bench(self):
        lines, status = [], "ok"
        if self.torch and not self.dry:
            rc, out = run([sys.executable, os.path.join(ROOT, "tools", "gpu_kit_hf.py"), "--ceilings"],
                          self.log("ceilings"), 90, env=self.host_env)
            lines.append("ceilings (torch, same run): %s" % (out.strip().splitlines()[-1] if rc == 0 else "exit %d" % rc))
        dev = "cpu" if self.dry else "cuda"
        # planned as vLLM plans: a share of the device's memory (the GPU's own, not the host's RAM)
        node = self.serve("bench-" + dev, "demo", dev, memory=None if self.dry else ["--gpu-memory-utilization", "0.5"])
        try:
            res = os.path.join(self.tmp, "bench.json")
            n = 40 if self.dry else 400
            rc, out = run([self.b("pd-bench"), "--base-url", "http://127.0.0.1:%d" % node.port, "--num-prompts", str(n),
                           "--random-input-len", "256", "--random-output-len", "64", "--ignore-eos",
                           "--max-concurrency", "16", "--vocab-size", "200", "--no-progress", "--save-result",
                           "--result-filename", res], self.log("pd-bench"), 120)
            if rc == 0:
                r = json.load(open(res))
                lines.append("pd-bench on pd-serve --device %s, demo model, %d prompts 256 in / 64 out, concurrency 16: "
                             "%.1f req/s, %.0f output tok/s, TTFT median %.1f ms, ITL median %.2f ms" %
                             (dev, n, r.get("request_throughput", 0), r.get("output_throughput", 0),
                              r.get("median_ttft_ms", 0), r.get("median_itl_ms", 0)))
            else:
                status = "FAIL"
                lines.append("pd-bench exit %d" % rc)
        finally:
            node.stop()
        if getattr(self, "amx", False) and not self.dry:
            rc, out = run([self.b("pd-bench-ops"), "--model", self.models["demo"], "--model-only", "--weights", "auto"],
                          self.log("cpu-amx-bench-ops"), 100)
            lines.append("CPU (AMX host) pd-bench-ops --model demo --model-only --weights auto: exit %d" % rc)
            lines += ["    " + line for line in out.splitlines() if line.startswith("|")][:30]
        return status, lines

    def main(self):
        for name, fn in [("machine", self.machine), ("models", self.make_models), ("selftest", self.selftest),
                         ("greedy", self.greedy), ("pd", self.pd), ("tier", self.tier), ("hf", self.hf), ("quality", self.quality),
                         ("bench", self.bench)]:
            t = time.time()
            if DEADLINE[0] - t < 20:
                self.rep.add(name, "FAIL (not run: the run's --budget is spent)", [])
                continue
            try:
                status, lines = fn()
            except Exception:
                status, lines = "FAIL (exception)", traceback.format_exc().splitlines()[-6:]
            lines.append("(%.0f s)" % (time.time() - t))
            self.rep.add(name, status, lines)
        nodes = os.path.join(self.rep.logs, "nodes")  # every server's log comes back; the models do not
        os.makedirs(nodes, exist_ok=True)
        for f in glob.glob(os.path.join(self.tmp, "*.log")):
            shutil.copy(f, nodes)
        shutil.rmtree(self.tmp, ignore_errors=True)
        failed = [n for n, s, _ in self.rep.sections if s.startswith("FAIL")]
        print("gpu-kit: %s; report in %s" % ("all sections ok" if not failed else "FAILED: " + ", ".join(failed),
                                             os.path.join(self.args.out, "report.md")))
        return 1 if failed else 0


def metric_text(port, name):
    text = http(port, "/metrics", timeout=10)[1].decode()
    vals = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name) and not line.startswith("#")]
    return "%g" % sum(vals) if vals else "absent"


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--kit", required=True, help="the unpacked kit (bin/, lib/)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true", help="no GPU: the CPU-side harness only")
    ap.add_argument("--budget", type=float, default=450, help="seconds for the whole run (default 450)")
    a = ap.parse_args()
    DEADLINE[0] = time.time() + a.budget
    sys.exit(Kit(a).main())
