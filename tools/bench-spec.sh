#!/usr/bin/env bash
# tools/bench-spec.sh BUILD_DIR — speculative decoding (issue 23): pd-serve on the demo model with
# and without --speculative-config (n-gram, 4 draft tokens, n-grams of 2..4; and a draft model: the
# demo model cut after 2 of its 8 layers, an early-exit draft, 3 draft tokens; and n-gram with
# disable_by_batch_size 4), under pd-bench at
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
mkdir "$work/draft" && cp -r "$models/demo/." "$work/draft/" # the early-exit draft: 2 of 8 layers
sed -i 's/"num_hidden_layers": *[0-9]*/"num_hidden_layers": 2/' "$work/draft/config.json"
draft="{\"method\": \"draft_model\", \"model\": \"$work/draft\", \"num_speculative_tokens\": 3}"
capped='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4, "disable_by_batch_size": 4}'
configs=(off ngram ngram-cap4 draft)
declare -A pid port
stop_all() {
  for c in "${configs[@]}"; do
    [[ -n "${pid[$c]:-}" ]] && kill -TERM "${pid[$c]}" 2>/dev/null || true
  done
  for c in "${configs[@]}"; do
    [[ -n "${pid[$c]:-}" ]] && wait "${pid[$c]}" 2>/dev/null || true
  done
}
trap 'stop_all; rm -rf "$work"' EXIT
counter() { # counter PORT NAME: a vllm:spec_decode counter's value (0 when absent)
  curl -sf "http://127.0.0.1:$1/metrics" | awk -v n="$2" '$1 ~ "^"n"[{ ]" || $1 == n {v += $2} END {print v + 0}'
}

# the servers stay up (an idle one takes no CPU) and each point runs them back to back, in two
# rounds of alternating order, so that the VM's drift falls on all of them alike
for c in "${configs[@]}"; do
  args=()
  [[ $c == ngram ]] && args=(--speculative-config "$spec")
  [[ $c == ngram-cap4 ]] && args=(--speculative-config "$capped")
  [[ $c == draft ]] && args=(--speculative-config "$draft")
  "$bin/pd-serve" --model "$models/demo" --served-model-name demo --threads 2 --kv-cache-memory 2G \
    --max-model-len 4096 --port 0 --port-file "$work/port-$c" "${args[@]}" >"$work/serve-$c.log" 2>&1 &
  pid[$c]=$!
done
for c in "${configs[@]}"; do
  for _ in $(seq 300); do [[ -s "$work/port-$c" ]] && break; kill -0 "${pid[$c]}" || { cat "$work/serve-$c.log"; exit 1; }; sleep 0.2; done
  port[$c]=$(cat "$work/port-$c")
done

