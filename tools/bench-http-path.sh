#!/usr/bin/env bash
# tools/bench-http-path.sh [BUILD_DIR] [ROUNDS] — what the HTTP serving path costs per token (issue
# 53): single-stream decode through pd-serve + pd-bench against the same engine in process
# (pd-bench-ops --model-only), same weights, same threads, alternated ROUNDS times (default 3) so
# the VM's drift falls on both alike; the best of each is compared. Per HTTP run it also counts
# the context switches of all pd-serve's threads per generated token (voluntary: a thread slept and
# was woken; involuntary: a thread was preempted, on 2 cores mostly a compute thread by the HTTP
# loop or the client). Two HTTP rates: the decode rate, 1 / mean TPOT (the time per output token
# after the first, as vLLM's bench defines it), which is what the in-process row measures (64
# decode steps after a prompt that is not timed); and the output throughput (tokens / wall time),
# which also carries each request's prefill and connection, a few per cent at 128 output tokens.
# Models: the demo (64 prompt tokens, 128 out, 16 requests) and the 565 M
# model (64 in, 64 out, 3 requests), made in BUILD_DIR/models if missing. --threads 2 on both
# sides; the client shares the 2 cores, as in every test here. PD_HTTP_MODELS picks models
# (default "demo llama-565m"); PD_HTTP_SERVE_ARGS adds pd-serve flags (e.g. --no-direct-stream, the
# HTTP loop writing every chunk, for an A/B run); PD_HTTP_RESULTS=FILE appends the lines to FILE (bench/RESULTS.md)
# with the command, machine and date. Loopback only; stops every server it started.
set -euo pipefail
build=$(realpath "${1:-build}")
rounds=${2:-3}
cd "$(dirname "$0")/.."
bin=$build/bin
models=$build/models
source tools/bench-procs.sh
demo_setup bench-http
if [[ ! -f "$models/llama-565m/config.json" ]]; then # tools/bench-isa.sh's shape
  "$bin/pd-mkmodel" --preset demo --hidden 1536 --layers 16 --heads 12 --kv-heads 4 --intermediate 5632 \
    --vocab 16000 --dtype bf16 --out "$models/llama-565m" >/dev/null
fi

switches() { # voluntary and involuntary context switches of every thread of process $1
  cat /proc/"$1"/task/*/status 2>/dev/null | awk '/^voluntary_ctxt/{v += $2} /^nonvoluntary_ctxt/{n += $2} END{print v, n}'
}

lines=$(mktemp /tmp/pd-http-path-XXXXXX.txt)
exec > >(tee "$lines")
echo "bench-http-path: $build, $rounds rounds, --threads 2, $(nproc) CPUs${PD_HTTP_SERVE_ARGS:+, pd-serve $PD_HTTP_SERVE_ARGS}"
for model in ${PD_HTTP_MODELS:-demo llama-565m}; do
  if [[ $model == demo ]]; then out=128 num=16; else out=64 num=3; fi
  best_ops=0 best_http=0 best_dec=0
  for round in $(seq "$rounds"); do
    ops=$("$bin/pd-bench-ops" --model "$models/$model" --model-only --weights auto --batch 1 --threads 2 2>/dev/null |
      awk '/^model decode/{for (i = 1; i < NF; i++) if ($(i + 1) == "tok/s") { print $i; exit }}')
    # shellcheck disable=SC2086 # PD_HTTP_SERVE_ARGS: more pd-serve flags, split on spaces (an A/B run)
    start serve pd-serve --model "$models/$model" --served-model-name "$model" --threads 2 --kv-cache-memory 4G \
      ${PD_HTTP_SERVE_ARGS:-}
    pid=${pids[-1]}
    "$bin/pd-bench" --base-url "http://127.0.0.1:$port" --max-concurrency 1 --num-prompts 2 --random-input-len 64 \
      --random-output-len 8 --ignore-eos --no-progress --wait-ready 300 >/dev/null 2>"$work/bench.log" ||
      { cat "$work/bench.log" >&2; exit 1; }
    read -r v0 n0 < <(switches "$pid")
    "$bin/pd-bench" --base-url "http://127.0.0.1:$port" --max-concurrency 1 --num-prompts "$num" \
      --random-input-len 64 --random-output-len "$out" --ignore-eos --no-progress --seed "$round" \
      --save-result --result-filename "$work/r.json" >/dev/null 2>"$work/bench.log" ||
      { cat "$work/bench.log" >&2; exit 1; }
    read -r v1 n1 < <(switches "$pid")
    stop_all
    read -r http decode tokens < <(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r["output_throughput"], 1e3 / r["mean_tpot_ms"], r["total_output_tokens"])' "$work/r.json")
    python3 - "$model" "$round" "$ops" "$http" "$decode" "$tokens" "$v0" "$n0" "$v1" "$n1" <<'PY'
import sys
m, r, ops, http, dec, tok, v0, n0, v1, n1 = sys.argv[1:]
ops, http, dec, tok = float(ops), float(http), float(dec), int(tok)
print("%s r%s: in-process %.1f tok/s; HTTP decode (1/TPOT) %.1f tok/s (%.2fx, %.0f us/token more), HTTP "
      "output throughput %.1f tok/s (%.2fx); context switches per token: %.2f voluntary, %.2f involuntary"
      % (m, r, ops, dec, dec / ops, 1e6 / dec - 1e6 / ops, http, http / ops, (int(v1) - int(v0)) / tok,
         (int(n1) - int(n0)) / tok))
PY
    best_ops=$(python3 -c "print(max($best_ops, $ops))")
    best_http=$(python3 -c "print(max($best_http, $http))")
    best_dec=$(python3 -c "print(max($best_dec, $decode))")
  done
  python3 -c "print('%s best of $rounds: in-process %.1f tok/s; HTTP decode %.1f tok/s: %.2fx; HTTP output throughput %.1f tok/s: %.2fx' % ('$model', $best_ops, $best_dec, $best_dec / $best_ops, $best_http, $best_http / $best_ops))"
done
if [[ -n "${PD_HTTP_RESULTS:-}" ]]; then
  exec >&- # the tee finishes writing $lines
  sleep 0.2
  {
    echo
    echo "## tools/bench-http-path.sh — $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "Command: \`${PD_HTTP_SERVE_ARGS:+PD_HTTP_SERVE_ARGS=\"$PD_HTTP_SERVE_ARGS\" }tools/bench-http-path.sh $build $rounds\`. Machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'). Single-stream decode through pd-serve + pd-bench against pd-bench-ops --model-only in process, alternated; context switches of all pd-serve's threads per generated token."
    echo
    sed "s/^/    /" "$lines"
  } >>"$PD_HTTP_RESULTS"
fi
rm -f "$lines"
