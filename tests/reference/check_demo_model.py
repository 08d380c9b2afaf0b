"""tests/reference/check_demo_model.py BUILD_DIR [MODEL_DIR] — the committed demo model
(models/sotu-demo, trained by tools/train-demo-model.py) served by every path, against PyTorch:

  * its tokenizer.json as pd-serve reads it encodes the held-out sample exactly as the training
    script's own BPE encoder did (the ids the model was trained on);
  * held-out perplexity through prompt_logprobs (tools/eval-ppl.py) on pd-serve equals PyTorch's
    forward of the same bf16 weights (the training script's model) within 1e-3 in mean NLL, at fp32
    and at bf16 math; and at int8 it stays within 2 % of it (a quantized model is another model);
  * through P/D (1 prefill + 1 decode + pd-proxy) in pull and push mode over tcp and ucx it equals
    pd-serve's within 1e-3 (prompt logprobs come from the prefill that computed the prompt);
  * the model is trained: held-out perplexity below 100 (random weights give ~4000);
  * a greedy completion decodes to text made of words (letters, spaces, punctuation).

Loopback only; every process started here is stopped."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "faults"))
from cluster import MODEL_NAME, Cluster, Node, http  # noqa: E402

BUILD = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build")
BIN = os.path.join(BUILD, "bin")
MODEL = os.path.abspath(sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "models", "sotu-demo"))
SAMPLE = os.path.join(MODEL, "heldout-sample.txt")
TOL, INT8_REL, TRAINED_PPL = 1e-3, 0.02, 100.0
FAST = ["--kv-heartbeat-interval", "0.2", "--kv-heartbeat-misses", "5", "--kv-handshake-timeout", "2",
        "--kv-load-timeout", "10"]
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)
    return ok


def eval_ppl(port, label, torch=False):
    argv = [sys.executable, os.path.join(ROOT, "tools", "eval-ppl.py"), "--url", "http://127.0.0.1:%d" % port,
            "--text", SAMPLE, "--model", MODEL_NAME, "--label", label]
    if torch:
        argv += ["--torch", MODEL, "--tol", str(TOL)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if r.returncode not in (0, 1) or not r.stdout.strip():
        raise RuntimeError("eval-ppl %s failed (%d): %s" % (label, r.returncode, r.stderr[-800:]))
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print("     %s" % json.dumps(out), flush=True)
    return out


def serve(tmp, tag, extra=()):
    n = Node(tmp, tag, [os.path.join(BIN, "pd-serve"), "--model", MODEL, "--served-model-name", MODEL_NAME,
                        "--kv-cache-memory", "256M", "--threads", "1"] + list(extra))
    n.start()
    return n


def main():
    spec = importlib.util.spec_from_file_location("tdm", os.path.join(ROOT, "tools", "train-demo-model.py"))
    tdm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tdm)
    text = open(SAMPLE, encoding="utf-8").read()
    tmp = tempfile.mkdtemp(prefix="pd-demo-model-")
    nodes = []
    try:
        node = serve(tmp, "serve")
        nodes.append(node)
        got = json.loads(http(node.port, "/tokenize", {"prompt": text, "add_special_tokens": False})[1])["tokens"]
        want = tdm.Tokenizer.load(MODEL).encode(text)
        check(got == want, "pd-serve's tokenizer encodes the %d-char held-out sample as the training script "
              "(%d tokens, first difference at %s)" % (len(text), len(want),
                                                        next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                                                             None if len(got) == len(want) else min(len(got), len(want)))))
        ref = eval_ppl(node.port, "pd-serve fp32", torch=True)
        check(abs(ref["nll_diff"]) <= TOL, "pd-serve's held-out NLL %.6f equals PyTorch's %.6f within %g"
              % (ref["nll"], ref["torch_nll"], TOL))
        check(ref["ppl"] < TRAINED_PPL, "the model is trained: held-out perplexity %.2f < %g" % (ref["ppl"], TRAINED_PPL))
        body = {"model": MODEL_NAME, "prompt": "The State of the Union", "max_tokens": 40, "temperature": 0}
        words = json.loads(http(node.port, "/v1/completions", body)[1])["choices"][0]["text"]
        print("     greedy: %r" % words, flush=True)
        check(re.fullmatch(r"[A-Za-z0-9 ,.;:'\"\-\n()$%?!&—’“”]+", words) is not None and len(words.split()) >= 8,
              "a greedy completion is words and punctuation")
        node.stop()
        nodes.remove(node)
        for label, extra, tol in (("bf16 math", ["--matmul-precision", "bf16"], TOL),
                                  ("int8", ["--quantization", "int8"], None)):
            n = serve(tmp, label.replace(" ", "-"), extra)
            nodes.append(n)
            r = eval_ppl(n.port, "pd-serve " + label)
            if tol is not None:
                check(abs(r["nll"] - ref["torch_nll"]) <= tol, "%s: held-out NLL %.6f equals PyTorch's within %g"
                      % (label, r["nll"], tol))
            else:
                check(abs(r["ppl"] / ref["ppl"] - 1) <= INT8_REL, "%s: held-out perplexity %.3f within %g%% of "
                      "fp32's %.3f" % (label, r["ppl"], INT8_REL * 100, ref["ppl"]))
            n.stop()
            nodes.remove(n)
        for mode, pipe in (("pull", "tcp"), ("pull", "ucx"), ("push", "tcp"), ("push", "ucx")):
            c = Cluster(BIN, tmp, MODEL, mode, pipe, FAST, nprefill=1, ndecode=1)
            nodes.append(c)
            r = eval_ppl(c.proxy.port, "P/D %s/%s" % (mode, pipe))
            check(abs(r["nll"] - ref["nll"]) <= TOL and r["tokens"] == ref["tokens"],
                  "P/D %s/%s: held-out NLL %.6f over %d tokens equals pd-serve's within %g"
                  % (mode, pipe, r["nll"], r["tokens"], TOL))
            c.stop()
            nodes.remove(c)
    except Exception as e:  # a node that would not start, a server error: a failure, never a skip
        check(False, "the run finished (%s: %s; logs in %s)" % (type(e).__name__, e, tmp))
    finally:
        for n in nodes:
            n.stop()
    if not failures:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