declare -A tpot tput acc gaps
workloads=("repeat 0" "random 0" "random 1")
for round in 1 2; do
  order=("${configs[@]}")
  [[ $round == 2 ]] && order=(draft ngram-cap4 ngram off)
  for w in "${workloads[@]}"; do
    read -r data temp <<<"$w"
    for conc in 1 4; do
      key="$data-t$temp-c$conc"
      for config in "${order[@]}"; do
        p=${port[$config]}
        out="$work/$config-$key-$round.json"
        echo "bench-spec: round $round, speculation $config, $data prompts, temperature $temp, concurrency $conc" >&2
        d0=$(counter "$p" vllm:spec_decode_num_draft_tokens_total)
        a0=$(counter "$p" vllm:spec_decode_num_accepted_tokens_total)
        "$bin/pd-bench" --base-url "http://127.0.0.1:$p" --dataset-name "$data" --random-input-len 256 \
          --random-output-len 128 --repeat-phrase-len 8 --temperature "$temp" --num-prompts "$prompts" \
          --num-warmups 4 --seed 7 --max-concurrency "$conc" --ignore-eos --no-progress --save-result \
          --result-filename "$out" --label "$config $key r$round" --wait-ready 60 >/dev/null
        d1=$(counter "$p" vllm:spec_decode_num_draft_tokens_total)
        a1=$(counter "$p" vllm:spec_decode_num_accepted_tokens_total)
        read -r t o < <(python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
print("%.3f %.2f" % (r["median_tpot_ms"], r["output_throughput"]))' "$out")
        # the mean of the two rounds
        tpot[$config-$key]=$(python3 -c 'import sys; print("%.3f" % (float(sys.argv[1]) + float(sys.argv[2]) / 2))' "${tpot[$config-$key]:-0}" "$t")
        tput[$config-$key]=$(python3 -c 'import sys; print("%.2f" % (float(sys.argv[1]) + float(sys.argv[2]) / 2))' "${tput[$config-$key]:-0}" "$o")
        acc[$config-$key]=$(python3 -c 'import sys; d, a = float(sys.argv[1]), float(sys.argv[2]); print("%.0f%% of %.0f" % (100 * a / d, d) if d else "-")' "$((d1 - d0))" "$((a1 - a0))")
      done
    done
  done
done
for config in off draft; do # the draft's catch-up over a prompt: TTFT and the first two gaps
  gaps[$config]=$(python3 - "${port[$config]}" <<'PY'
import http.client, json, random, sys, time
port = int(sys.argv[1])
def gaps(prompt):
    c = http.client.HTTPConnection("127.0.0.1", port)
    body = json.dumps({"model": "demo", "prompt": prompt, "max_tokens": 3, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    t0 = time.time()
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r, ts = c.getresponse(), []
    for line in iter(r.readline, b""):
        if line.startswith(b"data: {"):
            ts.append(time.time())
    return ts[0] - t0, ts[1] - ts[0], ts[2] - ts[1]
random.seed(3)
out = []
for n in (512, 2048):
    rs = [gaps([random.randrange(3, 2000) for _ in range(n)]) for _ in range(3)]
    out.append("%d|%s" % (n, "|".join("%.1f" % (1000 * sorted(x[i] for x in rs)[1]) for i in range(3))))
print(" ".join(out))
PY
)
done
stop_all
rows=()
for w in "${workloads[@]}"; do
  read -r data temp <<<"$w"
  for conc in 1 4; do
    key="$data-t$temp-c$conc"
    for config in ngram ngram-cap4 draft; do
      rows+=("$(python3 -c '
import sys
a, b = sys.argv[3:5]
t0, t1, o0, o1 = map(float, sys.argv[6:10])
print("| %s | %s | %s | %s | %.2f | %.2f | %.2f× | %.1f | %.1f | %.2f× | %s |" % (sys.argv[1], sys.argv[2], a, sys.argv[5], t0, t1, t0 / t1, o0, o1, o1 / o0, b))
' "$data" "$temp" "$conc" "${acc[$config-$key]}" "$config" "${tpot[off-$key]}" "${tpot[$config-$key]}" "${tput[off-$key]}" "${tput[$config-$key]}")")
    done
  done
done
{
  echo
  echo "## Speculative decoding, n-gram drafts (issue 23) — $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo
  echo "Command: \`tools/bench-spec.sh $build\`. Machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)."
  echo "pd-serve --threads 2 on the demo model (bf16), without and with \`--speculative-config '$spec'\`"
  echo "(ngram), the same with \"disable_by_batch_size\": 4 (ngram-cap4: no drafts while 4 requests run)"
  echo "or a draft model, the demo model cut after 2 of its 8 layers, 3 draft tokens (draft);"
  echo "256-token prompts, 128 output tokens (ignore_eos), $prompts requests per point (+4 warmups), seed 7;"
  echo "the four servers run side by side, each point back to back on all four, two rounds in"
  echo "alternating order, the mean of the rounds shown (acceptance: the second round's)."
  echo "repeat: a random 8-token phrase repeated; random: vLLM's random ids. Baseline: the same server"
  echo "without speculation, same run. TPOT off/on > 1 and throughput on/off > 1 mean speculation helps."
  echo
  echo "| prompts | temperature | concurrency | method | TPOT p50 off (ms) | TPOT p50 on (ms) | TPOT off/on | out tok/s off | out tok/s on | on/off | drafts accepted |"
  echo "|---|---|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "The draft model computes its own prompt KV (also on a decode node, where only the target's KV"
  echo "arrives), before drafting for the request's second token: one streamed request of random ids,"
  echo "3 tokens, median of 3 (ms):"
  echo
  echo "| prompt tokens | TTFT off | TTFT draft | 1st gap off | 1st gap draft | 2nd gap off | 2nd gap draft |"
  echo "|---|---|---|---|---|---|---|"
  read -r -a a <<<"${gaps[off]}"
  read -r -a b <<<"${gaps[draft]}"
  for i in 0 1; do
    IFS='|' read -r n t0 g0 h0 <<<"${a[$i]}"
    IFS='|' read -r _ t1 g1 h1 <<<"${b[$i]}"
    echo "| $n | $t0 | $t1 | $g0 | $g1 | $h0 | $h1 |"
  done
} >>"$results"
tail -n $(( ${#rows[@]} + 22 )) "$results"
