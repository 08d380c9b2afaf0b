#!/usr/bin/env bash
# tools/bench-prefill-cost.sh BUILD_DIR — how well a node knows what computing a prompt costs it, the
# figure its fetch-or-compute choice (connector/kv_cost.c) weighs a peer's prefix against.
#
# One pd-serve (demo model, --threads 2, prefix caching off, debug log) is sent prompts of
# PD_COST_LENS tokens one at a time (max_tokens 1), PD_COST_ROUNDS rounds. Before each prompt, its
# compute time is estimated two ways from the steps logged so far:
#   fit:  the engine's pd_prefill_cost (alpha · tokens + beta · attended positions, fitted to the
#         prompt-heavy steps; the log line "prefill cost: ... now A s/token + B s/position" after
#         the last step before the prompt), over the prompt's positions [0, L);
#   rate: the model it replaced: L / an EWMA (weight 0.25) of tokens per second over those steps.
# and compared with the prompt's measured compute (its steps' time). Reports estimate / measured per
# length: round 1 alone, then the median of the later rounds. The baseline is the rate model in the
# same run. Appends to bench/RESULTS.md.
# PD_COST_LENS ("512 8000 1024 4096 2048 256 6000"), PD_COST_ROUNDS (3), PD_COST_MODEL (demo).
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
bin="$build/bin"
models="$build/models"
results=bench/RESULTS.md
source tools/bench-procs.sh
demo_setup prefillcost
read -r -a lens <<<"${PD_COST_LENS:-512 8000 1024 4096 2048 256 6000}"
rounds=${PD_COST_ROUNDS:-3}
model=${PD_COST_MODEL:-demo}
max=0
for l in "${lens[@]}"; do ((l > max)) && max=$l; done
vocab=$(sed -n 's/.*"vocab_size": *\([0-9]*\).*/\1/p' "$models/$model/config.json")
echo "bench-prefill-cost: $model, prompts of ${lens[*]} tokens, $rounds rounds"
PD_LOG_LEVEL=debug start serve pd-serve --model "$models/$model" --served-model-name "$model" --threads 2 \
  --max-model-len $((max + 16)) --no-enable-prefix-caching
seed=0
for r in $(seq "$rounds"); do
  for l in "${lens[@]}"; do
    seed=$((seed + 1))
    "$bin/pd-bench" --base-url "http://127.0.0.1:$port" --dataset-name random --vocab-size "$((vocab - 2))" \
      --random-input-len "$l" --random-output-len 1 --num-prompts 1 --max-concurrency 1 --seed "$seed" \
      --no-progress >/dev/null
  done
done
stop_all
# One request at a time and no prefix hits: a prompt's steps are its chunks, the first from position
# 0 (attended positions n(n + 1) / 2), and its length is the sum of their tokens.
python3 - "$work/serve.log" >"$work/rows" <<'EOF'
import re, statistics, sys
step = re.compile(r"prefill cost: a step of (\d+) tokens over (\d+) attended positions took ([\d.]+) ms, "
                  r"predicted ([-\d.]+) ms; now ([\d.e+-]+) s/token \+ ([\d.e+-]+) s/position")
seed = re.compile(r"prefill cost: the profile's forward .* at first ([\d.e+-]+) s/token \+ ([\d.e+-]+) s/position")
alpha = beta = rate = 0.0
prompts = []
for line in open(sys.argv[1]):
    m = seed.search(line)
    if m is not None:
        alpha, beta = float(m.group(1)), float(m.group(2))
    m = step.search(line)
    if m is None:
        continue
    n, a, took = int(m.group(1)), int(m.group(2)), float(m.group(3)) / 1e3
    if a == n * (n + 1) // 2:  # a prompt's first chunk: the estimates are the ones before it
        prompts.append({"alpha": alpha, "beta": beta, "rate": rate, "len": 0, "took": 0.0})
    if prompts:
        prompts[-1]["len"] += n
        prompts[-1]["took"] += took
    alpha, beta = float(m.group(5)), float(m.group(6))
    rate = n / took if rate == 0 else rate + 0.25 * (n / took - rate)
seen = {}
for p in prompts:
    l = p["len"]
    p["round"] = seen[l] = seen.get(l, 0) + 1
    p["fit"] = (p["alpha"] * l + p["beta"] * l * (l + 1) / 2) / p["took"] if p["alpha"] > 0 else 0
    p["old"] = l / p["rate"] / p["took"] if p["rate"] > 0 else 0
def row(l, sel, tag):
    took = statistics.median(p["took"] for p in sel) * 1e3
    fit = statistics.median(p["fit"] for p in sel)
    old = [p["old"] for p in sel if p["old"] > 0]
    print("| %d | %s | %.0f | %.2f | %s |" % (l, tag, took, fit, "%.2f" % statistics.median(old) if old else "– (no step yet)"))
for l in sorted(seen):
    ps = [p for p in prompts if p["len"] == l]
    row(l, [p for p in ps if p["round"] == 1], "1")
    if len(ps) > 1:
        row(l, [p for p in ps if p["round"] > 1], "2" if len(ps) == 2 else "2–%d" % len(ps))
EOF
{
  echo
  echo "### Prefill cost: the node's estimate of a prompt's compute, fitted with attention's growth vs a tokens/s rate ($(date -u +%Y-%m-%d))"
  echo
  echo "\`PD_COST_LENS='${lens[*]}' PD_COST_ROUNDS=$rounds PD_COST_MODEL=$model tools/bench-prefill-cost.sh $build\`"
  echo "— one pd-serve, $model model, --threads 2, prefix caching off, prompts sent one at a time (max_tokens 1) in the"
  echo "order ${lens[*]}, $rounds rounds. Before each prompt: fit = the engine's pd_prefill_cost over its positions"
  echo "(alpha · tokens + beta · attended positions, from the steps so far; round 1's first prompt has only the memory"
  echo "profile's forward), rate = tokens / an EWMA of the same steps' tokens per second (the model it replaced). Columns:"
  echo "estimate / the prompt's measured compute (1.00 = exact; below 1 under-estimates). $(nproc) cores:"
  echo "$(lscpu | sed -n 's/^Model name: *//p')."
  echo
  echo "| prompt tokens | rounds | measured compute (ms) | fit / measured | rate / measured |"
  echo "|---|---|---|---|---|"
  cat "$work/rows"
} | tee -a "$results"
