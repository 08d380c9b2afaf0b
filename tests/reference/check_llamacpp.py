"""tests/reference/check_llamacpp.py BUILD_DIR — pdserve's greedy tokens against llama.cpp's, an
independent implementation of the same models (node-llama-cpp's prebuilt CPU build, from npm, pinned
in bench/llamacpp/npm-packages; the models converted by tools/pd-to-gguf.py):

  * two pd-mkmodel Llama models: fp32 weights with 4 query heads on 2 KV heads, and bf16 weights
    with one KV head for 4 query heads and rope_theta 500000; and the trained demo model
    (models/sotu-demo: bf16, tied embeddings, head_dim 64);
  * llama.cpp decodes 32 greedy tokens after a 16-token prompt (bench/llamacpp/baseline.mjs);
  * pd-serve (loopback, fp32 math) answers the same token-id prompt with temperature 0;
  * the two must agree on every token, or part only where pdserve's two best candidates are
    within 0.05 nats of each other (a near-tie: llama.cpp sums in another order, and in bf16 on
    bf16 weights) after at least 8 equal tokens. A wrong RoPE pair order, norm or KV-head mapping
    parts at once, at a clear winner.

Loopback only; every process started here is stopped."""
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build")
BIN = os.path.join(BUILD, "bin")
NPM_DIR = os.path.join(BUILD, "npm-llamacpp")
PACKAGES = open(os.path.join(ROOT, "bench", "llamacpp", "npm-packages")).read().split()
PROMPT, STEPS, MIN_EQUAL, NEAR_TIE = 16, 32, 8, 0.05
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)
    return ok


def serve(model, work):
    port_file = os.path.join(work, os.path.basename(model) + ".port")
    log = open(os.path.join(work, "serve.log"), "w")
    p = subprocess.Popen([os.path.join(BIN, "pd-serve"), "--model", model, "--served-model-name", "m",
                          "--port", "0", "--port-file", port_file, "--threads", "2",
                          "--kv-cache-memory", "256M", "--max-model-len", "512"],
                         stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while time.time() < deadline and p.poll() is None:
        if os.path.exists(port_file) and open(port_file).read().strip():
            return p, int(open(port_file).read())
        time.sleep(0.1)
    p.kill()
    p.wait()
    raise RuntimeError("pd-serve did not start: " + open(os.path.join(work, "serve.log")).read()[-2000:])


def complete(port, fields):
    """pd-serve's greedy completion of a token-id prompt (ignore_eos), its first choice."""
    body = dict({"model": "m", "temperature": 0, "ignore_eos": True, "return_token_ids": True}, **fields)
    req = urllib.request.Request("http://127.0.0.1:%d/v1/completions" % port, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]


def compare(name, model, work):
    gguf = os.path.join(work, name + ".gguf")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "pd-to-gguf.py"), model, gguf],
                       capture_output=True, text=True, timeout=120)
    if not check(r.returncode == 0, "%s: converted to GGUF %s" % (name, r.stderr.strip())):
        return
    ref = os.path.join(work, name + "-llamacpp.json")
    env = dict(os.environ, UV_THREADPOOL_SIZE="1")
    script = os.path.join(NPM_DIR, "baseline.mjs")  # beside node_modules, so the import resolves
    with open(os.path.join(ROOT, "bench", "llamacpp", "baseline.mjs")) as src, open(script, "w") as dst:
        dst.write(src.read())
    r = subprocess.run(["node", script, "--model", gguf, "--threads", "2", "--prompt-len", str(PROMPT),
                        "--steps", str(STEPS), "--reps", "1", "--prefill", "", "--tokens-out", ref],
                       capture_output=True, text=True, timeout=240, env=env)
    if not check(r.returncode == 0, "%s: llama.cpp ran%s" % (name, "" if r.returncode == 0 else ": " + r.stderr[-1500:])):
        return
    ll = json.load(open(ref))
    p, port = serve(model, work)
    try:
        ch = complete(port, {"prompt": ll["prompt"], "max_tokens": STEPS, "logprobs": 0})
        ids, want = ch["token_ids"], ll["output"]
        n = 0
        while n < min(len(ids), len(want)) and ids[n] == want[n]:
            n += 1
        if n == len(want) and len(ids) == len(want):
            check(True, "%s: all %d greedy tokens equal llama.cpp's" % (name, n))
            return
        gap = float("inf")
        if n < min(len(ids), len(want)):  # pdserve's logprob of llama.cpp's token there, as a prompt token
            alt = complete(port, {"prompt": ll["prompt"] + ids[:n] + [want[n]], "max_tokens": 1,
                                  "prompt_logprobs": 0})
            gap = ch["logprobs"]["token_logprobs"][n] - alt["prompt_logprobs"][-1][str(want[n])]["logprob"]
    finally:
        p.terminate()
        p.wait(timeout=30)
    check(n >= MIN_EQUAL and gap <= NEAR_TIE,
          "%s: %d of %d greedy tokens equal llama.cpp's, then they part where pdserve's logprobs of the two "
          "are %.4f apart (a near-tie: <= 0.05, after >= 8 equal; "
          "llama.cpp took %d, pdserve %d)" % (name, n, len(want), gap, want[n] if n < len(want) else -1,
                                              ids[n] if n < len(ids) else -1))


def main():
    for tool in ("node", "npm"):
        if not check(subprocess.run(["which", tool], capture_output=True).returncode == 0, tool + " is installed"):
            return 1
    r = subprocess.run([os.path.join(ROOT, "tests", "reference", "npm_install.sh"), NPM_DIR] + PACKAGES,
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, NPM_INSTALL_FLAGS="--omit=optional"))
    if not check(r.returncode == 0, "npm installed %s%s" % (" ".join(PACKAGES), (": " + r.stdout[-500:] + r.stderr[-500:]) if r.returncode else "")):
        return 1
    with tempfile.TemporaryDirectory(prefix="pd-llamacpp-") as work:
        models = {
            "llama-f32": ["--preset", "tiny", "--arch", "llama", "--seed", "11"],
            "llama-bf16-mqa": ["--preset", "tiny", "--arch", "llama", "--seed", "12", "--dtype", "bf16",
                               "--kv-heads", "1", "--rope-theta", "500000"],
        }
        for name, args in models.items():
            model = os.path.join(work, name)
            subprocess.run([os.path.join(BIN, "pd-mkmodel"), "--out", model] + args, check=True,
                           capture_output=True, timeout=120)
            compare(name, model, work)
        # the trained demo model: real weights, so greedy text has clear winners (few near-ties)
        compare("sotu-demo", os.path.join(ROOT, "models", "sotu-demo"), work)
    print("%d failed" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
