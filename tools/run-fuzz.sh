#!/usr/bin/env bash
# tools/run-fuzz.sh [SECONDS] — `make fuzz`: builds the tests/fuzz targets with clang's libFuzzer
# (+ ASan/UBSan, coverage on every library) in build-fuzz/ and runs each for SECONDS (default 60)
# from its committed corpus (tests/fuzz/corpus/<target>); what it learns goes to
# build-fuzz/corpus/<target>, a crashing input to build-fuzz/crash-<target>-*. Prints executions,
# coverage and the outcome per target; exits 1 if any target crashed. Fix the bug, then add the input
# to tests/fuzz/corpus/<target>/ (every `make check` replays it). FUZZ_TARGETS="a b" runs only those.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
targets=(control tokenizer template safetensors config openai tcp_frames tcp_replies grammar tool_calls)
if [[ -n "${FUZZ_TARGETS:-}" ]]; then
  read -r -a targets <<<"$FUZZ_TARGETS" # e.g. FUZZ_TARGETS="openai tcp_frames"
fi
if ! command -v clang >/dev/null || ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
  echo "run-fuzz: installing clang (libFuzzer)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang >/dev/null
fi
cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DSAN=address,undefined -DPD_FUZZ=ON -DPD_CUDA=OFF >/dev/null
cmake --build build-fuzz -j "$(nproc)" --target "${targets[@]/#/fuzz_}" >/dev/null
status=0
printf '%-12s %12s %8s %10s  %s\n' target executions exec/s coverage outcome
for t in "${targets[@]}"; do
  mkdir -p "build-fuzz/corpus/$t"
  log="build-fuzz/fuzz-$t.log"
  set +e
  ASAN_OPTIONS=detect_leaks=1 "build-fuzz/bin/fuzz_$t" -max_total_time="$secs" -print_final_stats=1 \
    -artifact_prefix="build-fuzz/crash-$t-" -rss_limit_mb=2048 -timeout=10 \
    "build-fuzz/corpus/$t" "tests/fuzz/corpus/$t" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo 0)
  outcome=ok
  if [[ $rc -ne 0 ]]; then
    outcome="CRASH (see $log, build-fuzz/crash-$t-*)"
    status=1
  fi
  printf '%-12s %12s %8s %10s  %s\n' "$t" "$execs" "$rate" "$cov" "$outcome"
done
exit $status
