"""`python -m rayinfer.bench kernels moe_mxfp4 [--tokens T ..] [--sweep] [--out FILE]`.

The MXFP4 (W4A16) fused MoE at DeepSeek-V4-Flash's expert shapes (hidden 4096, 256 experts,
intermediate 2048, top-6, swiglu_limit 10) against the bf16 fused MoE of the same run, on the
same experts (the MXFP4 ones dequantized to bf16, exact):
1. correctness of both against a float32 reference over the dequantized experts;
2. with --sweep: tiles per GEMM stage for each row tile, the best kept (print / --out; copy into
   rayinfer/kernels/configs/fused_moe_mxfp4.json);
3. timings (`triton.testing.do_bench` medians): ms, the ratio, the bytes of the experts read
   (the experts routed to, packed + scales) per second and TFLOP/s.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton.testing

from rayinfer.bench.moe_cases import MOE_SHAPES, MoeShape, random_routing, relative_error
from rayinfer.kernels.moe import fused_moe_mxfp4 as mxfp4
from rayinfer.kernels.moe.fused_moe import fused_moe
from rayinfer.kernels.moe.moe_align import moe_align

V4_FLASH = MOE_SHAPES["deepseek-v4-flash"]
SWIGLU_LIMIT = 10.0
BF16 = torch.bfloat16


def random_mxfp4_experts(shape: MoeShape, device) -> dict:
    """Uniform e2m1 codes (RMS ~2.9) with UE8M0 scales near 1/(2.9 sqrt(fan_in))."""
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate

    def part(rows, cols, exponent):
        packed = torch.randint(0, 256, (e, rows, cols // 2), dtype=torch.uint8, device=device)
        scale = torch.randint(exponent, exponent + 2, (e, rows, cols // 32), device=device)
        return packed, scale.to(torch.uint8)

    (w13, w13_scale), (w2, w2_scale) = part(2 * i, h, 127 - 8), part(h, i, 127 - 8)
    return dict(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale)


def dequantized_bf16(experts: dict, chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The same experts in bf16 (exact), dequantized by chunks of experts."""
    out = []
    for name in ("w13", "w2"):
        packed, scale = experts[name], experts[f"{name}_scale"]
        full = torch.empty(*packed.shape[:2], 2 * packed.shape[2], dtype=BF16, device=packed.device)
        for s in range(0, packed.shape[0], chunk):
            part = slice(s, s + chunk)
            full[part] = mxfp4.dequantize_mxfp4_reference(packed[part], scale[part]).to(BF16)
        out.append(full)
    return out[0], out[1]


