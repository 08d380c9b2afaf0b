#!/usr/bin/env bash
# tools/bench-tier-load.sh BUILD_DIR — what a load from the KV offload tier costs the requests already
# running: --kv-offload-load inline (the engine thread reads the tier when the request is admitted)
# against thread (a loader thread reads it while the engine steps the others). One pd-serve (demo
# model, 2 threads, disk tier, a pool of PD_TIER_BLOCKS blocks) per run:
#   1. PD_TIER_PROMPTS prompts of PD_TIER_LEN tokens are prefilled (max_tokens 1), so that the pool
#      evicts most of them into the tier;
#   2. cold runs: the tier file is synced and its page cache dropped (dd iflag=nocache), as a tier
#      larger than the page cache is read from the device;
#   3. PD_TIER_STREAMS streams decode PD_TIER_OUT tokens each (64-token prompts) while the same long
#      prompts are sent again one at a time, each loading its prefix from the tier and computing one
#      token.
# Reports the streams' ITL p50 / p99 / max and TPOT p50, the long prompts' TTFT p50, the blocks the
# tier loaded in step 3 and the read rate of those loads. Appends to bench/RESULTS.md.
# Run "alone": step 3's streams without the long prompts (their floor).
# PD_TIER_RUNS ("alone inline/cold thread/cold inline thread"), PD_TIER_PROMPTS (16), PD_TIER_LEN (4096),
# PD_TIER_BLOCKS (1024), PD_TIER_STREAMS (4), PD_TIER_OUT (1024).
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
bin="$build/bin"
models="$build/models"
results=bench/RESULTS.md
source tools/bench-procs.sh
demo_setup tierload
read -r -a runs <<<"${PD_TIER_RUNS:-alone inline/cold thread/cold inline thread}"
nprompts=${PD_TIER_PROMPTS:-16}
len=${PD_TIER_LEN:-4096}
blocks=${PD_TIER_BLOCKS:-1024}
streams=${PD_TIER_STREAMS:-4}
out=${PD_TIER_OUT:-1024}
common=(--dataset-name random --vocab-size "$vocab" --temperature 0 --ignore-eos --metric-percentiles 50,99,100
        --no-progress --save-result)
long=("${common[@]}" --num-prompts "$nprompts" --random-input-len "$len" --random-output-len 1 --max-concurrency 1
      --seed 11)
metric() { curl -s "http://127.0.0.1:$port/metrics" | awk -v n="$1" '$1 == n {print $2}'; }
rows=()
for run in "${runs[@]}"; do
  IFS=/ read -r load cold <<<"$run"
  again=1
  if [[ $load == alone ]]; then load=auto again=0; fi
  echo "bench-tier-load: $run: $nprompts prompts of $len tokens into the tier, then $streams streams of $out tokens beside them"
  rm -f "$work/tier.kv"
  start serve pd-serve --model "$models/demo" --served-model-name demo --threads 2 --max-model-len $((len + 64)) \
    --num-blocks-override "$blocks" --kv-offload-tier disk --kv-offload-size 2G --kv-offload-path "$work/tier.kv" \
    --kv-offload-load "$load"
  "$bin/pd-bench" --base-url "http://127.0.0.1:$port" "${long[@]}" --result-filename "$work/warm.json" >/dev/null
  if [[ $cold == cold ]]; then
    dd of="$work/tier.kv" oflag=nocache conv=notrunc,fdatasync count=0 status=none
    dd if="$work/tier.kv" iflag=nocache count=0 status=none
  fi
  h0=$(metric pd:kv_offload_hits_total) b0=$(metric pd:kv_offload_bytes_read_total)
  s0=$(metric pd:kv_offload_read_seconds_total)
  "$bin/pd-bench" --base-url "http://127.0.0.1:$port" "${common[@]}" --num-prompts "$streams" \
    --max-concurrency "$streams" --random-input-len 64 --random-output-len "$out" --seed 12 \
    --result-filename "$work/streams.json" >/dev/null &
  streams_pid=$!
  sleep 1 # the streams are decoding
  if [[ $again == 1 ]]; then
    "$bin/pd-bench" --base-url "http://127.0.0.1:$port" "${long[@]}" --result-filename "$work/again.json" >/dev/null
  else
    echo '{"median_ttft_ms": -1, "failed": 0}' >"$work/again.json"
  fi
  wait "$streams_pid"
  h1=$(metric pd:kv_offload_hits_total) b1=$(metric pd:kv_offload_bytes_read_total)
  s1=$(metric pd:kv_offload_read_seconds_total)
  stop_all
  read -r itl50 itl99 itlmax tpot ttft failed < <(python3 - "$work/streams.json" "$work/again.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
a = json.load(open(sys.argv[2]))
print("%.1f" % s["median_itl_ms"], "%.1f" % s["p99_itl_ms"], "%.1f" % s["p100_itl_ms"], "%.2f" % s["median_tpot_ms"],
      round(a["median_ttft_ms"]), s["failed"] + a["failed"])
EOF
)
  read -r loaded gbs < <(awk -v h0="$h0" -v h1="$h1" -v b0="$b0" -v b1="$b1" -v s0="$s0" -v s1="$s1" \
    'BEGIN{printf "%d %.2f\n", h1 - h0, (s1 > s0 ? (b1 - b0) / (s1 - s0) / 1e9 : 0)}')
  if [[ $again == 0 ]]; then load="(streams alone)" ttft=- cold=-; fi
  rows+=("| $load | ${cold:-warm} | $itl50 | $itl99 | $itlmax | $tpot | $ttft | $loaded | $gbs | $failed |")
done
{
  echo
  echo "### KV offload tier: what a tier load costs the running streams, inline vs on the loader thread ($(date -u +%Y-%m-%d))"
  echo
  echo "\`PD_TIER_RUNS='${runs[*]}' PD_TIER_PROMPTS=$nprompts PD_TIER_LEN=$len PD_TIER_BLOCKS=$blocks PD_TIER_STREAMS=$streams PD_TIER_OUT=$out tools/bench-tier-load.sh $build\`"
  echo "— one pd-serve, demo model (bf16 KV, 64 KiB blocks), --threads 2, a disk tier behind $blocks pool blocks; $nprompts prompts of"
  echo "$len tokens prefilled into it, then $streams streams decoding $out tokens (64-token prompts) while the same prompts are"
  echo "sent again one at a time (each loads its prefix from the tier, computes one token). cold: the tier file's page"
  echo "cache dropped before; warm: read from the page cache. $(nproc) cores: $(lscpu | sed -n 's/^Model name: *//p')."
  echo "Read GB/s: the loads' bytes / the time in their reads (on the loader thread that time includes waiting for a core)."
  echo
  echo "| loads | tier file | streams' ITL p50 (ms) | ITL p99 (ms) | ITL max (ms) | TPOT p50 (ms) | long prompts' TTFT p50 (ms) | blocks loaded | read GB/s | failed |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee -a "$results"
