#!/usr/bin/env bash
# DeepSeek-V4's GPU figures in one device call (nvidia-h200, no Ray; results under $OUT):
#   1. correctness: every MXFP4 kernel and dequantization form against float32
#      (tests/gpu/test_mxfp4_moe.py), the V4 kernels over the hybrid cache, V4 parity, the
#      hand-off's copies of layers of different widths (tests/gpu/test_kv_copy.py);
#   2. `bench kernels moe_mxfp4 --sweep` at 128 and 4,096 tokens: each kernel family's best tiles
#      (tl.dot_scaled, split shift, split lookup, four lanes) against the bf16 fused MoE of the
#      same run; the winner's tiles go into rayinfer/kernels/configs/fused_moe_mxfp4.json;
#   3. `bench long_context` on the 4-layer V4-Flash shapes over the hybrid cache: prefill at 8k /
#      128k / 1M, decode at 1M and 16 x 8k, the cache's bytes per token as allocated.
# V4 bf16 parity needs a transformers that runs V4 in bf16 (5.17, the machine's, cannot): put
# its wheels in .whl first (benchmarks/device_wheels.sh says which, plus httpx2 for
# huggingface-hub 2.x) and name .whl in carry; without them that test skips. The engine imports
# Ray too, and the Ray bundle and the wheels together pass the carry limit (64 MiB): carry
# [".device"] in one call and [".whl"] in the next while the machine is still warm (its ignored
# paths stay between calls), then run "checks". STEPS picks what runs (a device command
# has 10 minutes: run "checks mxfp4" in one call and "long" in the next):
#   STEPS="checks mxfp4" bash benchmarks/gpu_v4_figures.sh
set -uo pipefail
OUT=${OUT:-/tmp} STEPS=${STEPS:-checks mxfp4 long}
runs() { [[ " $STEPS " == *" $1 "* ]]; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# The hand-off copies' test imports Ray: carry .device (the Ray bundle) for it, else it is left out.
[ -f .device/ray/use-ray-bundle.sh ] && source .device/ray/use-ray-bundle.sh
CHECKS=(tests/gpu/test_mxfp4_moe.py tests/gpu/test_v4_kernels.py tests/gpu/test_v4_parity.py)
python -c "import ray" 2>/dev/null && CHECKS+=(tests/gpu/test_kv_copy.py)
runs checks && timeout 240 python -m pytest -q -m gpu "${CHECKS[@]}" 2>&1 | tail -15
runs mxfp4 && timeout 360 python -m rayinfer.bench kernels moe_mxfp4 --tokens 128 4096 --sweep \
  --out "$OUT/moe_mxfp4.json" 2>&1 | grep -e "family" -e '"tokens"'
runs long && timeout 560 python -m rayinfer.bench long_context --config benchmarks/configs/deepseek-v4-flash-4layer \
  --lengths 8192 131072 1048576 --decode-batch 16 --decode-context 8192 --decode-tokens 16 \
  --decode-after-longest 8 --chunk 16384 --block-size 64 --json "$OUT/v4_long_context.json" 2>&1 \
  | grep -v -e Loading -e "it/s]"
