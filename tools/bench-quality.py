#!/usr/bin/env python3
"""tools/bench-quality.py BUILD_DIR — quality of the trained demo model (models/sotu-demo), measured
rather than assumed (issue 50). Appends its tables to bench/RESULTS.md.

1. Held-out perplexity (the 12 held-out State of the Union addresses, ~111 k tokens, windows of
   256 tokens; tools/eval-ppl.py through prompt_logprobs) for each way pd-serve can hold the
   weights: fp32 (--dtype float32), bf16 as stored, bf16 math (--matmul-precision bf16), int8
   (--quantization int8), and with an fp32 KV cache; PyTorch's forward of the bf16 weights on the
   same windows is the baseline, measured in the same run.
2. Speculative decoding on held-out text: 24 prompts cut from the held-out addresses (~200
   tokens each), 128 output tokens, concurrency 1, greedy and sampled (temperature 0.8), with no
   speculation, n-gram lookup (4 tokens, n-grams of 2..4) and a draft model (models/sotu-demo-draft,
   trained the same way, ~1 M parameters, 3 tokens). Acceptance from vllm:spec_decode_* counters;
   speed-up against no speculation, two rounds in alternating order (the VM's drift falls alike).

PD_QUALITY_PROMPTS sets the prompts per point (default 24). Loopback only; stops what it starts."""
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build")
BIN = os.path.join(BUILD, "bin")
MODEL = os.path.join(ROOT, "models", "sotu-demo")
DRAFT = os.path.join(ROOT, "models", "sotu-demo-draft")
PROMPTS = int(os.environ.get("PD_QUALITY_PROMPTS", "24"))
PY = "/usr/bin/python3"


def log(msg):
    print("bench-quality: " + msg, file=sys.stderr, flush=True)


class Server:
    def __init__(self, work, tag, extra):
        self.tag = tag
        pf = os.path.join(work, tag + ".port")
        self.log = open(os.path.join(work, tag + ".log"), "w")
        self.proc = subprocess.Popen([os.path.join(BIN, "pd-serve"), "--model", MODEL, "--served-model-name",
                                      "sotu-demo", "--threads", "2", "--kv-cache-memory", "1G", "--port", "0",
                                      "--port-file", pf] + extra, stdout=self.log, stderr=self.log)
        end = time.time() + 120
        while time.time() < end:
            if self.proc.poll() is not None:
                raise SystemExit("bench-quality: pd-serve %s exited (see %s)" % (tag, self.log.name))
            if os.path.exists(pf) and open(pf).read().strip():
                self.port = int(open(pf).read())
                break
            time.sleep(0.1)
        while time.time() < end:
            try:
                urllib.request.urlopen("http://127.0.0.1:%d/health" % self.port, timeout=2)
                return
            except Exception:
                time.sleep(0.1)
        raise SystemExit("bench-quality: pd-serve %s did not start" % tag)

    def counter(self, name):
        text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.port, timeout=10).read().decode()
        return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(name + " ") or l.startswith(name + "{"))

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def perplexity(work, heldout):
    rows = [("fp32 weights", ["--dtype", "float32"]), ("bf16 weights (as stored)", []),
            ("bf16 weights, fp32 KV cache", ["--kv-cache-dtype", "fp32"]),
            ("bf16 math (--matmul-precision bf16)", ["--matmul-precision", "bf16"]),
            ("int8 (--quantization int8)", ["--quantization", "int8"])]
    out = []
    for i, (label, extra) in enumerate(rows):
        log("perplexity: %s" % label)
        s = Server(work, "ppl%d" % i, extra)
        try:
            argv = [PY, os.path.join(ROOT, "tools", "eval-ppl.py"), "--url", "http://127.0.0.1:%d" % s.port,
                    "--text", heldout, "--label", label]
            if i == 1:
                argv += ["--torch", MODEL, "--tol", "1"]
            r = subprocess.run(argv, capture_output=True, text=True, check=True)
            out.append(json.loads(r.stdout.strip().splitlines()[-1]))
        finally:
            s.stop()
    return out


