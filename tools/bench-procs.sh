# tools/bench-procs.sh — sourced by the benchmark scripts that start servers (bench-pd.sh, bench-serve-ab.sh,
# bench-kvaware.sh, bench-conditional.sh), after they set $bin, $models and cd to the repository:
#   demo_setup TAG          the demo model in $models (made once; its vocabulary size in $vocab),
#                           a work directory $work removed with every server on exit, and $events
#                           (KV cache events on free loopback ports)
#   start NAME BINARY ARGS  runs "$bin/BINARY" on a free loopback port, its log in $work/NAME.log
#                           (pd-prefill and pd-decode with the cluster token $work/cluster-token);
#                           sets $port
#   stop_all                stops (TERM, then KILL after 10 s) every server started so far
#   kv_read_mib PORT...     the KV the nodes on these ports read (pd:kv_transfer_bytes_total), MiB
pids=()
stop_all() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  pids=()
}

start() {
  local name=$1 exe=$2; shift 2
  rm -f "$work/$name.port"
  local token=()
  if [[ $exe == pd-prefill || $exe == pd-decode ]]; then token=(--cluster-token-file "$work/cluster-token"); fi
  "$bin/$exe" "$@" "${token[@]}" --port 0 --port-file "$work/$name.port" >"$work/$name.log" 2>&1 &
  local pid=$!
  pids+=("$pid")
  for _ in $(seq 600); do
    if [[ -s "$work/$name.port" ]]; then port=$(cat "$work/$name.port"); return 0; fi
    if ! kill -0 "$pid" 2>/dev/null; then echo "$(basename "$0"): $name died:" >&2; cat "$work/$name.log" >&2; exit 1; fi
    sleep 0.2
  done
  echo "$(basename "$0"): $name did not start" >&2; exit 1
}

kv_read_mib() {
  local p
  for p in "$@"; do curl -s "http://127.0.0.1:$p/metrics"; done |
    awk '/^pd:kv_transfer_bytes_total /{b += $2} END{printf "%.1f", b / 1048576}'
}

demo_setup() {
  mkdir -p "$models"
  if [[ ! -f "$models/demo/config.json" ]]; then
    "$bin/pd-mkmodel" --preset demo --out "$models/demo"
  fi
  # pd-bench's random prompts (vLLM's) are runs of consecutive ids from a random offset, modulo the
  # vocabulary: over its default of 256 ids, 1 pair in ~500 is the same prompt
  vocab=$(sed -n 's/.*"vocab_size": *\([0-9]*\).*/\1/p' "$models/demo/config.json")
  work=$(mktemp -d "/tmp/pd-$1-XXXXXX")
  trap 'stop_all; rm -rf "$work"' EXIT
  head -c 32 /dev/urandom | base64 >"$work/cluster-token" # the nodes' shared secret
  events='{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"}'
}
