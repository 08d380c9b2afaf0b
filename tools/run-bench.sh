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
echo "run-bench: pd-bench-sched (scheduler step overhead, block pool)"
"$build/bin/pd-bench-sched" --results bench/RESULTS.md
echo "run-bench: pd-bench-transfer (pipe throughput and round trip vs memcpy, ucx_perftest, a plain socket)"
"$build/bin/pd-bench-transfer" --results bench/RESULTS.md
echo "run-bench: tools/bench-pd.sh (handover overhead; 1P1D vs colocated sweep)"
tools/bench-pd.sh "$build"
echo "run-bench: results appended to bench/RESULTS.md"