def sharegpt(heldout, path):
    """PROMPTS passages of ~900 characters from the held-out text, cut at sentence ends."""
    text = open(heldout, encoding="utf-8").read()
    step = max(2000, len(text) // (PROMPTS + 1))
    conv = []
    for k in range(PROMPTS):
        a = text.find(". ", k * step) + 2
        b = text.find(". ", a + 900) + 1
        if b <= a:  # no sentence end after it: the text's end
            b = len(text)
        conv.append({"conversations": [{"from": "human", "value": text[a:b]}, {"from": "gpt", "value": "x" * 600}]})
    json.dump(conv, open(path, "w"))


def speculative(work, heldout):
    sg = os.path.join(work, "heldout-sharegpt.json")
    sharegpt(heldout, sg)
    configs = {
        "off": [],
        "ngram": ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4,
                                                      "prompt_lookup_min": 2, "prompt_lookup_max": 4})],
        "draft": ["--speculative-config", json.dumps({"method": "draft_model", "model": DRAFT,
                                                      "num_speculative_tokens": 3})],
    }
    servers = {c: Server(work, "spec-" + c, a) for c, a in configs.items()}
    res = {}
    try:
        for rnd in (1, 2):
            order = list(configs) if rnd == 1 else list(reversed(configs))
            for temp in ("0", "0.8"):
                for c in order:
                    s = servers[c]
                    log("speculation %s, temperature %s, round %d" % (c, temp, rnd))
                    d0 = s.counter("vllm:spec_decode_num_draft_tokens_total") if c != "off" else 0
                    a0 = s.counter("vllm:spec_decode_num_accepted_tokens_total") if c != "off" else 0
                    rf = os.path.join(work, "%s-%s-%d.json" % (c, temp, rnd))
                    subprocess.run([os.path.join(BIN, "pd-bench"), "--base-url", "http://127.0.0.1:%d" % s.port,
                                    "--dataset-name", "sharegpt", "--dataset-path", sg, "--sharegpt-output-len",
                                    "128", "--num-prompts", str(PROMPTS), "--num-warmups", "2", "--seed", "7",
                                    "--temperature", temp, "--max-concurrency", "1", "--ignore-eos",
                                    "--no-progress", "--save-result", "--result-filename", rf, "--wait-ready",
                                    "60"], check=True, stdout=subprocess.DEVNULL)
                    r = json.load(open(rf))
                    d1 = s.counter("vllm:spec_decode_num_draft_tokens_total") if c != "off" else 0
                    a1 = s.counter("vllm:spec_decode_num_accepted_tokens_total") if c != "off" else 0
                    e = res.setdefault((c, temp), {"tput": [], "tpot": [], "d": 0, "a": 0, "n": r["completed"]})
                    e["tput"].append(r["output_throughput"])
                    e["tpot"].append(r["median_tpot_ms"])
                    e["d"] += d1 - d0
                    e["a"] += a1 - a0
    finally:
        for s in servers.values():
            s.stop()
    return res


def main():
    for d in (MODEL, DRAFT):
        if not os.path.exists(os.path.join(d, "model.safetensors")):
            raise SystemExit("bench-quality: %s is missing (tools/train-demo-model.py, README)" % d)
    work = tempfile.mkdtemp(prefix="pd-bench-quality-")
    heldout = os.path.join(work, "heldout.txt")
    subprocess.run([PY, os.path.join(ROOT, "tools", "train-demo-model.py"), "--write-heldout", heldout,
                    "--corpus-dir", os.path.join(BUILD, "corpus", "sotu")], check=True)
    ppl = perplexity(work, heldout)
    spec = speculative(work, heldout)
    cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True,
                         text=True).stdout.strip()
    base = ppl[1]
    lines = ["", "## Demo model quality (issue 50): perplexity per dtype, speculative decoding on held-out text",
             "", "`python3 tools/bench-quality.py build` on %s, %d cores, %s; models/sotu-demo (%s)." % (
                 cpu, os.cpu_count(), time.strftime("%Y-%m-%d"), "4.2 M parameters, 4 layers, hidden 256"),
             "Held-out: the 12 held-out addresses, %d tokens in windows of %d (each after <|begin_of_text|>)."
             % (base["tokens"], base["ctx"]), "",
             "| weights | held-out perplexity | mean NLL | Δ NLL vs PyTorch (bf16 weights, fp32) | top-1 accuracy |",
             "|---|---|---|---|---|",
             "| PyTorch forward (baseline) | %.4f | %.6f | 0 | |" % (base["torch_ppl"], base["torch_nll"])]
    for r in ppl:
        lines.append("| pd-serve, %s | %.4f | %.6f | %+.2e | %.2f %% |" % (r["label"], r["ppl"], r["nll"],
                                                                            r["nll"] - base["torch_nll"],
                                                                            100 * r["top1"]))
    lines += ["", "Speculative decoding, %d held-out passages of ~200 tokens, 128 output tokens, concurrency 1, "
              "mean of 2 rounds:" % spec[("off", "0")]["n"], "",
              "| temperature | speculation | acceptance (accepted / drafted) | output tok/s | median TPOT ms | "
              "speed-up vs off |", "|---|---|---|---|---|---|"]
    for temp in ("0", "0.8"):
        off = sum(spec[("off", temp)]["tput"]) / 2
        for c in ("off", "ngram", "draft"):
            e = spec[(c, temp)]
            t = sum(e["tput"]) / 2
            acc = "%.1f %% (%d / %d)" % (100 * e["a"] / e["d"], e["a"], e["d"]) if e["d"] else "-"
            lines.append("| %s | %s | %s | %.1f | %.2f | %.2fx |" % (temp, c, acc, t, sum(e["tpot"]) / 2, t / off))
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(ROOT, "bench", "RESULTS.md"), "a") as f:
        f.write(text)


if __name__ == "__main__":
    main()
