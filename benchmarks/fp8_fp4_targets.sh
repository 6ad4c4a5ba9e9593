#!/usr/bin/env bash
# Issues 29 and 30's kernel targets in one device call (one GPU, no Ray; results under $OUT):
#   1. FP8 fused MoE against the bf16 fused MoE of the same run at 128 and 4,096 tokens, on the
#      DeepSeek-V3, V4-Flash and GLM-5 expert shapes (`bench kernels moe`, which also times
#      `ops.fp8_gemm` against per-tensor `_scaled_mm` on the V3 projections);
#   2. `ops.fp8_gemm` at M = 128 and 4,096 in a sustained (100 ms) and a burst (30 ms) window;
#   3. the MXFP4 fused MoE (V4-Flash experts) against bf16, same run;
#   4. the engine's prefill with FP8 weights against bf16 (V3 shapes, 4 layers) at 4k and 16k.
# STEPS picks the parts (default all):
#   STEPS="moe gemm mxfp4 engine" bash benchmarks/fp8_fp4_targets.sh
set -uo pipefail
OUT=${OUT:-/tmp} STEPS=${STEPS:-moe gemm mxfp4 engine}
runs() { [[ " $STEPS " == *" $1 "* ]]; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if runs moe; then
  for shape in deepseek-v3 deepseek-v4-flash glm-5; do
    echo "== moe $shape"
    python -m rayinfer.bench kernels moe --shape "$shape" --tokens 128 4096 --no-loop \
      --out "$OUT/moe_$shape.json" 2>&1 | tail -n 25
  done
fi
if runs gemm; then
  for timing in sustained burst; do
    echo "== fp8_gemm $timing"
    python benchmarks/sweep_fp8_gemm.py --timing "$timing" --rows 4096 128 --budget-s 40 \
      --out "$OUT/fp8_gemm_$timing.json" 2>&1 | tail -n 16
  done
fi
if runs mxfp4; then
  echo "== mxfp4"
  python -m rayinfer.bench kernels moe_mxfp4 --tokens 128 4096 --out "$OUT/mxfp4.json" 2>&1 \
    | tail -n 20
fi
if runs engine; then
  for weights in bf16 fp8; do
    echo "== engine prefill, $weights weights"
    flag=(); [ "$weights" = fp8 ] && flag=(--fp8-weights)
    python -m rayinfer.bench long_context --config benchmarks/configs/deepseek-v3-4layer \
      --lengths 4096 16384 --dense-lengths --decode-batch 0 --decode-after-longest 0 \
      --chunk 16384 "${flag[@]}" --json "$OUT/engine_$weights.json" 2>&1 | tail -n 8
  done
fi