def float32_reference(x, w13, w2, weights, ids, limit):
    """One expert at a time in float32 from the (exact) bf16 dequantized experts."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = ids.view(-1)
    for expert in flat.unique().tolist():
        slots = (flat == expert).nonzero(as_tuple=True)[0]
        tokens = slots // ids.shape[1]
        gate, up = (x[tokens].float() @ w13[expert].float().t()).chunk(2, dim=-1)
        act = F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
        out.index_add_(0, tokens, (act @ w2[expert].float().t()) * weights.view(-1)[slots, None])
    return out


def bench_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def tile(bm, bn, bk, warps, stages, group_m=1, split=False, lut_reg=False) -> dict:
    """A tile; split: False (tl.dot_scaled), True (two lanes, bytes) or 4 (four lanes, words),
    each split kernel with its inline-PTX dequantization; lut_reg: the four-lane lookup with its
    table in a register ("LUT_REG"; weights with swapped bit pairs always take that form)."""
    found = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m,
             "num_warps": warps, "num_stages": stages}  # fmt: skip
    if lut_reg:
        found["LUT_REG"] = True
    return {**found, "SPLIT": split, "ASM": True} if split else found


# (BLOCK_N, BLOCK_K, warps, stages[, GROUP_M]) tried per row tile
_SMALL_SCALED = [(64, 128, 4, 4), (128, 128, 4, 4), (64, 128, 4, 6)]
_SMALL_SPLIT = [(64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4), (128, 128, 8, 4),
                (64, 128, 4, 6), (32, 256, 4, 4), (128, 256, 8, 3)]  # fmt: skip
# The four-lane kernel with LUT_REG: today's small tiles, then two-warp ones, which Triton
# builds with mma.sync on Hopper too (no wgmma waits; 6.7-6.9 instructions a byte on sm_90)
_SMALL_QUAD_REG = [*_SMALL_SPLIT, (64, 128, 2, 4), (32, 256, 2, 3), (64, 128, 2, 3)]
_LARGE_SCALED = [(128, 128, 8, 3, 8), (128, 64, 4, 4, 8), (128, 64, 8, 3, 8)]
_LARGE_SPLIT = [(128, 128, 8, 3, 8), (128, 64, 8, 3, 8), (128, 64, 4, 4, 8), (256, 64, 8, 3, 8),
                (128, 128, 4, 3, 8), (64, 128, 4, 4, 8)]  # fmt: skip


def candidates(num_tokens: int) -> dict[tuple, list[dict]]:
    """(row tile, kernel) -> stage tiles to try: tl.dot_scaled, the two-lane split kernel, the
    four-lane word kernel, also with its table in a register, and over weights with swapped bit
    pairs ("quad_swapped") (both stages of a call must agree on the lanes: act's layout)."""
    if num_tokens <= 256:
        return {
            (16, "scaled"): [tile(16, *t) for t in _SMALL_SCALED],
            (16, "split"): [tile(16, *t, split=True) for t in _SMALL_SPLIT],
            (16, "quad"): [tile(16, *t, split=4) for t in _SMALL_SPLIT],
            (16, "quad_reg"): [tile(16, *t, split=4, lut_reg=True) for t in _SMALL_QUAD_REG],
            (16, "quad_swapped"): [tile(16, *t, split=4, lut_reg=True) for t in _SMALL_QUAD_REG],
        }
    return {
        (128, "scaled"): [tile(128, n, k, w, s, g) for n, k, w, s, g in _LARGE_SCALED],
        (128, "split"): [tile(128, *t, split=True) for t in _LARGE_SPLIT],
        (128, "quad"): [tile(128, *t, split=4) for t in _LARGE_SPLIT],
        (128, "quad_reg"): [tile(128, *t, split=4, lut_reg=True) for t in _LARGE_SPLIT],
        (128, "quad_swapped"): [tile(128, *t, split=4, lut_reg=True) for t in _LARGE_SPLIT],
        (64, "split"): [tile(64, *t, split=True) for t in _LARGE_SPLIT[:4]],
        (64, "quad"): [tile(64, *t, split=4) for t in _LARGE_SPLIT[:4]],
    }


def sweep(x, experts, weights, ids, ref, families: list[str] | None = None) -> dict:
    """The fastest tile per stage for each (row tile, split); the best pair overall. A family
    whose first pair misses the float32 reference (rel. error > 1e-2) is skipped."""
    num_tokens, top_k = ids.shape
    inter = experts["w13"].shape[1] // 2
    best = None
    small = mxfp4.scales_fold(experts["w13_scale"], experts["w2_scale"])
    for (bm, family), tiles in candidates(num_tokens).items():
        if families and family not in families:
            continue
        swapped = family.endswith("swapped")
        w13, w2 = (experts[f"{name}_swapped" if swapped else name] for name in ("w13", "w2"))
        packed = (w13, w2, weights, ids, experts["w13_scale"], experts["w2_scale"])
        first = {"w13": tiles[0], "w2": tiles[0]}
        try:
            out = mxfp4.fused_moe_mxfp4(x, *packed, first, swiglu_limit=SWIGLU_LIMIT,
                                        small_scales=small, bits_swapped=swapped)  # fmt: skip
            error = relative_error(out, ref)
        except Exception as failure:  # noqa: BLE001 - a family that does not build here
            error = f"{type(failure).__name__}: {str(failure)[:200]}"
        print(f"  family BM={bm} {family}: rel. error {error}", flush=True)
        if not isinstance(error, float) or error > 1e-2:
            continue
        alignment = moe_align(ids, experts["w13"].shape[0], bm)
        act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
        slot_out = torch.empty(num_tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
        stage_args = {
            "w13": (x, w13, experts["w13_scale"], act, weights, alignment),
            "w2": (act, w2, experts["w2_scale"], slot_out, weights, alignment),
        }
        chosen = {}
        for stage, args in stage_args.items():
            is_w13 = stage == "w13"
            limit = SWIGLU_LIMIT if is_w13 else None
            launch = (top_k if is_w13 else 1, is_w13, limit, small, swapped)
            timed = []
            for t in tiles:
                try:
                    ms = bench_ms(lambda a=args, t=t, how=launch: mxfp4._launch(*a, t, *how))
                except Exception as failure:  # noqa: BLE001 - e.g. out of shared memory
                    print(f"  sweep T={num_tokens} {stage} {t}: {type(failure).__name__}")
                    continue
                timed.append((ms, t))
                print(f"  sweep T={num_tokens} {stage} {t}: {ms:.3f} ms", flush=True)
            chosen[stage] = min(timed, key=lambda pair: pair[0])
        total = chosen["w13"][0] + chosen["w2"][0]
        print(f"  family BM={bm} {family}: best stages {total:.3f} ms", flush=True)
        if best is None or total < best[0]:
            best = (total, {stage: pair[1] for stage, pair in chosen.items()}, swapped)
    return best[1], best[2]


def expert_bytes(experts: dict, ids: torch.Tensor) -> int:
    """Bytes of the routed-to experts' packed weights and scales (what must be read once)."""
    num_used = int(ids.unique().numel())
    parts = ("w13", "w2", "w13_scale", "w2_scale")  # not the swapped copies
    per_expert = sum(experts[name][0].numel() for name in parts)
    return num_used * per_expert


def run_case(num_tokens: int, experts: dict, bf16: tuple, do_sweep: bool,
             families: list[str] | None = None) -> dict:  # fmt: skip
    """Both MoEs timed on the same inputs: the MXFP4 one with the sweep's tiles (else the
    configured ones) over the bytes as shipped and, where those tiles are four-lane ones, over
    the same bytes with their bit pairs swapped (the kernel's output must not change)."""
    shape = V4_FLASH
    device = experts["w13"].device
    gen = torch.Generator(device=device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, shape.hidden, device=device, dtype=BF16, generator=gen)
    weights, ids = random_routing(num_tokens, shape, device, seed=num_tokens)
    ref = float32_reference(x, bf16[0], bf16[1], weights, ids, SWIGLU_LIMIT)
    config, swept_swapped = sweep(x, experts, weights, ids, ref, families) if do_sweep else (
        None, False)  # fmt: skip
    limit = {"swiglu_limit": SWIGLU_LIMIT}
    small = {"small_scales": mxfp4.scales_fold(experts["w13_scale"], experts["w2_scale"])}
    scales = (experts["w13_scale"], experts["w2_scale"])

    def run(swapped: bool):
        w13, w2 = (experts[f"{name}_swapped" if swapped else name] for name in ("w13", "w2"))
        return mxfp4.fused_moe_mxfp4(x, w13, w2, weights, ids, *scales, config, **limit, **small,
                                     bits_swapped=swapped)  # fmt: skip

    shipped_config = config or mxfp4._pick_config(x, experts["w13"])
    four_lanes = mxfp4.lanes(shipped_config["w13"]) == 4
    ours = run(swept_swapped)
    base = fused_moe(x, bf16[0], bf16[1], weights, ids, **limit)
    bf16_ms = bench_ms(lambda: fused_moe(x, bf16[0], bf16[1], weights, ids, **limit))
    shipped_ms = bench_ms(lambda: run(False)) if not swept_swapped else None
    swapped_ms = same_output = None
    if four_lanes:
        swapped_ms = bench_ms(lambda: run(True))
        same_output = bool(torch.equal(run(True), run(False)))
    mxfp4_ms = swapped_ms if swept_swapped else shipped_ms
    flops = 2 * num_tokens * shape.top_k * 3 * shape.hidden * shape.intermediate
    read = expert_bytes(experts, ids)
    return dict(
        tokens=num_tokens, mxfp4_ms=round(mxfp4_ms, 4), bf16_ms=round(bf16_ms, 4),
        speedup=round(bf16_ms / mxfp4_ms, 3), mxfp4_rel_err=relative_error(ours, ref),
        bf16_rel_err=relative_error(base, ref), mxfp4_expert_gb=round(read / 1e9, 3),
        mxfp4_tb_per_s=round(read / mxfp4_ms / 1e9, 3),
        bf16_tb_per_s=round(read * 32 / 8.5 / bf16_ms / 1e9, 3),  # bf16: 16 bits, not 4.25
        mxfp4_tflops=round(flops / mxfp4_ms / 1e9, 1), bf16_tflops=round(flops / bf16_ms / 1e9, 1),
        shipped_bytes_ms=None if shipped_ms is None else round(shipped_ms, 4),
        swapped_bits_ms=None if swapped_ms is None else round(swapped_ms, 4),
        swapped_speedup=None if swapped_ms is None else round(bf16_ms / swapped_ms, 3),
        swapped_same_output=same_output, config=config or "default",
        config_bits_swapped=swept_swapped,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayinfer.bench kernels moe_mxfp4")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--sweep", action="store_true", help="try tile configs first")
    parser.add_argument("--out", default=None, help="write the results to this JSON file")
    parser.add_argument("--families", nargs="+", default=None,
                        help="with --sweep: only these kernel families (scaled, split, quad, "
                        "quad_reg, quad_swapped); default: all")  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels moe_mxfp4: needs a CUDA GPU")
        return 0
    experts = random_mxfp4_experts(V4_FLASH, "cuda")
    experts.update(w13_swapped=mxfp4.swap_bit_pairs(experts["w13"]),
                   w2_swapped=mxfp4.swap_bit_pairs(experts["w2"]))  # fmt: skip
    bf16 = dequantized_bf16(experts)
    results = dict(device=torch.cuda.get_device_name(), shape=V4_FLASH.__dict__, cases=[])
    for num_tokens in args.tokens:
        results["cases"].append(run_case(num_tokens, experts, bf16, args.sweep, args.families))
        print(json.dumps(results["cases"][-1]), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    return 0
