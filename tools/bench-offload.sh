#!/usr/bin/env bash
# tools/bench-offload.sh BUILD_DIR — the KV offload tier (--kv-offload-tier) on one pd-serve whose
# block pool holds about a quarter of a multi-turn workload's KV: pd-bench --dataset-name multi-turn
# (conversations over one shared system prompt, each turn the history + the answer + a new message),
# greedy, ignore_eos, each run on a fresh server. Runs (PD_OFFLOAD_RUNS, names TIER[/LOAD][/cold]):
#   none                 no tier
#   host, disk           the tier with its default --kv-offload-load (host inline, disk thread)
#   disk/inline          the disk tier's loads on the engine thread, at admission
#   disk/cold[/inline]   the same with the tier file's page cache dropped every 50 ms (dd
#                        iflag=nocache after an fdatasync): a tier larger than the page cache, read
#                        from the device
# Per run: TTFT p50/p99 of the turns >= 2, the input tokens computed, the prefix hit rate, TPOT p50,
# ITL p99 (what a load on the engine thread costs the other streams), and the tier's blocks loaded
# with their read bandwidth (pd:kv_offload_bytes_read_total / pd:kv_offload_read_seconds_total)
# against the same run's baselines: memcpy of 256 MiB (host) and a page-cache read of the tier file's
# written slots with dd in slot-sized reads (disk). Appends to bench/RESULTS.md.
# PD_OFFLOAD_CONVS (24), PD_OFFLOAD_TURNS (4), PD_OFFLOAD_BLOCKS (480), PD_OFFLOAD_SEED (1),
# PD_OFFLOAD_SYSTEM (512), PD_OFFLOAD_USER (256), PD_OFFLOAD_CONC (8: in flight), PD_OFFLOAD_MAX_LEN
# (2048: --max-model-len; the demo model takes up to 8192), PD_OFFLOAD_RUNS ("none host disk disk/inline").
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
system=${PD_OFFLOAD_SYSTEM:-512}
user=${PD_OFFLOAD_USER:-256}
conc=${PD_OFFLOAD_CONC:-8}
maxlen=${PD_OFFLOAD_MAX_LEN:-2048}
read -r -a runs <<<"${PD_OFFLOAD_RUNS:-none host disk disk/inline}"
workload=(--dataset-name multi-turn --num-prompts "$convs" --multi-turn-turns "$turns" --multi-turn-system-len "$system"
          --multi-turn-user-len "$user" --random-output-len 64 --multi-turn-think-time 1 --max-concurrency "$conc"
          --temperature 0 --ignore-eos --seed "$seed" --vocab-size "$vocab" --metric-percentiles 50,99 --no-progress)
py=python3 # one with numpy (install-deps.sh puts it in /usr/bin)
for p in python3 /usr/bin/python3; do if "$p" -c 'import numpy' 2>/dev/null; then py=$p; break; fi; done
metric() { awk -v n="$1" '$1 == n {print $2}' "$work/metrics"; }
rows=()
dropper=""
stop_dropper() { if [[ -n $dropper ]]; then kill "$dropper" 2>/dev/null || true; wait "$dropper" 2>/dev/null || true; dropper=""; fi; }
trap 'stop_dropper; stop_all; rm -rf "$work"' EXIT
for run in "${runs[@]}"; do
  IFS=/ read -r tier a b <<<"$run"
  load=auto cold=0
  for w in $a $b; do if [[ $w == cold ]]; then cold=1; else load=$w; fi; done
  echo "bench-offload: $run ($tier tier, loads $load), $convs conversations × $turns turns, $blocks pool blocks"
  rm -f "$work/tier.kv"
  start serve pd-serve --model "$models/demo" --served-model-name demo --threads 2 --max-model-len "$maxlen" \
    --num-blocks-override "$blocks" --kv-offload-tier "$tier" --kv-offload-size 1G --kv-offload-path "$work/tier.kv" \
    --kv-offload-load "$load"
  if [[ $cold == 1 ]]; then
    ( while sleep 0.05; do
        dd of="$work/tier.kv" oflag=nocache conv=notrunc,fdatasync count=0 status=none 2>/dev/null || true
        dd if="$work/tier.kv" iflag=nocache count=0 status=none 2>/dev/null || true
      done ) &
    dropper=$!
  fi
  "$bin/pd-bench" --base-url "http://127.0.0.1:$port" "${workload[@]}" --save-result \
    --result-filename "$work/run.json" --label "$run" >"$work/run.out"
  stop_dropper
  curl -s "http://127.0.0.1:$port/metrics" >"$work/metrics"
  mode=$( (grep -ho 'kv offload: loads run [a-z]*' "$work"/*.log 2>/dev/null || true) | tail -1 | awk '{print $NF}')
  stop_all
  read -r p50 p99 computed hit tpot itl99 failed < <(python3 - "$work/run.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
t = j["later_turns"]
inp = j["total_input_tokens"]
print(round(t["median_ttft_ms"]), round(t["p99_ttft_ms"]), j["computed_input_tokens"],
      "%.3f" % (j["cached_input_tokens"] / inp), "%.2f" % j["median_tpot_ms"], "%.1f" % j["p99_itl_ms"], j["failed"])
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
  rows+=("| $run | ${mode:--} | $p50 | $p99 | $computed | $hit | $tpot | $itl99 | $loads | $bw | $base | $ratio | $dev | $failed |")
done
{
  echo
  echo "### KV offload tier: multi-turn on one pd-serve, pool ≈ 1/4 of the KV ($(date -u +%Y-%m-%d))"
  echo
  echo "\`PD_OFFLOAD_RUNS='${runs[*]}' PD_OFFLOAD_CONVS=$convs PD_OFFLOAD_TURNS=$turns PD_OFFLOAD_BLOCKS=$blocks PD_OFFLOAD_SYSTEM=$system PD_OFFLOAD_USER=$user PD_OFFLOAD_CONC=$conc PD_OFFLOAD_MAX_LEN=$maxlen tools/bench-offload.sh $build\` — demo model (8 layers, bf16 KV, 64 KiB blocks),"
  echo "$blocks pool blocks, $convs conversations × $turns turns ($system-token shared system prompt, $user-token messages, 64-token answers,"
  echo "1 s think time, $conc in flight), greedy; $(nproc) cores: $(lscpu | sed -n 's/^Model name: *//p')."
  echo "Bandwidth: the tier's loads (bytes read / seconds in loads) vs the same run's baseline (host: numpy"
  echo "memcpy of 256 MiB; disk: dd of the tier file's written slots from the page cache in slot-sized reads;"
  echo "the device column: the same slots read with O_DIRECT, what a tier larger than the page cache gets)."
  echo "Runs named /cold drop the tier file's page cache every 50 ms; loads: where the tier's reads ran."
  echo
  echo "| run | loads | TTFT p50 turns≥2 (ms) | TTFT p99 turns≥2 (ms) | input tokens computed | prefix hit rate | TPOT p50 (ms) | ITL p99 (ms) | blocks loaded | load GB/s | baseline GB/s | ratio | device GB/s (O_DIRECT dd) | failed |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee -a "$results"
