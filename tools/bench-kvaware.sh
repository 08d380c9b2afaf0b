#!/usr/bin/env bash
# tools/bench-kvaware.sh BUILD_DIR — pd-proxy's routing policies on 2 prefills + 2 decodes (pull, ucx,
# the demo model, every node publishing its KV cache events), each policy on freshly started nodes
# (empty prefix caches):
#   shared prefixes: pd-bench --dataset-name prefix-repetition (a few long prefixes, short
#     suffixes), round-robin vs prefix-affinity vs kv-aware;
#   no shared prefix: --dataset-name random, round-robin vs kv-aware (kv-aware must not lose).
# Per run: TTFT p50/p99, goodput at the SLO (pd-bench) and the KV bytes both decodes read
# (pd:kv_transfer_bytes_total). Appends to bench/RESULTS.md; plots in bench/plots/kvaware/.
# PD_KVAWARE_RATE (2), PD_KVAWARE_PROMPTS (40), PD_KVAWARE_SEEDS (11; a list repeats every run per
# seed), PD_KVAWARE_ONLY (shared|fresh: one workload), PD_KVAWARE_POLICIES (a list, commas or spaces: those alone),
# PD_KVAWARE_PROXY_ARGS (more pd-proxy flags), PD_KVAWARE_PREFIXES (4: shared prefixes),
# PD_KVAWARE_NODE_ARGS (more flags for every node, e.g. --num-blocks-override 500: a prefix cache
# smaller than the prefixes, so that where a prefix is served decides whether it is still cached).
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
bin="$build/bin"
models="$build/models"
results=bench/RESULTS.md
mkdir -p bench/plots/kvaware
source tools/bench-procs.sh
demo_setup kvaware
node=(--model "$models/demo" --served-model-name demo --kv-cache-memory 1G --max-model-len 2048
      --max-num-batched-tokens 2048 --threads 1 --kv-pipe ucx --kv-transfer-mode pull --kv-listen 127.0.0.1:0
      --kv-events-config "$events")
read -r -a nodeargs <<<"${PD_KVAWARE_NODE_ARGS:-}"
node+=("${nodeargs[@]}")
prefixes=${PD_KVAWARE_PREFIXES:-4}
n=${PD_KVAWARE_PROMPTS:-40}
rate=${PD_KVAWARE_RATE:-2}
seeds=${PD_KVAWARE_SEEDS:-11}
only=${PD_KVAWARE_ONLY:-} # shared or fresh: that workload alone
policies=${PD_KVAWARE_POLICIES:-} # a list: those policies alone
for p in ${policies//,/ }; do # a misspelt list would run nothing and append an empty table
  case "$p" in
  round-robin | prefix-affinity | kv-aware) ;;
  *) echo "bench-kvaware: PD_KVAWARE_POLICIES: '$p' is not round-robin, prefix-affinity or kv-aware" >&2; exit 2 ;;
  esac
done
policies=${policies// /,}
case "$only" in
"" | shared | fresh) ;;
*) echo "bench-kvaware: PD_KVAWARE_ONLY must be shared or fresh, not '$only'" >&2; exit 2 ;;
esac
read -r -a pxargs <<<"${PD_KVAWARE_PROXY_ARGS:-}" # more pd-proxy flags, e.g. --kv-aware-load-weight 0.3
slo="ttft:2000 tpot:100"
declare -A ds
ds[shared]="--dataset-name prefix-repetition --prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 32 --prefix-repetition-num-prefixes $prefixes --prefix-repetition-output-len 16"
ds[fresh]="--dataset-name random --random-input-len 544 --random-output-len 16"
files=()
rows=()
for seed in ${seeds//,/ }; do
for run in "shared round-robin" "shared prefix-affinity" "shared kv-aware" "fresh round-robin" "fresh kv-aware"; do
  set -- $run
  w=$1 policy=$2
  [[ -z "$only" || "$only" == "$w" ]] || continue
  [[ -z "$policies" || ",$policies," == *",$policy,"* ]] || continue
  echo "bench-kvaware: $w prompts, $policy, seed $seed"
  start p0 pd-prefill "${node[@]}"; p0=$port
  start p1 pd-prefill "${node[@]}"; p1=$port
  start d0 pd-decode "${node[@]}"; d0=$port
  start d1 pd-decode "${node[@]}"; d1=$port
  start proxy pd-proxy --health-interval 0.5 --policy "$policy" "${pxargs[@]}" \
    --prefill "http://127.0.0.1:$p0,http://127.0.0.1:$p1" --decode "http://127.0.0.1:$d0,http://127.0.0.1:$d1"
  x=$port
  f="$work/$w-$policy-$seed.json"
  # shellcheck disable=SC2086
  "$bin/pd-bench" --base-url "http://127.0.0.1:$x" --wait-ready 60 ${ds[$w]} --vocab-size "$vocab" --num-prompts "$n" \
    --request-rate "$rate" --seed "$seed" --num-warmups 0 --ignore-eos --goodput "$slo" --metric-percentiles 50,99 \
    --no-progress --label "$w $policy${PD_KVAWARE_PROXY_ARGS:+ ($PD_KVAWARE_PROXY_ARGS)} seed $seed" --save-result --result-filename "$f" >"$work/$w-$policy-$seed.out"
  rows+=("| $w | $policy | $seed | $(kv_read_mib "$d0" "$d1") |")
  files+=("$f")
  stop_all
done
done
{
  echo
  echo "## pd-proxy routing policies, 2 prefills + 2 decodes — $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo "Command: \`PD_KVAWARE_RATE=$rate PD_KVAWARE_PROMPTS=$n PD_KVAWARE_SEEDS=$seeds PD_KVAWARE_ONLY=$only PD_KVAWARE_POLICIES=$policies PD_KVAWARE_PROXY_ARGS='${PD_KVAWARE_PROXY_ARGS:-}' PD_KVAWARE_PREFIXES=$prefixes PD_KVAWARE_NODE_ARGS='${PD_KVAWARE_NODE_ARGS:-}' tools/bench-kvaware.sh build\`. Machine: $(nproc) cores. Demo model, every node --threads 1${PD_KVAWARE_NODE_ARGS:+ $PD_KVAWARE_NODE_ARGS}"
  echo "(4 processes on the cores), pull over ucx, KV cache events on every node, each run on freshly started nodes."
  echo "$n requests at $rate req/s (Poisson; arrivals and prompts from each seed), --ignore-eos, goodput SLO \`$slo\` (ms). shared = prefix-repetition:"
  echo "$prefixes prefixes of 512 tokens + 32-token suffixes, 16 output tokens; fresh = random 544-token prompts, 16 output."
  echo
  "$bin/pd-bench" table "${files[@]}"
  echo
  echo "| prompts | policy | seed | KV read by the decodes (MiB) |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "Plots: bench/plots/kvaware/."
} >>"$results"
"$bin/pd-bench" plot bench/plots/kvaware "${files[@]}" || true
echo "bench-kvaware: results appended to $results"
