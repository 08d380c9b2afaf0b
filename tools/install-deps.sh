#!/usr/bin/env bash
# tools/install-deps.sh — install pdserve's build, test and benchmark dependencies (Debian, apt).
# Idempotent: packages already installed are skipped; apt is not touched when nothing is missing.
# Usage: tools/install-deps.sh [--print]   (--print lists the packages and exits)
set -euo pipefail

PKGS=(
  cmake gcc g++ make pkg-config            # build
  libucx-dev ucx-utils                     # transport (UCP) + ucx_perftest baseline
  libprotobuf-c-dev protobuf-c-compiler    # control plane
  libevent-dev                             # HTTP server/client, event loop
  libjansson-dev                           # JSON
  libzmq3-dev libmsgpack-dev               # KV cache events (--kv-events-config: ZMQ PUB + msgpack)
  libopenblas-dev                          # CPU GEMM
  libdnnl-dev                              # CPU bf16 GEMM (oneDNN, --matmul-precision bf16)
  libxxhash-dev                            # hashing
  libpcre2-dev libutf8proc-dev             # tokenizer pre-tokenizer regex + normalizer
  check                                    # unit tests
  gnuplot-nox                              # benchmark plots
  python3-numpy python3-yaml              # reference implementation; deploy manifest checks
  python3-jinja2                           # reference renders for the chat-template interpreter
  python3-jsonschema                       # the reference validator for structured outputs (grammar/)
  python3-zmq python3-msgpack              # the reference KV-events subscriber in tests
  python3-torch python3-regex              # tools/train-demo-model.py; PyTorch's perplexity beside ours
  prometheus                               # promtool check metrics (the /metrics exposition)
  clang-format                             # make format / format check
  nodejs npm                               # gpt-3-encoder / openai client peers in tests
  kubectl                                  # kubectl kustomize renders deploy/overlays (preinstalled here)
  xz-utils binutils                        # tools/gpu-kit: the kit's tar.xz, strip
)

if [[ "${1:-}" == "--print" ]]; then
  printf '%s\n' "${PKGS[@]}"
  exit 0
fi

missing=()
for p in "${PKGS[@]}"; do
  # node/npm may come from outside apt (e.g. a preinstalled toolchain); accept the command.
  if [[ "$p" == nodejs && -x "$(command -v node || true)" ]]; then continue; fi
  if [[ "$p" == npm && -x "$(command -v npm || true)" ]]; then continue; fi
  if [[ "$p" == clang-format && -x "$(command -v clang-format || true)" ]]; then continue; fi
  if [[ "$p" == kubectl && -x "$(command -v kubectl || true)" ]]; then continue; fi
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#PKGS[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# kubectl is not a Debian package: where no configured repository has it (a plain Debian root, as
# make image-check builds), go on without it; the deploy_manifests test then fails, loudly
if [[ " ${missing[*]} " == *" kubectl "* ]] && ! apt-cache show kubectl >/dev/null 2>&1; then
  echo "install-deps: WARNING: no kubectl package in the configured apt sources; deploy_manifests needs it"
  missing=("${missing[@]/kubectl}")
fi
$SUDO apt-get install -y -q --no-install-recommends ${missing[@]}
echo "install-deps: done"
