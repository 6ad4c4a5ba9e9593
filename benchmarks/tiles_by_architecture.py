"""On a GPU without tiles of its own (an H100: configs/*.json hold the H200's), each kernel with
the tiles it now takes, those tuned for its architecture (tile_configs.tile_entry_names), against
the untuned defaults it ran before, same run, same inputs (`triton.testing.do_bench` medians):

    PYTHONPATH=$PWD python benchmarks/tiles_by_architecture.py [--out tiles.json]

Kernels: the bf16 fused MoE (DeepSeek-V3 and V4-Flash experts), the FP8 one and the MXFP4 one
(V4-Flash experts) at 128 and 4,096 tokens; sparse MLA decode at GLM-5 shapes (64 queries over
a 128k-token cache). Each pair's outputs are compared first (same math, other tiles).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from rayinfer.bench import kernels_dsa, moe_cases  # noqa: E402
from rayinfer.bench.kernels_moe_mxfp4 import (  # noqa: E402
    SWIGLU_LIMIT,
    V4_FLASH,
    random_mxfp4_experts,
)
from rayinfer.kernels.attention.paged_attention import launch_params  # noqa: E402
from rayinfer.kernels.dsa.sparse_mla import sparse_mla_attention  # noqa: E402
from rayinfer.kernels.moe import fused_moe as fused_moe_module  # noqa: E402
from rayinfer.kernels.moe import fused_moe_mxfp4 as mxfp4  # noqa: E402
from rayinfer.kernels.tile_configs import pick_tile_config, tile_entry_names  # noqa: E402

TOKENS = (128, 4096)


def bench_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def compare(name: str, run) -> dict:
    """run(tuned: bool) -> output; both outputs agree, then both are timed."""
    tuned, untuned = run(True), run(False)
    error = ((tuned.float() - untuned.float()).abs().max() / untuned.float().abs().max()).item()
    row = dict(kernel=name, tuned_ms=bench_ms(lambda: run(True)),
               untuned_ms=bench_ms(lambda: run(False)), rel_diff=error)  # fmt: skip
    row["speedup"] = row["untuned_ms"] / row["tuned_ms"]
    print(json.dumps(row), flush=True)
    return row


def moe_rows(shape_name: str, shape, fp8: bool) -> list[dict]:
    experts = moe_cases.random_experts(shape, fp8=fp8, device="cuda")
    limit = SWIGLU_LIMIT if shape is V4_FLASH else None
    rows = []
    for tokens in TOKENS:
        x = torch.randn(tokens, shape.hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = moe_cases.random_routing(tokens, shape, "cuda", seed=tokens)

        def run(tuned, x=x, weights=weights, ids=ids):
            config = None if tuned else fused_moe_module.DEFAULT_CONFIG
            return fused_moe_module.fused_moe(x, experts.w13, experts.w2, weights, ids,
                                              experts.w13_scale, experts.w2_scale, config,
                                              swiglu_limit=limit)  # fmt: skip

        kind = "fp8" if fp8 else "bf16"
        rows.append(compare(f"fused_moe {kind} {shape_name} T={tokens}", run))
    return rows


def mxfp4_rows() -> list[dict]:
    experts = random_mxfp4_experts(V4_FLASH, "cuda")
    small = mxfp4.scales_fold(experts["w13_scale"], experts["w2_scale"])
    rows = []
    for tokens in TOKENS:
        x = torch.randn(tokens, V4_FLASH.hidden, device="cuda", dtype=torch.bfloat16)
        weights, ids = moe_cases.random_routing(tokens, V4_FLASH, "cuda", seed=tokens)
        args = (x, experts["w13"], experts["w2"], weights, ids, experts["w13_scale"],
                experts["w2_scale"])  # fmt: skip

        def run(tuned, args=args):
            config = None if tuned else mxfp4.DEFAULT_CONFIG
            return mxfp4.fused_moe_mxfp4(*args, config, swiglu_limit=SWIGLU_LIMIT,
                                         small_scales=small)  # fmt: skip

        rows.append(compare(f"fused_moe_mxfp4 v4-flash T={tokens}", run))
    return rows


def sparse_mla_rows(batch: int = 64) -> list[dict]:
    q_latent, q_pe, kv_cache, slots, scale = kernels_dsa.sparse_attention_inputs(batch, 131072)
    heads = q_latent.shape[1]
    own = pick_tile_config("sparse_mla", tile_entry_names(q_latent.device)[:1], "default", heads)
    untuned = own or pick_tile_config("sparse_mla", "default", "default", heads)

    def run(tuned):
        params = launch_params("sparse_mla", q_latent.device, heads) if tuned else untuned
        return sparse_mla_attention(q_latent, q_pe, kv_cache, slots, scale, params=params)

    return [compare(f"sparse_mla decode B={batch} x 128k", run)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    names = tile_entry_names(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}: tiles from {names}", flush=True)
    rows = [*moe_rows("v3", moe_cases.MOE_SHAPES["deepseek-v3"], fp8=False)]
    rows += moe_rows("v4-flash", V4_FLASH, fp8=False)
    rows += moe_rows("v4-flash", V4_FLASH, fp8=True)
    rows += mxfp4_rows()
    rows += sparse_mla_rows()
    if args.out:
        Path(args.out).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(),
                                                  entries=names, rows=rows), indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
