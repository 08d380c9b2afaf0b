#!/usr/bin/env bash
# tools/bench-p2p.sh BUILD_DIR — peer-to-peer prefix fetch (pd-proxy --pd-prefix-fetch-min-blocks) on
# 2 prefills + 2 decodes (pull over ucx, the demo model, every node publishing its KV cache events):
# pd-bench --dataset-name multi-turn through pd-proxy, routing round-robin (a conversation's turns go
# to either prefill) and kv-aware, each with the fetch off and on, each on freshly started nodes.
# Per run: TTFT p50/p99 of the turns >= 2, TPOT p50, the prompt tokens the prefills computed
# (vllm:prompt_tokens_total - vllm:prefix_cache_hits_total - the tokens they read from peers), the
# proxy's lends, and the prefills' reads from peers (bytes / seconds while pages moved) against the
# same run's baseline: the decodes' reads from the prefills over the same pipe. Appends to
# bench/RESULTS.md. PD_P2P_CONVS (16), PD_P2P_TURNS (4), PD_P2P_SEED (1), PD_P2P_MIN_BLOCKS (2),
# PD_P2P_SYSTEM (512: the shared system prompt's tokens), PD_P2P_USER (256: each message's tokens),
# PD_P2P_MAX_LEN (2048: every node's --max-model-len; the demo model takes up to 8192), PD_P2P_OUT (64:
# each answer's tokens), PD_P2P_BLOCKS (0: every node's --num-blocks-override; 0 = the 1G KV cache),
# PD_P2P_RUNS (routing:min-blocks[:tier] per run, min-blocks 0 = fetch off, tier none|host|disk = every
# node's --kv-offload-tier, 1G each; default "round-robin:0 round-robin:N kv-aware:0 kv-aware:N" with
# N = PD_P2P_MIN_BLOCKS).
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
bin="$build/bin"
models="$build/models"
results=bench/RESULTS.md
source tools/bench-procs.sh
demo_setup p2p
convs=${PD_P2P_CONVS:-16}
turns=${PD_P2P_TURNS:-4}
seed=${PD_P2P_SEED:-1}
minb=${PD_P2P_MIN_BLOCKS:-2}
system=${PD_P2P_SYSTEM:-512}
user=${PD_P2P_USER:-256}
maxlen=${PD_P2P_MAX_LEN:-2048}
out=${PD_P2P_OUT:-64}
blocks=${PD_P2P_BLOCKS:-0}
read -r -a runs <<<"${PD_P2P_RUNS:-round-robin:0 round-robin:$minb kv-aware:0 kv-aware:$minb}"
node=(--model "$models/demo" --served-model-name demo --kv-cache-memory 1G --max-model-len "$maxlen"
      --max-num-batched-tokens 512 --threads 1 --kv-pipe ucx --kv-transfer-mode pull --kv-listen 127.0.0.1:0
      --kv-events-config "$events")
if [[ $blocks != 0 ]]; then node+=(--num-blocks-override "$blocks"); fi
workload=(--dataset-name multi-turn --num-prompts "$convs" --multi-turn-turns "$turns" --multi-turn-system-len "$system"
          --multi-turn-user-len "$user" --random-output-len "$out" --multi-turn-think-time 0.5 --max-concurrency 4
          --temperature 0 --ignore-eos --seed "$seed" --vocab-size "$vocab" --metric-percentiles 50,99 --no-progress)
