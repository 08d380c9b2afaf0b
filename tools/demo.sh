#!/usr/bin/env bash
# tools/demo.sh BUILD_DIR — `make demo`: a disaggregated deployment on loopback.
# Generates the demo model (random weights: the text is noise, the system around it is real),
# starts 1 pd-prefill + 1 pd-decode (KV over the ucx pipe) + pd-proxy on free ports, drives
# load through the proxy with pd-bench for about 30 s, prints the report, stops everything.
# Environment: PD_DEMO_MODE=pull|push, PD_DEMO_PIPE=ucx|tcp, PD_DEMO_PROMPTS, PD_DEMO_RATE.
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
bin="$build/bin"
mode=${PD_DEMO_MODE:-pull}
pipe=${PD_DEMO_PIPE:-ucx}
prompts=${PD_DEMO_PROMPTS:-48}
rate=${PD_DEMO_RATE:-1.6}
models="$build/models"
mkdir -p "$models"
if [[ ! -f "$models/demo/config.json" ]]; then
  echo "demo: generating the demo model (random weights) in $models/demo"
  "$bin/pd-mkmodel" --preset demo --out "$models/demo"
fi
work=$(mktemp -d /tmp/pd-demo-XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT

# Waits for a port file; prints the port. Fails if the process died.
wait_port() {
  local file=$1 pid=$2 name=$3
  for _ in $(seq 600); do
    if [[ -s "$file" ]]; then cat "$file"; return 0; fi
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "demo: $name exited; its log:" >&2; cat "$work/$name.log" >&2; return 1
    fi
    sleep 0.2
  done
  echo "demo: $name did not start within 120 s" >&2; return 1
}

common=(--model "$models/demo" --served-model-name demo --kv-cache-memory 2G --threads 1
        --max-model-len 1024 --kv-pipe "$pipe" --kv-transfer-mode "$mode" --kv-listen 127.0.0.1:0)
echo "demo: starting pd-prefill and pd-decode ($mode mode, $pipe pipe), logs in $work"
"$bin/pd-prefill" "${common[@]}" --port 0 --port-file "$work/prefill.port" >"$work/prefill.log" 2>&1 &
pids+=($!); ppid=$!
"$bin/pd-decode" "${common[@]}" --port 0 --port-file "$work/decode.port" >"$work/decode.log" 2>&1 &
pids+=($!); dpid=$!
pport=$(wait_port "$work/prefill.port" "$ppid" prefill)
dport=$(wait_port "$work/decode.port" "$dpid" decode)
"$bin/pd-proxy" --port 0 --port-file "$work/proxy.port" --health-interval 0.5 \
  --prefill "http://127.0.0.1:$pport" --decode "http://127.0.0.1:$dport" >"$work/proxy.log" 2>&1 &
pids+=($!); xpid=$!
xport=$(wait_port "$work/proxy.port" "$xpid" proxy)
echo "demo: waiting for both nodes to pre-fault their KV regions (--kv-prefault, a background thread)"
for _ in $(seq 600); do
  grep -q "pre-faulted" "$work/prefill.log" && grep -q "pre-faulted" "$work/decode.log" && break
  sleep 0.2
done
echo "demo: prefill :$pport, decode :$dport, proxy http://127.0.0.1:$xport"
echo "demo: $prompts requests (256-token prompts, 32 output tokens) at $rate req/s through the proxy"
"$bin/pd-bench" --base-url "http://127.0.0.1:$xport" --wait-ready 60 --dataset-name random \
  --random-input-len 256 --random-output-len 32 --random-range-ratio 0.25 --num-prompts "$prompts" \
  --request-rate "$rate" --ignore-eos --num-warmups 2 --metric-percentiles 50,90,99 \
  --kv-metrics-url "http://127.0.0.1:$dport" --save-result --result-filename "$work/result.json"
echo "demo: stopping"
