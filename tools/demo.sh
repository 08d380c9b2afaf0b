#!/usr/bin/env bash
# tools/demo.sh BUILD_DIR — `make demo`: a disaggregated deployment on loopback, through pdctl.
# deploy/local/pdctl brings up the cluster of deploy/local/demo.yaml (1 pd-prefill + 1 pd-decode
# with KV over the ucx pipe + pd-proxy on free ports; models/sotu-demo, the small Llama trained on the
# State of the Union addresses by tools/train-demo-model.py), pd-bench drives load through the proxy
# for about 30 s and prints the report, two sample completions come through the proxy, and pdctl
# stops everything (also on failure or Ctrl-C).
# Environment: PD_DEMO_MODE=pull|push, PD_DEMO_PIPE=ucx|tcp, PD_DEMO_PROMPTS, PD_DEMO_RATE.
set -euo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."
bin="$build/bin"
prompts=${PD_DEMO_PROMPTS:-48}
rate=${PD_DEMO_RATE:-1.6}
work=$(mktemp -d /tmp/pd-demo-XXXXXX)
config="$work/demo.yaml"
# demo.yaml with this run's build directory, run directory and KV mode/pipe
python3 - "$build" "$work" "${PD_DEMO_MODE:-}" "${PD_DEMO_PIPE:-}" >"$config" <<'EOF'
import os, sys, yaml
build, work, mode, pipe = sys.argv[1:5]
cfg = yaml.safe_load(open("deploy/local/demo.yaml"))
cfg["bin_dir"] = os.path.join(build, "bin")
cfg["run_dir"] = os.path.join(work, "run")
cfg["kv"]["mode"] = mode or cfg["kv"]["mode"]
cfg["kv"]["pipe"] = pipe or cfg["kv"]["pipe"]
print(yaml.safe_dump(cfg, sort_keys=False))
EOF
pdctl() { python3 deploy/local/pdctl -c "$config" "$@"; }
cleanup() {
  pdctl down || true
  rm -rf "$work"
}
trap cleanup EXIT
echo "demo: pdctl up (deploy/local/demo.yaml: models/sotu-demo, the trained demo model; KV ${PD_DEMO_MODE:-pull} over ${PD_DEMO_PIPE:-ucx}), logs in $work/run"
pdctl up | tee "$work/up.log"
proxy_url=$(sed -n 's/^PROXY_URL=//p' "$work/up.log")
decode_port=$(python3 -c 'import json,sys; print([p["port"] for p in json.load(open(sys.argv[1]))["procs"] if p["role"] == "decode"][0])' "$work/run/state.json")
echo "demo: waiting for both nodes to pre-fault their KV regions (--kv-prefault, a background thread)"
for _ in $(seq 600); do
  grep -q "pre-faulted" "$work/run/prefill-0.log" && grep -q "pre-faulted" "$work/run/decode-0.log" && break
  sleep 0.2
done
pdctl status
echo "demo: $prompts requests (256-token prompts, 32 output tokens) at $rate req/s through $proxy_url"
"$bin/pd-bench" --base-url "$proxy_url" --wait-ready 60 --dataset-name random \
  --random-input-len 256 --random-output-len 32 --random-range-ratio 0.25 --num-prompts "$prompts" \
  --request-rate "$rate" --ignore-eos --num-warmups 2 --metric-percentiles 50,90,99 \
  --kv-metrics-url "http://127.0.0.1:$decode_port" --save-result --result-filename "$work/result.json"
echo
echo "demo: two completions from models/sotu-demo through the proxy (P/D; temperature 0.7, seeded)"
python3 - "$proxy_url" <<'EOF'
import json, sys, textwrap, urllib.request
for prompt in ("Fellow-Citizens of the Senate and House of Representatives: The state of the Union",
               "Our economy is"):
    body = {"model": "sotu-demo", "prompt": prompt, "max_tokens": 64, "temperature": 0.7, "top_p": 0.95,
            "seed": 7}
    req = urllib.request.Request(sys.argv[1] + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    text = json.load(urllib.request.urlopen(req, timeout=60))["choices"][0]["text"]
    print(textwrap.fill(prompt + " \u2192" + text, width=100, initial_indent="  ", subsequent_indent="  "))
    print()
EOF
echo "demo: stopping"
