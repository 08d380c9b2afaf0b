#!/usr/bin/env bash
# tools/bench-offload.sh BUILD_DIR — the KV offload tier (--kv-offload-tier) on one pd-serve whose
# block pool holds about a quarter of a multi-turn workload's KV: pd-bench --dataset-name multi-turn
# (conversations over one shared system prompt, each turn the history + the answer + a new message),
# tier none vs host vs disk, each on a fresh server (greedy, ignore_eos). Per run: TTFT p50/p99 of
# the turns >= 2, the input tokens computed, the prefix hit rate, TPOT p50, and the tier's blocks
# loaded with their read bandwidth (pd:kv_offload_bytes_read_total / pd:kv_offload_read_seconds_total)
# against the same run's baselines: memcpy of 256 MiB (host) and a page-cache read of the tier file's
# written slots with dd in slot-sized reads (disk). Appends to bench/RESULTS.md.
# PD_OFFLOAD_CONVS (24), PD_OFFLOAD_TURNS (4), PD_OFFLOAD_BLOCKS (480), PD_OFFLOAD_SEED (1).
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
bin="$build/bin"
models="$build/models"
results=bench/RESULTS.md
source tools/bench-procs.sh
demo_setup offload
convs=${PD_OFFLOAD_CONVS:-24}
turns=${PD_OFFLOAD_TURNS:-4}
blocks=${PD_OFFLOAD_BLOCKS:-480}
seed=${PD_OFFLOAD_SEED:-1}
workload=(--dataset-name multi-turn --num-prompts "$convs" --multi-turn-turns "$turns" --multi-turn-system-len 512
          --multi-turn-user-len 256 --random-output-len 64 --multi-turn-think-time 1 --max-concurrency 8
          --temperature 0 --ignore-eos --seed "$seed" --vocab-size "$vocab" --metric-percentiles 50,99 --no-progress)
py=python3 # one with numpy (install-deps.sh puts it in /usr/bin)
for p in python3 /usr/bin/python3; do if "$p" -c 'import numpy' 2>/dev/null; then py=$p; break; fi; done
metric() { awk -v n="$1" '$1 == n {print $2}' "$work/metrics"; }
rows=()
for tier in none host disk; do
  echo "bench-offload: tier $tier, $convs conversations × $turns turns, $blocks pool blocks"
  start serve pd-serve --model "$models/demo" --served-model-name demo --threads 2 --max-model-len 2048 \
    --num-blocks-override "$blocks" --kv-offload-tier "$tier" --kv-offload-size 1G --kv-offload-path "$work/tier.kv"
  "$bin/pd-bench" --base-url "http://127.0.0.1:$port" "${workload[@]}" --save-result \
    --result-filename "$work/$tier.json" --label "$tier" >"$work/$tier.out"
  curl -s "http://127.0.0.1:$port/metrics" >"$work/metrics"
  stop_all
  read -r p50 p99 computed hit tpot failed < <(python3 - "$work/$tier.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
t = j["later_turns"]
inp = j["total_input_tokens"]
print(round(t["median_ttft_ms"]), round(t["p99_ttft_ms"]), j["computed_input_tokens"],
      "%.3f" % (j["cached_input_tokens"] / inp), "%.2f" % j["median_tpot_ms"], j["failed"])
EOF
)
  loads="-" bw="-" base="-" ratio="-" dev="-"
  if [[ $tier != none ]]; then
    loads=$(metric pd:kv_offload_hits_total)
    bw=$(awk -v b="$(metric pd:kv_offload_bytes_read_total)" -v s="$(metric pd:kv_offload_read_seconds_total)" \
      'BEGIN{printf "%.2f", (s > 0 ? b / s / 1e9 : 0)}')
    if [[ $tier == host ]]; then
      base=$("$py" -c "import numpy as np, time
a = np.ones(256 << 20, np.uint8); b = np.empty_like(a); np.copyto(b, a)
t = time.perf_counter(); [np.copyto(b, a) for _ in range(8)]; print('%.2f' % (8 * a.nbytes / (time.perf_counter() - t) / 1e9))")
    else
      slot=$(( ( (64 + 8 * 2 * 16 * 2 * 64 * 2) + 4095 ) / 4096 * 4096 )) # the demo model: 8 layers, 2 kv heads of 64, bf16
      # the slots written (the first ones: the file is sparse past them, and a hole reads as fast as
      # zeros), twice: the second from the page cache, as the tier's loads read them
      n=$(awk -v a="$(metric pd:kv_offload_saved_blocks_total)" -v b="$(metric pd:kv_offload_capacity_blocks)" \
        'BEGIN{printf "%d", (a < b ? a : b)}')
      dd if="$work/tier.kv" of=/dev/null bs="$slot" skip=4096 iflag=skip_bytes count="$n" 2>/dev/null
      base=$(dd if="$work/tier.kv" of=/dev/null bs="$slot" skip=4096 iflag=skip_bytes count="$n" 2>&1 |
        awk '/copied/{for (i = 1; i <= NF; i++) if ($i ~ /^s,?$/) {print $1 / $(i-1) / 1e9}}' | awk '{printf "%.2f", $1}')
      # the device itself (O_DIRECT: what a tier larger than the page cache reads at), for context
      dev=$(dd if="$work/tier.kv" of=/dev/null bs="$slot" skip=4096 iflag=skip_bytes,direct count="$n" 2>&1 |
        awk '/copied/{for (i = 1; i <= NF; i++) if ($i ~ /^s,?$/) {print $1 / $(i-1) / 1e9}}' | awk '{printf "%.2f", $1}')
      dev=${dev:--}
    fi
    ratio=$(awk -v a="$bw" -v b="$base" 'BEGIN{printf "%.2f", (b > 0 ? a / b : 0)}')
  fi
  rows+=("| $tier | $p50 | $p99 | $computed | $hit | $tpot | $loads | $bw | $base | $ratio | $dev | $failed |")
done
{
  echo
  echo "### KV offload tier: multi-turn on one pd-serve, pool ≈ 1/4 of the KV ($(date -u +%Y-%m-%d))"
  echo
  echo "\`tools/bench-offload.sh $build\` — demo model (8 layers, bf16 KV, 64 KiB blocks), $blocks pool blocks,"
  echo "$convs conversations × $turns turns (512-token shared system prompt, 256-token messages, 64-token answers,"
  echo "1 s think time, 8 in flight), greedy; $(nproc) cores: $(lscpu | sed -n 's/^Model name: *//p')."
  echo "Bandwidth: the tier's loads (bytes read / seconds in loads) vs the same run's baseline (host: numpy"
  echo "memcpy of 256 MiB; disk: dd of the tier file's written slots from the page cache in slot-sized reads;"
  echo "the device column: the same slots read with O_DIRECT, what a tier larger than the page cache gets)."
  echo
  echo "| tier | TTFT p50 turns≥2 (ms) | TTFT p99 turns≥2 (ms) | input tokens computed | prefix hit rate | TPOT p50 (ms) | blocks loaded | load GB/s | baseline GB/s | ratio | device GB/s (O_DIRECT dd) | failed |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee -a "$results"
