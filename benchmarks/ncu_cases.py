"""One call of a hot kernel between cudaProfilerStart and Stop, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --kernel-name regex:mxfp4 \\
        --set full -o mxfp4_128 python benchmarks/ncu_cases.py mxfp4 128

Cases (each built as its `python -m rayinfer.bench kernels ...` row builds it, run twice first
so that Triton's compilation and autotuning stay outside the profiled range):
- `mxfp4 T`: the MXFP4 fused MoE at DeepSeek-V4-Flash's expert shapes, T tokens;
- `moe T` / `fp8moe T`: the bf16 / block-scaled FP8 fused MoE at the same shapes;
- `sparse_mla B`: sparse MLA decode of B queries at GLM-5 shapes over a 128k-token cache.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rayinfer.bench import kernels_dsa, moe_cases  # noqa: E402
from rayinfer.bench.kernels_moe_mxfp4 import (  # noqa: E402
    SWIGLU_LIMIT,
    V4_FLASH,
    random_mxfp4_experts,
)
from rayinfer.kernels.dsa.sparse_mla import sparse_mla_attention  # noqa: E402
from rayinfer.kernels.moe import fused_moe_mxfp4 as mxfp4  # noqa: E402
from rayinfer.kernels.moe.fused_moe import fused_moe  # noqa: E402


def mxfp4_call(num_tokens: int):
    experts = random_mxfp4_experts(V4_FLASH, "cuda")
    x = torch.randn(num_tokens, V4_FLASH.hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = moe_cases.random_routing(num_tokens, V4_FLASH, "cuda", seed=num_tokens)
    small = mxfp4.scales_fold(experts["w13_scale"], experts["w2_scale"])
    args = (x, experts["w13"], experts["w2"], weights, ids, experts["w13_scale"],
            experts["w2_scale"])  # fmt: skip
    return lambda: mxfp4.fused_moe_mxfp4(*args, None, swiglu_limit=SWIGLU_LIMIT,
                                         small_scales=small)  # fmt: skip


def moe_call(num_tokens: int, fp8: bool):
    experts = moe_cases.random_experts(V4_FLASH, fp8=fp8, device="cuda")
    x = torch.randn(num_tokens, V4_FLASH.hidden, device="cuda", dtype=torch.bfloat16)
    weights, ids = moe_cases.random_routing(num_tokens, V4_FLASH, "cuda", seed=num_tokens)
    return lambda: fused_moe(x, experts.w13, experts.w2, weights, ids, experts.w13_scale,
                             experts.w2_scale, swiglu_limit=SWIGLU_LIMIT)  # fmt: skip


def sparse_mla_call(batch: int):
    inputs = kernels_dsa.sparse_attention_inputs(batch, context=131072)
    return lambda: sparse_mla_attention(*inputs)


CASES = {
    "mxfp4": mxfp4_call,
    "moe": lambda n: moe_call(n, fp8=False),
    "fp8moe": lambda n: moe_call(n, fp8=True),
    "sparse_mla": sparse_mla_call,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("size", type=int, help="tokens (MoE cases) or decodes (sparse_mla)")
    args = parser.parse_args()
    call = CASES[args.case](args.size)
    call(), call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