# the demo model's KV per token, all layers (8 layers × K and V × 2 heads × 64 × bf16)
per_token=$((8 * 2 * 2 * 64 * 2))
sum_metric() { # sum_metric NAME PORT... : a series summed over the nodes
  local name=$1 p; shift
  for p in "$@"; do curl -s "http://127.0.0.1:$p/metrics"; done | awk -v n="$name" '$1 == n {s += $2} END{printf "%.6f", s}'
}
rows=()
tier_args() { # tier_args TIER NAME: a node's offload tier
  if [[ $1 != none ]]; then echo "--kv-offload-tier $1 --kv-offload-size 1G --kv-offload-path $work/$2.kv"; fi
}
for run in "${runs[@]}"; do
  IFS=: read -r policy fetch tier <<<"$run"
  tier=${tier:-none}
  echo "bench-p2p: $policy, prefix fetch min blocks $fetch, tier $tier, $convs conversations × $turns turns"
  rm -f "$work"/*.kv
  # shellcheck disable=SC2046 # tier_args is words
  start p0 pd-prefill "${node[@]}" $(tier_args "$tier" p0); p0=$port
  # shellcheck disable=SC2046
  start p1 pd-prefill "${node[@]}" $(tier_args "$tier" p1); p1=$port
  # shellcheck disable=SC2046
  start d0 pd-decode "${node[@]}" $(tier_args "$tier" d0); d0=$port
  # shellcheck disable=SC2046
  start d1 pd-decode "${node[@]}" $(tier_args "$tier" d1); d1=$port
  start proxy pd-proxy --health-interval 0.5 --policy "$policy" --kv-events --pd-prefix-fetch-min-blocks "$fetch" \
    --prefill "http://127.0.0.1:$p0,http://127.0.0.1:$p1" --decode "http://127.0.0.1:$d0,http://127.0.0.1:$d1"
  x=$port
  f="$work/$policy-$fetch.json"
  "$bin/pd-bench" --base-url "http://127.0.0.1:$x" --wait-ready 60 "${workload[@]}" --save-result \
    --result-filename "$f" --label "$policy fetch $fetch" >"$work/$policy-$fetch.out"
  read -r p50 p99 tpot failed < <(python3 - "$f" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
t = j["later_turns"]
print(round(t["median_ttft_ms"]), round(t["p99_ttft_ms"]), "%.2f" % j["median_tpot_ms"], j["failed"])
EOF
)
  prompt=$(sum_metric 'vllm:prompt_tokens_total{model_name="demo",engine="0"}' "$p0" "$p1")
  hits=$(sum_metric 'vllm:prefix_cache_hits_total{model_name="demo",engine="0"}' "$p0" "$p1")
  pbytes=$(sum_metric pd:kv_transfer_bytes_total "$p0" "$p1")
  ps=$(sum_metric 'pd:kv_transfer_phase_seconds_sum{phase="transfer"}' "$p0" "$p1")
  dbytes=$(sum_metric pd:kv_transfer_bytes_total "$d0" "$d1")
  ds=$(sum_metric 'pd:kv_transfer_phase_seconds_sum{phase="transfer"}' "$d0" "$d1")
  lent=$(sum_metric 'pd_proxy:prefix_fetches_total{result="lent"}' "$x")
  refused=$(sum_metric 'pd_proxy:prefix_fetches_total{result="refused"}' "$x")
  read -r fetched computed fgbs dgbs ratio < <(awk -v pr="$prompt" -v h="$hits" -v pb="$pbytes" -v ps="$ps" \
    -v db="$dbytes" -v ds="$ds" -v pt="$per_token" 'BEGIN{
      f = pb / pt; fg = ps > 0 ? pb / ps / 1e9 : 0; dg = ds > 0 ? db / ds / 1e9 : 0
      printf "%d %d %.2f %.2f %s\n", f, pr - h - f, fg, dg, (fg > 0 && dg > 0 ? sprintf("%.2f", fg / dg) : "-")}')
  rows+=("| $policy | $([[ $fetch == 0 ]] && echo off || echo "on (≥ $fetch blocks)") | $tier | $p50 | $p99 | $tpot | $computed | $fetched | ${lent%.*} / ${refused%.*} | $fgbs | $dgbs | $ratio | $failed |")
  stop_all
done
{
  echo
  echo "### Peer-to-peer prefix fetch: multi-turn on 2 prefills + 2 decodes ($(date -u +%Y-%m-%d))"
  echo
  echo "\`PD_P2P_RUNS='${runs[*]}' PD_P2P_CONVS=$convs PD_P2P_TURNS=$turns PD_P2P_SYSTEM=$system PD_P2P_USER=$user PD_P2P_OUT=$out PD_P2P_BLOCKS=$blocks PD_P2P_MAX_LEN=$maxlen tools/bench-p2p.sh $build\` — demo model (8 layers, bf16 KV, 4 KiB per token), every node --threads 1"
  echo "(4 nodes, the proxy and pd-bench on $(nproc) cores: $(lscpu | sed -n 's/^Model name: *//p')), pull over ucx, KV events on"
  echo "every node, fresh nodes per run. $convs conversations × $turns turns ($system-token shared system prompt,"
  echo "$user-token messages, $out-token answers, 0.5 s think time, 4 in flight), greedy; KV blocks per node: $([[ $blocks == 0 ]] && echo "1G" || echo "$blocks"); tier: each node's --kv-offload-tier (1G). Prefill tokens computed ="
  echo "the prefills' prompt tokens − their prefix-cache hits − the tokens they read from peers. Read GB/s: the"
  echo "prefills' reads from peers (bytes / seconds while pages moved); baseline: the decodes' reads from the"
  echo "prefills over the same pipe in the same run."
  echo
  echo "| routing | prefix fetch | tier | TTFT p50 turns≥2 (ms) | TTFT p99 turns≥2 (ms) | TPOT p50 (ms) | prefill tokens computed | tokens read from peers | lends ok / refused | peer read GB/s | decode read GB/s (baseline) | ratio | failed |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee -a "$results"
