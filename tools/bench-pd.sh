#!/usr/bin/env bash
# tools/bench-pd.sh BUILD_DIR — the disaggregation benchmarks (part of `make bench`):
#   1. handover overhead: TTFT via prefill→decode minus TTFT of the prefill alone, for 512, 2048
#      and 8176-token prompts (the demo model's 8192 positions minus one block), by phase, against the pipe's own bandwidth (pd-bench-handover);
#      then streamed requests with the first token from the prefill vs from the decode (a second
#      proxy with --no-first-token-from-prefill over the same nodes), 512 and 2048 tokens;
#   2. disaggregated 1P1D (pull and push, ucx) vs colocated pd-serve with the same total threads
#      (2), the demo model, a sweep of request rates for a long-prompt/short-output workload and a
#      mixed one: goodput at a TPOT SLO and TTFT/TPOT/ITL percentiles (pd-bench), plots in
#      bench/plots/.
# Results are appended to bench/RESULTS.md with the commands, machine and date.
# PD_BENCH_QUICK=1 runs a smaller sweep (fewer prompts and rates); PD_BENCH_ONLY=handover|sweep
# runs one part; PD_BENCH_MODES=pull (or push) runs the handover for one mode;
# PD_BENCH_HANDOVER_LENS=512,2048 leaves out the 8176-token prompts (70+ s each on one thread);
# PD_BENCH_PIPE=tcp moves the KV over the tcp pipe instead of ucx; PD_BENCH_PROXY_ARGS adds flags
# to both proxies (e.g. "--upstream-idle-connections 0" for a new connection per leg).
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
bin="$build/bin"
models="$build/models"
results=bench/RESULTS.md
pipe=${PD_BENCH_PIPE:-ucx}
mkdir -p bench/plots
source tools/bench-procs.sh
demo_setup bench

model=(--model "$models/demo" --served-model-name demo --kv-cache-memory 3G --max-model-len 8192
       --max-num-batched-tokens 2048)
# start_pd MODE — 1 prefill + 1 decode (1 thread each) + proxy; sets pport dport xport
start_pd() {
  # push: the decode waits for the whole prefill (70+ s for 8k tokens on one thread here)
  local kv=(--threads 1 --kv-pipe "$pipe" --kv-transfer-mode "$1" --kv-listen 127.0.0.1:0 --kv-load-timeout 600)
  start prefill pd-prefill "${model[@]}" "${kv[@]}"; pport=$port
  start decode pd-decode "${model[@]}" "${kv[@]}"; dport=$port
  # shellcheck disable=SC2086 # PD_BENCH_PROXY_ARGS is a list of flags
  start proxy pd-proxy --health-interval 0.5 --prefill "http://127.0.0.1:$pport" --decode "http://127.0.0.1:$dport" \
    ${PD_BENCH_PROXY_ARGS:-}
  xport=$port
  # the same nodes behind a proxy where the decode samples the first token (the handover's baseline)
  start proxy-legacy pd-proxy --health-interval 0.5 --prefill "http://127.0.0.1:$pport" \
    --decode "http://127.0.0.1:$dport" --no-first-token-from-prefill ${PD_BENCH_PROXY_ARGS:-}
  lport=$port
  # measure after both nodes finished pre-faulting their KV regions (a background thread)
  for _ in $(seq 600); do
    if grep -q "pre-faulted" "$work/prefill.log" && grep -q "pre-faulted" "$work/decode.log"; then return 0; fi
    sleep 0.2
  done
}

machine="$(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"

