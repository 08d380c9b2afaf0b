#!/usr/bin/env bash
# tools/bench-spec.sh BUILD_DIR — speculative decoding (issue 23): pd-serve on the demo model with
# and without --speculative-config (n-gram, 4 draft tokens, n-grams of 2..4), under pd-bench at
# concurrency 1 and 4, on a workload where the lookup has something to find (repeat: prompts that
# are a phrase repeated, which the output goes on repeating) and on ones where it has little or
# nothing (random prompts greedy; random prompts at temperature 1). The acceptance comes from the
# server's vllm:spec_decode_* counters. Appends the table to bench/RESULTS.md.
# PD_SPEC_PROMPTS sets the requests per point (default 24).
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
bin="$build/bin"
models="$build/models"
results=bench/RESULTS.md
prompts=${PD_SPEC_PROMPTS:-24}
spec='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
if [[ ! -f "$models/demo/config.json" ]]; then
  "$bin/pd-mkmodel" --preset demo --out "$models/demo"
fi
work=$(mktemp -d /tmp/pd-bench-spec-XXXXXX)
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
counter() { # counter PORT NAME: a vllm:spec_decode counter's value (0 when absent)
  curl -sf "http://127.0.0.1:$1/metrics" | awk -v n="$2" '$1 ~ "^"n"[{ ]" || $1 == n {v += $2} END {print v + 0}'
}

declare -A tpot tput acc
workloads=("repeat 0" "random 0" "random 1")
for config in off ngram; do
  rm -f "$work/port"
  args=()
  [[ $config == ngram ]] && args=(--speculative-config "$spec")
  "$bin/pd-serve" --model "$models/demo" --served-model-name demo --threads 2 --kv-cache-memory 2G \
    --max-model-len 4096 --port 0 --port-file "$work/port" "${args[@]}" >"$work/serve-$config.log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do [[ -s "$work/port" ]] && break; kill -0 "$pid" || { cat "$work/serve-$config.log"; exit 1; }; sleep 0.2; done
  port=$(cat "$work/port")
  for w in "${workloads[@]}"; do
    read -r data temp <<<"$w"
    for conc in 1 4; do
      key="$data-t$temp-c$conc"
      out="$work/$config-$key.json"
      echo "bench-spec: speculation $config, $data prompts, temperature $temp, concurrency $conc" >&2
      d0=$(counter "$port" vllm:spec_decode_num_draft_tokens_total)
      a0=$(counter "$port" vllm:spec_decode_num_accepted_tokens_total)
      "$bin/pd-bench" --base-url "http://127.0.0.1:$port" --dataset-name "$data" --random-input-len 256 \
        --random-output-len 128 --repeat-phrase-len 8 --temperature "$temp" --num-prompts "$prompts" \
        --num-warmups 4 --seed 7 --max-concurrency "$conc" --ignore-eos --no-progress --save-result \
        --result-filename "$out" --label "$config $key" --wait-ready 60 >/dev/null
      d1=$(counter "$port" vllm:spec_decode_num_draft_tokens_total)
      a1=$(counter "$port" vllm:spec_decode_num_accepted_tokens_total)
      read -r tpot[$config-$key] tput[$config-$key] < <(python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
print("%.2f %.1f" % (r["median_tpot_ms"], r["output_throughput"]))' "$out")
      acc[$config-$key]=$(python3 -c 'import sys; d, a = float(sys.argv[1]), float(sys.argv[2]); print("%.0f%% of %.0f" % (100 * a / d, d) if d else "-")' "$((d1 - d0))" "$((a1 - a0))")
    done
  done
  stop
done
rows=()
for w in "${workloads[@]}"; do
  read -r data temp <<<"$w"
  for conc in 1 4; do
    key="$data-t$temp-c$conc"
    rows+=("$(python3 -c '
import sys
a, b = sys.argv[3:5]
t0, t1, o0, o1 = map(float, sys.argv[5:9])
print("| %s | %s | %s | %.2f | %.2f | %.2f× | %.1f | %.1f | %.2f× | %s |" % (sys.argv[1], sys.argv[2], a, t0, t1, t0 / t1, o0, o1, o1 / o0, b))
' "$data" "$temp" "$conc" "${acc[ngram-$key]}" "${tpot[off-$key]}" "${tpot[ngram-$key]}" "${tput[off-$key]}" "${tput[ngram-$key]}")")
  done
done
{
  echo
  echo "## Speculative decoding, n-gram drafts (issue 23) — $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo "Command: \`tools/bench-spec.sh $build\`. Machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)."
  echo "pd-serve --threads 2 on the demo model (bf16), without and with \`--speculative-config '$spec'\`;"
  echo "256-token prompts, 128 output tokens (ignore_eos), $prompts requests per point (+4 warmups), seed 7."
  echo "repeat: a random 8-token phrase repeated; random: vLLM's random ids. Baseline: the same server"
  echo "without speculation, same run. TPOT ratio > 1 and throughput ratio > 1 mean speculation helps."
  echo
  echo "| prompts | temperature | concurrency | TPOT p50 off (ms) | TPOT p50 ngram (ms) | TPOT off/ngram | out tok/s off | out tok/s ngram | ngram/off | drafts accepted |"
  echo "|---|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} >>"$results"
tail -n $(( ${#rows[@]} + 9 )) "$results"
