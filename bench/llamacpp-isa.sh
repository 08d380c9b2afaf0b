#!/usr/bin/env bash
# bench/llamacpp-isa.sh LLAMA_CPP_SRC [BUILD_DIR] [--results FILE] — issue 45: pdserve and llama.cpp at
# the same instruction-set level, on the same weights, on this machine, one run. llama.cpp is built
# from a source checkout (LLAMA_CPP_SRC; GGML_NATIVE=OFF; where GitHub's 1.4 GB repository cannot be
# fetched, the npm package of bench/llamacpp/npm-packages carries one: `npm pack node-llama-cpp@3.22.1`,
# then `git clone package/llama/gitRelease.bundle LLAMA_CPP_SRC`) once per level into
# BUILD_DIR/llamacpp-isa/<level> (llama-bench, llama-quantize), with what a CPU of that level has:
#   avx2     AVX2, FMA, F16C                                  (pdserve: --cpu-isa avx2)
#   avx512   the above + AVX-512 F/BW/DQ/VL and VNNI: a Cascade Lake, no BF16, no AMX
#                                                              (pdserve: --cpu-isa avx512, which uses
#                                                               no VNNI: pdserve's int8 widens to fp32)
# (levels this CPU lacks are skipped, by name). The model (default: the 565 M model of
# tools/bench-isa.sh) goes to GGUF through tools/pd-to-gguf.py at its checkpoint's bf16, and through
# llama-quantize to F32 and Q8_0 (pdserve: --weights auto, float32, int8). Per level and weights, one
# after the other: llama-bench -t 2 (decode: 64 tokens after none, prefill: 512 tokens; 3 repetitions,
# its mean) and pd-bench-ops --model-only (decode batch 1 after a 64-token prompt with its same-run
# read roofline; prefill of 512 tokens, best of 2). Prints the table; --results appends it with the
# command. Threads: PD_THREADS (2).
set -euo pipefail
src=$(realpath "${1:?usage: bench/llamacpp-isa.sh LLAMA_CPP_SRC [BUILD_DIR] [--results FILE]}")
shift
build=build
results=
while [[ $# -gt 0 ]]; do
  case $1 in
    --results) results=${2:?--results FILE}; shift 2 ;;
    *) build=$1; shift ;;
  esac
done
cd "$(dirname "$0")/.."
threads=${PD_THREADS:-2}
model=${PD_MODEL:-$build/models/llama-565m}
out=$build/llamacpp-isa
mkdir -p "$out"
if [[ ! -f "$model/config.json" ]]; then
  echo "llamacpp-isa: generating the 565 M model in $model" >&2
  "$build/bin/pd-mkmodel" --preset demo --hidden 1536 --layers 16 --heads 12 --kv-heads 4 --intermediate 5632 \
    --vocab 16000 --dtype bf16 --out "$model" >/dev/null
fi
flags=$(grep -m1 '^flags' /proc/cpuinfo)
levels=()
[[ $flags == *" avx2 "* && $flags == *" fma "* && $flags == *" f16c "* ]] && levels+=(avx2)
if [[ $flags == *" avx512f "* && $flags == *" avx512bw "* && $flags == *" avx512vl "* &&
      $flags == *" avx512dq "* && $flags == *" avx512_vnni "* ]]; then
  levels+=(avx512)
else
  echo "llamacpp-isa: avx512 not run: this CPU lacks AVX-512 F/BW/DQ/VL or VNNI" >&2
fi
common=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DGGML_OPENMP=ON -DBUILD_SHARED_LIBS=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
  -DGGML_AVX512_BF16=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
for l in "${levels[@]}"; do
  [[ -x $out/$l/bin/llama-bench && -x $out/$l/bin/llama-quantize ]] && continue
  echo "llamacpp-isa: building llama.cpp ($l) in $out/$l" >&2
  lf=(-DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF)
  [[ $l == avx512 ]] && lf=(-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON)
  cmake -S "$src" -B "$out/$l" "${common[@]}" "${lf[@]}" >"$out/$l.cmake.log" 2>&1
  cmake --build "$out/$l" --target llama-bench llama-quantize -j "$(nproc)" >"$out/$l.build.log" 2>&1
done
name=$(basename "$model")
q=$out/${levels[0]}/bin/llama-quantize
[[ -f $out/$name-bf16.gguf ]] || python3 tools/pd-to-gguf.py "$model" "$out/$name-bf16.gguf" >&2
[[ -f $out/$name-f32.gguf ]] || "$q" "$out/$name-bf16.gguf" "$out/$name-f32.gguf" F32 2 >/dev/null 2>&1
[[ -f $out/$name-q8_0.gguf ]] || "$q" "$out/$name-bf16.gguf" "$out/$name-q8_0.gguf" Q8_0 2 >/dev/null 2>&1

llama_tps() { # LEVEL GGUF -p P -n N: llama-bench's mean tok/s
  local l=$1 g=$2; shift 2
  "$out/$l/bin/llama-bench" -m "$g" -t "$threads" -r 3 -o json "$@" 2>/dev/null |
    python3 -c 'import json, sys; print("%.1f" % json.load(sys.stdin)[0]["avg_ts"])'
}
rows=()
for l in "${levels[@]}"; do
  for w in bf16:auto f32:float32 q8_0:int8; do
    gg=${w%%:*} pw=${w##*:}
    echo "llamacpp-isa: $l, $gg / $pw" >&2
    ll_dec=$(llama_tps "$l" "$out/$name-$gg.gguf" -p 0 -n 64)
    ll_pre=$(llama_tps "$l" "$out/$name-$gg.gguf" -p 512 -n 0)
    ops=$("$build/bin/pd-bench-ops" --model "$model" --model-only --weights "$pw" --threads "$threads" \
      --cpu-isa "$l" 2>/dev/null)
    pd_dec=$(grep -m1 '^model decode.*batch 1 ' <<<"$ops" | grep -o '[0-9.]* tok/s' | head -1 | cut -d' ' -f1)
    pd_roof=$(grep -m1 '^model decode.*batch 1 ' <<<"$ops" | awk '{print $NF}')
    pd_pre=$(grep -m1 '^model prefill.*512 tokens' <<<"$ops" | grep -o '[0-9.]* tok/s' | head -1 | cut -d' ' -f1)
    rows+=("$(python3 -c 'import sys
l, w, pd, ll, roof, pp, lp = sys.argv[1:]
print("| %s | %s | %s | %s | %.2fx | %s | %s | %s | %.2fx |" % (l, w, pd, ll, float(pd) / float(ll), roof, pp, lp,
      float(pp) / float(lp)))' "$l" "$gg / $pw" "$pd_dec" "$ll_dec" "$pd_roof" "$pd_pre" "$ll_pre")")
  done
done
table=$(
  echo "| level | weights (llama.cpp / pdserve) | pdserve decode tok/s | llama.cpp decode | ratio | pdserve / read roofline | pdserve prefill 512 tok/s | llama.cpp prefill 512 | ratio |"
  echo "|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
)
echo "$table"
if [[ -n $results ]]; then
  {
    echo
    echo "## bench/llamacpp-isa.sh — $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "Command: \`bench/llamacpp-isa.sh $src $build${results:+ --results $results}\` (model $name, $threads threads; llama.cpp $(git -C "$src" log -1 --format=%h 2>/dev/null || echo '?'))  "
    echo "Machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores; levels: ${levels[*]}"
    echo
    echo "$table"
  } >>"$results"
fi
