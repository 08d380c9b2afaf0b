#!/usr/bin/env bash
# tools/bench-serve-ab.sh BIN_A BIN_B [ROUNDS] — two builds of pd-serve under the same load,
# alternated: each round starts BIN_A's pd-serve, runs pd-bench at concurrency 8 and 16, stops it,
# then the same with BIN_B, so the VM's drift falls on both alike (a regression check of a kernel
# change: build the old commit in a git worktree and pass both build/bin directories). The load
# and server arguments are tools/bench-dtype.sh's: the demo model (BIN_A's build/models/demo, made
# if missing), 256±50 % prompt and 64 output tokens, PD_AB_PROMPTS (64) requests per point.
# PD_AB_ARGS adds pd-serve arguments (default --dtype auto). Prints one line per point; appends
# nothing. Loopback only; stops every server it started (tools/bench-procs.sh).
set -euo pipefail
a=$(realpath "${1:?usage: tools/bench-serve-ab.sh BIN_A BIN_B [ROUNDS]}")
b=$(realpath "${2:?usage: tools/bench-serve-ab.sh BIN_A BIN_B [ROUNDS]}")
rounds=${3:-3}
prompts=${PD_AB_PROMPTS:-64}
read -r -a extra <<<"${PD_AB_ARGS:---dtype auto}"
cd "$(dirname "$0")/.."
bin=$a
models="$a/../models"
source tools/bench-procs.sh
demo_setup bench-ab

echo "bench-serve-ab: A = $a, B = $b, $rounds rounds, $prompts requests per point, pd-serve ${extra[*]}"
for round in $(seq "$rounds"); do
  for side in A B; do
    bin=$a
    [[ $side == B ]] && bin=$b
    start "serve-$side" pd-serve --model "$models/demo" --served-model-name demo "${extra[@]}" --threads 2 \
      --kv-cache-memory 2G --max-model-len 4096
    for conc in 8 16; do
      "$bin/pd-bench" --base-url "http://127.0.0.1:$port" --dataset-name random --random-input-len 256 \
        --random-output-len 64 --random-range-ratio 0.5 --num-prompts "$prompts" --num-warmups 16 --seed 7 \
        --max-concurrency "$conc" --ignore-eos --no-progress --save-result --result-filename "$work/r.json" \
        --label "$side c$conc r$round" --wait-ready 60 >/dev/null 2>"$work/bench.log" ||
        { cat "$work/bench.log" >&2; exit 1; }
      python3 - "$work/r.json" "$side" "$conc" "$round" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("%s c%s r%s: %.2f req/s, TTFT p50 %.0f p99 %.0f ms, TPOT p50 %.1f ms, %d/%d" % (
    sys.argv[2], sys.argv[3], sys.argv[4], r["request_throughput"], r["median_ttft_ms"],
    r["p99_ttft_ms"], r["median_tpot_ms"], r["completed"], r["completed"] + r.get("failed", 0)))
PY
    done
    stop_all
  done
done
