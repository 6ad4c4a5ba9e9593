#!/usr/bin/env bash
# `serve run rayinfer.app:build` with no arguments on a GPU machine (the built-in tiny MoE on
# CUDA): the models list, a chat completion, a streamed one, a 400 for a bad field, the GPU
# processes, then `python -m rayinfer.bench serve` (32 prompts, 8 at once). Arguments go to
# `build`, e.g. `decode.dp=2 decode.ep=2 decode.gpus_per_worker=0.75 prefill.gpus_per_worker=0.25`.
# Run through the device tool with carry [".device"] (the Ray bundle, see shared/device/README.md).
set -uo pipefail
[ -n "${NO_BUNDLE:-}" ] || source .device/ray/use-ray-bundle.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp}
# The Ray bundle has no console scripts: run Serve's CLI through Python when `serve` is missing.
SERVE=(serve)
command -v serve >/dev/null || SERVE=(python -c 'import sys; from ray.serve.scripts import cli; sys.argv[0] = "serve"; cli()')
URL=http://127.0.0.1:8000
start=$(date +%s)
timeout "${SERVE_TIMEOUT:-280}" "${SERVE[@]}" run rayinfer.app:build "$@" >"$OUT/serve_gpu.log" 2>&1 &
for _ in $(seq 1 180); do curl -sf "$URL/v1/models" >/dev/null && break; sleep 1; done
echo "up after $(( $(date +%s) - start )) s: $(curl -s "$URL/v1/models")"
chat='{"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}'
echo "chat: $(curl -s "$URL/v1/chat/completions" -H 'Content-Type: application/json' -d "$chat")"
echo "stream (last events):"
curl -sN "$URL/v1/chat/completions" -H 'Content-Type: application/json' \
  -d "${chat%\}}, \"stream\": true}" | tail -3
echo "bad field: $(curl -s -w ' HTTP %{http_code}' "$URL/v1/completions" \
  -H 'Content-Type: application/json' -d '{"model": "tiny", "prompt": "x", "max_tokens": -3}')"
echo "GPU processes:"
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
python -m rayinfer.bench serve --url "$URL" --num-prompts 32 --max-concurrency 8 \
  --json "$OUT/serve_gpu.json" 2>&1 | grep -v -e "^-" -e "P9[59]" | tail -26
grep -iE "cuda|device|error|captured" "$OUT/serve_gpu.log" | grep -v "^\s*$" | head -12
"${SERVE[@]}" shutdown -y >/dev/null 2>&1 || true
