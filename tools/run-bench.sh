#!/usr/bin/env bash
# tools/run-bench.sh BUILD_DIR — the benchmark suite (`make bench`; not part of `make check`).
# Each benchmark prints its table and appends it, with the command, machine and date, to
# bench/RESULTS.md. Baselines (memcpy, BLAS peak, rooflines) are measured in the same run.
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
models="$build/models"
mkdir -p "$models"
if [[ ! -f "$models/demo/config.json" ]]; then
  echo "run-bench: generating the demo model in $models/demo"
  "$build/bin/pd-mkmodel" --preset demo --out "$models/demo"
fi
echo "run-bench: pd-bench-ops (memcpy, paged attention, matmul, model decode)"
"$build/bin/pd-bench-ops" --model "$models/demo" --results bench/RESULTS.md
if [[ ! -f "$models/llama-565m/config.json" ]]; then
  echo "run-bench: generating a 565 M-parameter Llama-shaped bf16 model (weights >> LLC) in $models/llama-565m"
  "$build/bin/pd-mkmodel" --preset demo --hidden 1536 --layers 16 --heads 12 --kv-heads 4 --intermediate 5632 \
    --vocab 16000 --dtype bf16 --out "$models/llama-565m"
fi
echo "run-bench: pd-bench-ops model decode of the 565 M model (fp32, bf16, int8 weights)"
"$build/bin/pd-bench-ops" --model "$models/llama-565m" --model-only --results bench/RESULTS.md
echo "run-bench: bench/llamacpp-baseline.sh (llama.cpp on the same weights, the demo and the 565 M model)"
PD_BUILD="$build" bench/llamacpp-baseline.sh "$models/demo" --results bench/RESULTS.md
PD_BUILD="$build" bench/llamacpp-baseline.sh "$models/llama-565m" --results bench/RESULTS.md
echo "run-bench: tools/bench-http-path.sh (single-stream decode through HTTP vs in process, context switches per token)"
PD_HTTP_RESULTS=bench/RESULTS.md tools/bench-http-path.sh "$build" 3
echo "run-bench: tools/bench-dtype.sh (pd-serve with fp32 vs bf16 weights under load)"
tools/bench-dtype.sh "$build"
echo "run-bench: tools/bench-spec.sh (speculative decoding with n-gram drafts vs none)"
tools/bench-spec.sh "$build"
echo "run-bench: tools/bench-quality.py (the trained demo model: perplexity per dtype, speculation on held-out text)"
/usr/bin/python3 tools/bench-quality.py "$build"
echo "run-bench: pd-bench-sched (scheduler step overhead, block pool)"
"$build/bin/pd-bench-sched" --results bench/RESULTS.md
echo "run-bench: pd-bench-transfer (pipe throughput and round trip vs memcpy, ucx_perftest, a plain socket)"
"$build/bin/pd-bench-transfer" --results bench/RESULTS.md
echo "run-bench: tools/bench-pd.sh (handover overhead; 1P1D vs colocated sweep)"
tools/bench-pd.sh "$build"
echo "run-bench: tools/bench-kvaware.sh (proxy policies on 2P+2D: round-robin, prefix-affinity, kv-aware)"
tools/bench-kvaware.sh "$build"
echo "run-bench: tools/bench-conditional.sh (mixed workload: always disaggregate vs conditional vs colocated)"
tools/bench-conditional.sh "$build"
echo "run-bench: tools/bench-offload.sh (KV offload tier none vs host vs disk, multi-turn, pool 1/4 of the KV)"
tools/bench-offload.sh "$build"
echo "run-bench: tools/bench-tier-load.sh (what a cold or warm tier load costs the running streams: loads inline vs on the loader thread)"
tools/bench-tier-load.sh "$build"
echo "run-bench: tools/bench-p2p.sh (peer-to-peer prefix fetch off vs on, multi-turn, 2P+2D, round-robin and kv-aware)"
tools/bench-p2p.sh "$build"
echo "run-bench: tools/bench-prefill-cost.sh (a node's estimate of a prompt's compute: the fitted prefill cost vs a tokens/s rate)"
tools/bench-prefill-cost.sh "$build"
echo "run-bench: tools/bench-structured.sh (structured outputs at scale: validity and throughput, pd-serve and 1P1D)"
tools/bench-structured.sh "$build"
echo "run-bench: results appended to bench/RESULTS.md"
