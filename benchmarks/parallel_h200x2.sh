#!/usr/bin/env bash
# DeepSeek-V2-Lite-shaped model (random weights) on nvidia-h200-x2: prefill and decode per parallel
# plan, transport and overlap, against transformers' forward on one GPU in the same run.
# Run through the device tool with carry [".device"] (the Ray bundle, see shared/device/README.md).
set -uo pipefail
source .device/ray/use-ray-bundle.sh
export PYTHONPATH=$PWD:$PYTHONPATH TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout "${BENCH_TIMEOUT:-290}" python -m rayinfer.bench parallel \
    --config benchmarks/configs/deepseek-v2-lite \
    --plans tp=1 dp=2,ep=2 --transports dist host --overlap off on \
    --prompt-lens 4096 16384 --decode-batches 1 64 --decode-tokens 16 --repeats 3 \
    --json "${OUT:-/tmp}/parallel.json" 2>&1 | grep -v -e "Loading" -e "it/s]"
