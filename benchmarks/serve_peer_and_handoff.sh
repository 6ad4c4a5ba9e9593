#!/usr/bin/env bash
# Issue 28's remaining GPU figures in one device call (carry [".device"]: the Ray bundle, with
# the openai wheel `transformers serve` needs added to it); results under $OUT:
#   1. the hand-off copies' GPU test (tests/gpu/test_kv_copy.py, which needs Ray);
#   2. the KV hand-off inside `serve run` (disaggregated, V2-Lite shapes, 16 streams, the
#      default `kv_handoff.path=auto`: the shared-memory arena on one node): export / import
#      GB/s and share of TTFT from the bench's hand-off report (serve_c16.json);
#   3. `transformers serve` (continuous batching) against rayinfer on one random Llama folder
#      (benchmarks/random_llama_checkpoint.py; transformers' batching does not run MLA), same
#      client, same text prompts (transformers_c16.json / serve_c16_text.json).
#   bash benchmarks/serve_peer_and_handoff.sh [serve args for the hand-off pass, key=value ...]
set -uo pipefail
source .device/ray/use-ray-bundle.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} NO_BUNDLE=1 TOKENIZERS_PARALLELISM=false TRITON_INTERPRET=0
export OUT=${OUT:-/tmp}
STEPS=${STEPS:-copies handoff peer}
runs() { [[ " $STEPS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
runs copies && timeout 150 python -m pytest -q -m gpu tests/gpu/test_kv_copy.py 2>&1 | tail -3
if runs handoff; then
  echo "== hand-off in serve (disaggregated, arena)"
  OFFLINE=0 SERVE_PASSES=c16 RATES= WARMUPS=8 NUM_PROMPTS=48 UP_TIMEOUT=300 BENCH_TIMEOUT=200 \
    bash benchmarks/serve_v2lite.sh disaggregate=true "$@"
  python - "$OUT/serve_c16.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
s = s["passes"][0]["summary"] if "passes" in s else s["summary"]
print({k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()
       if "kv" in k or "handoff" in k or k in ("p50_ttft_ms", "input_throughput")})
PY
fi
if runs peer; then
  echo "== transformers serve vs rayinfer (random Llama, text prompts)"
  timeout 120 python benchmarks/random_llama_checkpoint.py /tmp/llama-random
  MODEL=/tmp/llama-random OFFLINE=0 SERVE_PASSES= RATES= WITH_TRANSFORMERS=1 NUM_PROMPTS=32 \
    INPUT_LEN=1024 WARMUPS=8 UP_TIMEOUT=240 BENCH_TIMEOUT=240 SERVE_TIMEOUT=600 \
    bash benchmarks/serve_vs_offline.sh
fi