# ---- 1. handover overhead --------------------------------------------------------------------
for mode in ${PD_BENCH_MODES:-pull push}; do
  [[ ${PD_BENCH_ONLY:-handover} == handover ]] || break
  echo "bench-pd: handover overhead ($mode, $pipe)"
  start_pd "$mode"
  "$bin/pd-bench" --base-url "http://127.0.0.1:$xport" --wait-ready 60 --num-prompts 1 \
    --random-input-len 16 --random-output-len 1 --no-progress >/dev/null
  "$bin/pd-bench-handover" --proxy "http://127.0.0.1:$xport" --prefill "http://127.0.0.1:$pport" \
    --decode "http://127.0.0.1:$dport" --lens "${PD_BENCH_HANDOVER_LENS:-512,2048,8176}" --repeat "${PD_BENCH_HANDOVER_REPEAT:-2}" --kv-bytes-per-token 8192 \
    --page-bytes 16384 --pipe "$pipe" --label "($mode, $pipe, demo model${PD_BENCH_PROXY_ARGS:+, proxy $PD_BENCH_PROXY_ARGS})" --results "$results" \
    --proxy-legacy "http://127.0.0.1:$lport" --stream-lens 512,2048
  stop_all
done

# ---- 2. disaggregated vs colocated sweep ------------------------------------------------------
if [[ ${PD_BENCH_ONLY:-sweep} != sweep ]]; then exit 0; fi
if [[ -n "${PD_BENCH_QUICK:-}" ]]; then rates=(1 2); n=12; else rates=(0.5 1 2 4); n=24; fi
slo="tpot:40 ttft:3000"
declare -A wl
wl[long]="--random-input-len 1024 --random-output-len 16 --random-range-ratio 0.2"
wl[mixed]="--random-input-len 256 --random-output-len 96 --random-range-ratio 0.5"
files_long=(); files_mixed=()
for config in colocated pull push; do
  if [[ $config == colocated ]]; then
    start serve pd-serve "${model[@]}" --threads 2; url="http://127.0.0.1:$port"; kvurl=()
  else
    start_pd "$config"; url="http://127.0.0.1:$xport"; kvurl=(--kv-metrics-url "http://127.0.0.1:$dport")
  fi
  seed=7
  for w in long mixed; do
    for rate in "${rates[@]}"; do
      seed=$((seed + 1)) # fresh prompts per point: no prefix-cache hits from the previous point
      f="$work/$config-$w-$rate.json"
      echo "bench-pd: $config, $w workload, $rate req/s"
      # shellcheck disable=SC2086
      "$bin/pd-bench" --base-url "$url" --wait-ready 60 --dataset-name random ${wl[$w]} --num-prompts "$n" \
        --request-rate "$rate" --seed "$seed" --num-warmups 2 --ignore-eos --goodput "$slo" --metric-percentiles 50,99 \
        --no-progress \
        --label "$config $w" --save-result --result-filename "$f" "${kvurl[@]}" >"$work/$config-$w-$rate.out"
      if [[ $w == long ]]; then files_long+=("$f"); else files_mixed+=("$f"); fi
    done
  done
  stop_all
done
{
  echo
  echo "## pd-bench: 1P1D (pull, push; $pipe) vs colocated pd-serve — $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo "Command: \`tools/bench-pd.sh\` (\`make bench\`). Machine: $machine. Demo model (8 layers, hidden 512,"
  echo "random bf16 weights, bf16 KV by --kv-cache-dtype auto), same total threads: pd-serve --threads 2 vs prefill 1 + decode 1."
  echo "$n requests per point (+2 unmeasured warmups), fresh prompts per point (seed), Poisson arrivals,"
  echo "--ignore-eos; goodput SLO: \`$slo\` (ms)."
  echo "long = 1024±20% prompt tokens, 16 output; mixed = 256±50% prompt, 96±50% output."
  echo
  "$bin/pd-bench" table "${files_long[@]}" "${files_mixed[@]}"
  echo
  echo "Plots: bench/plots/pd_long/, bench/plots/pd_mixed/ (latency vs rate, CDF)."
} >>"$results"
"$bin/pd-bench" plot bench/plots/pd_long "${files_long[@]}" || true
"$bin/pd-bench" plot bench/plots/pd_mixed "${files_mixed[@]}" || true
echo "bench-pd: results appended to $results"
