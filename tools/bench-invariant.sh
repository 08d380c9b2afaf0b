#!/usr/bin/env bash
# tools/bench-invariant.sh BUILD_DIR [ROUNDS] — what --batch-invariant costs: pd-serve on the demo model
# (bf16, 2 threads) without and with the flag, alternated round by round so the VM's drift falls on
# both alike (the mode off is the same-run baseline; the ratio is on / off). Three points a round:
#   decode c1     one stream, 64 prompt / 128 output tokens: TPOT
#   prefill 2048  one 2048-token prompt at a time, 1 output token: TTFT (the prefill)
#   mixed c8      8 streams, 256±50 % prompt / 64 output tokens: requests/s, TTFT, TPOT
# PD_INV_ARGS adds pd-serve arguments to both sides (e.g. "--matmul-precision bf16"). Prints one line
# per point; appends nothing. Loopback only; stops every server it started (tools/bench-procs.sh).
set -euo pipefail
bin=$(realpath "${1:?usage: tools/bench-invariant.sh BUILD_DIR [ROUNDS]}")/bin
rounds=${2:-2}
read -r -a extra <<<"${PD_INV_ARGS:-}"
cd "$(dirname "$0")/.."
models="$bin/../models"
source tools/bench-procs.sh
demo_setup bench-invariant

point() { # LABEL pd-bench-args...
  local label=$1; shift
  "$bin/pd-bench" --base-url "http://127.0.0.1:$port" --dataset-name random --seed 7 --ignore-eos --no-progress \
    --save-result --result-filename "$work/r.json" --wait-ready 60 "$@" >/dev/null 2>"$work/bench.log" ||
    { cat "$work/bench.log" >&2; exit 1; }
  python3 - "$work/r.json" "$label" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("%-28s %.2f req/s, TTFT p50 %.0f ms, TPOT p50 %.2f ms, %d/%d" % (
    sys.argv[2], r["request_throughput"], r["median_ttft_ms"], r["median_tpot_ms"], r["completed"],
    r["completed"] + r.get("failed", 0)))
PY
}

echo "bench-invariant: $rounds rounds, pd-serve --dtype auto --threads 2 ${extra[*]} without / with --batch-invariant"
for round in $(seq "$rounds"); do
  for side in off on; do
    flag=()
    [[ $side == on ]] && flag=(--batch-invariant)
    start "serve-$side" pd-serve --model "$models/demo" --served-model-name demo --dtype auto --threads 2 \
      --kv-cache-memory 2G --max-model-len 4096 "${extra[@]}" "${flag[@]}"
    point "$side decode c1 r$round" --random-input-len 64 --random-output-len 128 --num-prompts 8 \
      --num-warmups 2 --max-concurrency 1
    point "$side prefill 2048 r$round" --random-input-len 2048 --random-output-len 1 --num-prompts 6 \
      --num-warmups 1 --max-concurrency 1 --vocab-size "$vocab"
    point "$side mixed c8 r$round" --random-input-len 256 --random-output-len 64 --random-range-ratio 0.5 \
      --num-prompts 48 --num-warmups 8 --max-concurrency 8
    stop_all
  done
done
