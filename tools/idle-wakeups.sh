#!/usr/bin/env bash
# tools/idle-wakeups.sh BUILD_DIR [PIPE] — how often an idle pd-prefill's threads wake: the demo
# model, no peer, no request; voluntary context switches of all its threads over 5 s, after 6 s of
# start-up. A loop that polls when it has nothing to do shows here (issue 46: the KV control loop
# sleeps to its nearest deadline). Loopback only; stops what it started.
set -euo pipefail
build=${1:-build}
pipe=${2:-tcp}
model="$build/models/demo"
[[ -f "$model/config.json" ]] || "$build/bin/pd-mkmodel" --preset demo --out "$model"
log=$(mktemp /tmp/pd-idle-XXXXXX.log)
"$build/bin/pd-prefill" --model "$model" --port 0 --kv-listen 127.0.0.1:0 --insecure-no-kv-auth \
  --kv-pipe "$pipe" --threads 1 --kv-cache-memory 1G >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true; rm -f "$log"' EXIT
sleep 6
switches() {
  local s=0 v t
  for t in /proc/$pid/task/*; do
    v=$(awk '/^voluntary_ctxt_switches/{print $2}' "$t/status" 2>/dev/null || echo 0)
    s=$((s + v))
  done
  echo "$s"
}
a=$(switches)
sleep 5
b=$(switches)
echo "idle pd-prefill ($pipe pipe): $(((b - a) / 5)) wake-ups/s over $(ls /proc/$pid/task | wc -l) threads"
