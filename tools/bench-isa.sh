#!/usr/bin/env bash
# tools/bench-isa.sh [BUILD_DIR] [MODEL_DIR...] — pd-bench-ops' single-stream decode at every
# instruction-set level this CPU supports (--cpu-isa; issue 45), the same weights at each level
# (checkpoint bf16, fp32, int8), each run with its own same-run read bandwidth and roofline. Each
# run's whole table goes to BUILD_DIR/bench-isa-tables.md; the summary (tok/s and ratio to the
# roofline per level) is printed and appended, with the command, to bench/RESULTS.md.
# Models: the demo and the 565 M model of `make bench` by default.
set -euo pipefail
build=${1:-build}
shift || true
cd "$(dirname "$0")/.."
models=("$@")
if [[ ${#models[@]} -eq 0 ]]; then
  [[ -f "$build/models/demo/config.json" ]] || "$build/bin/pd-mkmodel" --preset demo --out "$build/models/demo"
  if [[ ! -f "$build/models/llama-565m/config.json" ]]; then
    echo "bench-isa: generating the 565 M model in $build/models/llama-565m"
    "$build/bin/pd-mkmodel" --preset demo --hidden 1536 --layers 16 --heads 12 --kv-heads 4 --intermediate 5632 \
      --vocab 16000 --dtype bf16 --out "$build/models/llama-565m" > /dev/null
  fi
  models=("$build/models/demo" "$build/models/llama-565m")
fi
flags=$(grep -m1 '^flags' /proc/cpuinfo)
levels=(portable)
[[ $flags == *" avx2 "* ]] && levels+=(avx2)
[[ $flags == *" avx512f "* && $flags == *" avx512bw "* && $flags == *" avx512vl "* ]] && levels+=(avx512)
[[ $flags == *" avx512_bf16 "* ]] && levels+=(avx512_bf16)
[[ $flags == *" amx_tile "* ]] && levels+=(amx)
summary=()
for m in "${models[@]}"; do
  for w in auto float32 int8; do
    for l in "${levels[@]}"; do
      echo "bench-isa: $(basename "$m"), $w weights, --cpu-isa $l" >&2
      out=$("$build/bin/pd-bench-ops" --model "$m" --model-only --weights "$w" --batch 1 --threads "${PD_THREADS:-2}" \
        --cpu-isa "$l" --results "$build/bench-isa-tables.md" 2> /dev/null | grep '^model decode' || true)
      row=$(awk -v m="$(basename "$m")" -v w="$w" -v l="$l" \
        '{for (i = 1; i <= NF; i++) if ($i == "tok/s") {v = $(i - 1); break}; printf "| %s | %s | %s | %s | %s |", m, w, l, v, $NF}' <<< "$out")
      summary+=("$row")
    done
  done
done
table=$(
  echo "| model | weights | --cpu-isa | decode batch 1 | / read roofline (same run) |"
  echo "|---|---|---|---|---|"
  printf '%s\n' "${summary[@]}"
)
echo "$table"
{
  echo
  echo "## tools/bench-isa.sh — $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo "Command: \`tools/bench-isa.sh $build${models[*]:+ ${models[*]}}\` (pd-bench-ops --model-only --batch 1 --threads ${PD_THREADS:-2} per level; whole tables in $build/bench-isa-tables.md)  "
  echo "Machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores; levels: ${levels[*]}"
  echo
  echo "$table"
} >> bench/RESULTS.md
