"""fp8_quant on the GPU (per token, per 128 channels), this tree's kernel: ms and GB/s moved
(bf16 read + e4m3 and scales written) at the shapes the FP8 paths quantize, plus the FP8 fused
MoE at DeepSeek-V4-Flash's expert shapes. Run once per tree for an A/B in one call:

    PYTHONPATH=$PWD python benchmarks/fp8_quant_ab.py --out quant.json
    (cd ../before && PYTHONPATH=$PWD python ../main/benchmarks/fp8_quant_ab.py)

Shapes: a V4-Flash MoE's act at 4,096 tokens (24,576 x 2,048) and its input (4,096 x 4,096), a
16k-token prefill's hidden state at V3 (16,384 x 7,168) and decode's 64 x 7,168.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton.testing

from rayinfer.bench import moe_cases
from rayinfer.bench.kernels_moe_mxfp4 import SWIGLU_LIMIT, V4_FLASH
from rayinfer.kernels.fp8.fp8_quant import fp8_quant, fp8_quant_reference
from rayinfer.kernels.moe.fused_moe import fused_moe

SHAPES = ((24576, 2048), (4096, 4096), (16384, 7168), (64, 7168))


def bench_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for m, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        q, scale = fp8_quant(x)
        q_ref, scale_ref = fp8_quant_reference(x)  # torch on this GPU
        same_scales = bool(torch.equal(scale, scale_ref))
        off = int((q.view(torch.uint8) != q_ref.view(torch.uint8)).sum())  # values a step away
        ms = bench_ms(lambda x=x: fp8_quant(x))
        moved = m * k * 3 + m * (k // 128) * 4
        rows.append(dict(op="fp8_quant", m=m, k=k, ms=ms, gb_per_s=moved / ms / 1e6,
                         same_scales=same_scales, values_off=off))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    experts = moe_cases.random_experts(V4_FLASH, fp8=True, device="cuda")
    for tokens in (128, 4096):
        x = torch.randn(tokens, V4_FLASH.hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = moe_cases.random_routing(tokens, V4_FLASH, "cuda", seed=tokens)
        ms = bench_ms(lambda x=x, w=weights, i=ids: fused_moe(
            x, experts.w13, experts.w2, w, i, experts.w13_scale, experts.w2_scale,
            swiglu_limit=SWIGLU_LIMIT))  # fmt: skip
        rows.append(dict(op="fused_moe fp8 v4-flash", tokens=tokens, ms=ms))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
