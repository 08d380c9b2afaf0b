#!/usr/bin/env bash
# tools/bench-dtype.sh BUILD_DIR — serving with the weights at checkpoint precision vs widened to
# fp32 (issue 18's no-regression check): pd-serve on the demo model (a bf16 checkpoint) with
# --dtype float32 and --dtype auto (bf16 matrices; the KV cache is bf16 in both, --kv-cache-dtype
# auto), and --dtype auto with --matmul-precision bf16 (bf16 arithmetic), each under pd-bench at
# concurrency 8 and 16 with the same prompts, runs alternated (float32, auto, auto+bf16-math,
# three rounds) so the VM's drift shows. Appends the table to bench/RESULTS.md.
# PD_DTYPE_PROMPTS sets the requests per point (default 64).
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
bin="$build/bin"
models="$build/models"
results=bench/RESULTS.md
prompts=${PD_DTYPE_PROMPTS:-64}
if [[ ! -f "$models/demo/config.json" ]]; then
  "$bin/pd-mkmodel" --preset demo --out "$models/demo"
fi
work=$(mktemp -d /tmp/pd-bench-dtype-XXXXXX)
pid=
stop() {
  if [[ -n "$pid" ]]; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    pid=
  fi
}
trap 'stop; rm -rf "$work"' EXIT

rows=()
for round in 1 2 3; do
  for dtype in float32 auto bf16-math; do
    rm -f "$work/port"
    args=(--dtype "$dtype")
    [[ "$dtype" == bf16-math ]] && args=(--dtype auto --matmul-precision bf16)
    "$bin/pd-serve" --model "$models/demo" --served-model-name demo "${args[@]}" --threads 2 \
      --kv-cache-memory 2G --max-model-len 4096 --port 0 --port-file "$work/port" >"$work/serve-$dtype.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do [[ -s "$work/port" ]] && break; kill -0 "$pid" || { cat "$work/serve-$dtype.log"; exit 1; }; sleep 0.2; done
    port=$(cat "$work/port")
    loaded=$(grep -o 'model loaded: [0-9.]* MiB' "$work/serve-$dtype.log" | grep -o '[0-9.]* MiB')
    for conc in 8 16; do
      out="$work/$dtype-$conc-$round.json"
      echo "bench-dtype: round $round, --dtype $dtype, concurrency $conc" >&2
      "$bin/pd-bench" --base-url "http://127.0.0.1:$port" --dataset-name random --random-input-len 256 \
        --random-output-len 64 --random-range-ratio 0.5 --num-prompts "$prompts" --num-warmups 16 --seed 7 \
        --max-concurrency "$conc" --ignore-eos --no-progress --save-result --result-filename "$out" \
        --label "$dtype c$conc r$round" --wait-ready 60 >/dev/null
      rows+=("$(python3 - "$out" "$dtype" "$conc" "$round" "$loaded" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("| %s (%s weights) | %s | %s | %d/%d | %.2f | %.1f | %.0f / %.0f | %.1f / %.1f |" % (
    sys.argv[2], sys.argv[5], sys.argv[3], sys.argv[4], r["completed"], r.get("failed", 0),
    r["request_throughput"], r["output_throughput"], r["median_ttft_ms"], r["p99_ttft_ms"],
    r["median_tpot_ms"], r["p99_tpot_ms"]))
PY
)")
    done
    stop
  done
done
{
  echo
  echo "## Serving with weights at checkpoint precision (issue 18) — $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo "Command: \`tools/bench-dtype.sh $build\`. Machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)."
  echo "pd-serve --threads 2 on the demo model (bf16 checkpoint, bf16 KV), random 256±50% prompt / 64±50%"
  echo "output tokens, $prompts requests per point (+16 warmups), same seed for every point; rounds alternate."
  echo
  echo 'bf16-math is `--dtype auto --matmul-precision bf16`.'
  echo
  echo "| --dtype | concurrency | round | done/failed | req/s | out tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) |"
  echo "|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} >>"$results"
tail -n $(( ${#rows[@]} + 8 )) "$results"
