#!/usr/bin/env bash
# tools/bench-conditional.sh BUILD_DIR — conditional disaggregation (pd-proxy
# --pd-local-prefill-threshold) on a mixed workload, against always disaggregating and against
# colocated serving, on the same cores, each on freshly started nodes (demo model, --threads 1 each,
# pull over ucx, KV cache events on):
#   disaggregated  1 prefill + 1 decode, every prompt through the prefill (today's default);
#   conditional    the same nodes; a prompt whose part the decode does not hold is under
#                  $PD_COND_THRESHOLD tokens is prefilled by the decode itself;
#   colocated      2 decode nodes that prefill everything themselves (threshold above every prompt;
#                  the proxy needs a prefill pool: one idle prefill stands in it).
# Workload (pd-bench --dataset-name mixed): chat turns over 4 shared 512-token prefixes (32-token
# suffixes, 32 output tokens) and a share of fresh 1024-token prompts. Per run: TTFT p50/p99, TPOT,
# goodput at the SLO, where prompts were prefilled (the proxy's pd_proxy:prefills_total) and the KV
# bytes the decodes read. Appends to bench/RESULTS.md; plots in bench/plots/conditional/.
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
bin="$build/bin"
models="$build/models"
results=bench/RESULTS.md
mkdir -p bench/plots/conditional
source tools/bench-procs.sh
demo_setup cond
node=(--model "$models/demo" --served-model-name demo --kv-cache-memory 1G --max-model-len 2048
      --max-num-batched-tokens 512 --threads 1 --kv-pipe ucx --kv-transfer-mode pull --kv-listen 127.0.0.1:0
      --kv-events-config "$events")
n=${PD_COND_PROMPTS:-80}
rates=${PD_COND_RATES:-1.5,3}
share=${PD_COND_FRESH_SHARE:-0.25}
threshold=${PD_COND_THRESHOLD:-256}
slo="ttft:1000 tpot:50"
dataset="--dataset-name mixed --mixed-fresh-share $share --prefix-repetition-prefix-len 512
  --prefix-repetition-suffix-len 32 --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 32
  --random-input-len 1024 --random-output-len 32"
files=()
rows=()
for rate in ${rates//,/ }; do
for run in disaggregated conditional colocated; do
  echo "bench-conditional: $run at $rate req/s"
  start p0 pd-prefill "${node[@]}"; p0=$port
  start d0 pd-decode "${node[@]}"; d0=$port
  decodes="http://127.0.0.1:$d0"
  dports=($d0)
  case $run in
    disaggregated) extra=(--kv-events) ;;
    conditional) extra=(--pd-local-prefill-threshold "$threshold") ;;
    colocated)
      start d1 pd-decode "${node[@]}"; dports+=($port)
      decodes="$decodes,http://127.0.0.1:$port"
      extra=(--pd-local-prefill-threshold 1000000 --policy least-loaded) ;;
  esac
  start proxy pd-proxy --health-interval 0.5 "${extra[@]}" --prefill "http://127.0.0.1:$p0" --decode "$decodes"
  x=$port
  sleep 1 # the first probe round subscribes to the events
  f="$work/$run-$rate.json"
  # shellcheck disable=SC2086
  "$bin/pd-bench" --base-url "http://127.0.0.1:$x" --wait-ready 60 $dataset --vocab-size "$vocab" --num-prompts "$n" \
    --request-rate "$rate" --seed 13 --num-warmups 0 --ignore-eos --goodput "$slo" --metric-percentiles 50,99 \
    --no-progress --label "$run" --save-result --result-filename "$f" >"$work/$run-$rate.out"
  pm=$(curl -s "http://127.0.0.1:$x/metrics")
  loc=$(awk '/^pd_proxy:prefills_total\{where="local"\}/{print $2}' <<<"$pm")
  rem=$(awk '/^pd_proxy:prefills_total\{where="remote"\}/{print $2}' <<<"$pm")
  rows+=("| $run | $rate | ${loc:-0} | ${rem:-0} | $(kv_read_mib "${dports[@]}") |")
  files+=("$f")
  stop_all
done
done
{
  echo
  echo "## Conditional disaggregation on a mixed workload — $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo "Command: \`tools/bench-conditional.sh build\` (PD_COND_RATES=$rates PD_COND_PROMPTS=$n PD_COND_FRESH_SHARE=$share"
  echo "PD_COND_THRESHOLD=$threshold). Machine: $(nproc) cores. Demo model, every node --threads 1 and"
  echo "--max-num-batched-tokens 512, pull over ucx, KV cache events on, fresh nodes per run. Workload: pd-bench"
  echo "--dataset-name mixed: chat turns over 4 shared 512-token prefixes (+32-token suffixes, 32 output tokens)"
  echo "and a share of $share fresh 1024-token prompts (32 output); $n requests per run at each rate (Poisson), --ignore-eos,"
  echo "goodput SLO \`$slo\` (ms). disaggregated: 1 prefill + 1 decode, every prompt through the prefill;"
  echo "conditional: the same nodes, the decode prefills prompts with fewer than $threshold tokens it does not hold;"
  echo "colocated: 2 decode nodes prefilling everything themselves (least-loaded; the prefill pool's one node idles)."
  echo
  "$bin/pd-bench" table "${files[@]}"
  echo
  echo "| run | rate (req/s) | prefilled on the decode | prefilled on the prefill | KV read by the decodes (MiB) |"
  echo "|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "Plots: bench/plots/conditional/."
} >>"$results"
"$bin/pd-bench" plot bench/plots/conditional "${files[@]}" || true
echo "bench-conditional: results appended to $results"
