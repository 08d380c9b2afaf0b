#!/usr/bin/env bash
# tools/bench-ops-ab.sh BIN_A BIN_B ROUNDS [pd-bench-ops arguments...] — two builds of pd-bench-ops
# alternated, one process per run (A, B, A, B, ...), so the VM's drift between its fast and slow
# states falls on both alike: a kernel change's A/B, as tools/bench-serve-ab.sh is for serving.
# Build the old commit in a git worktree and pass both build/bin directories. Prints one line per
# run with the decode rows' tok/s and ratio (every row with --op-profile also prints the profile's
# step time and attention share). Appends nothing; starts no server. Example:
#   tools/bench-ops-ab.sh /tmp/base/build/bin build/bin 6 --model build/models/demo --model-only \
#     --weights bf16-math --batch 32
set -euo pipefail
a=$(realpath "${1:?usage: tools/bench-ops-ab.sh BIN_A BIN_B ROUNDS [pd-bench-ops arguments...]}")
b=$(realpath "${2:?usage: tools/bench-ops-ab.sh BIN_A BIN_B ROUNDS [pd-bench-ops arguments...]}")
rounds=${3:?usage: tools/bench-ops-ab.sh BIN_A BIN_B ROUNDS [pd-bench-ops arguments...]}
shift 3
for bin in "$a" "$b"; do
  [[ -x $bin/pd-bench-ops ]] || { echo "bench-ops-ab: no pd-bench-ops in $bin" >&2; exit 2; }
done
echo "bench-ops-ab: A = $a, B = $b, $rounds rounds, pd-bench-ops $*"
for round in $(seq "$rounds"); do
  for side in A B; do
    bin=$a
    [[ $side == B ]] && bin=$b
    out=$("$bin/pd-bench-ops" "$@" 2>/dev/null)
    # "model decode, ... (prompt 64, 64 steps)   6440.2 tok/s   roofline 9035 tok/s (...)    0.71x"
    grep -E '^model decode' <<<"$out" | sed -E 's/ {2,}/ | /g; s/^/'"$side r$round"': /' || true
    grep -E '^op profile|^  paged_attention_decode' <<<"$out" | sed -E 's/ {2,}/ /g; s/^ ?/'"$side r$round"': /' || true
  done
done
