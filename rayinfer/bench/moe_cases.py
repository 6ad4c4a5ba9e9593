"""Problems, torch baselines and correctness checks for `python -m rayinfer.bench kernels moe`.

Weights are drawn on the GPU (the DeepSeek-V3 experts are 22.5 GB in bf16), never on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rayinfer.kernels.fp8.fp8_gemm import fp8_gemm, fp8_gemm_reference
from rayinfer.kernels.fp8.fp8_quant import fp8_quant, fp8_quant_reference
from rayinfer.kernels.moe.fused_moe import fused_moe, fused_moe_fp8_reference
from rayinfer.kernels.moe.moe_align import moe_align, moe_align_reference

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


@dataclass(frozen=True)
class MoeShape:
    num_experts: int = 256
    hidden: int = 7168
    intermediate: int = 2048
    top_k: int = 8


MOE_SHAPES = {
    "deepseek-v3": MoeShape(),
    "deepseek-v2-lite": MoeShape(num_experts=64, hidden=2048, intermediate=1408, top_k=6),
    "deepseek-v4-flash": MoeShape(num_experts=256, hidden=4096, intermediate=2048, top_k=6),
    "glm-5": MoeShape(num_experts=256, hidden=6144, intermediate=2048, top_k=8),
}


@dataclass
class Experts:
    w13: torch.Tensor  # [E, 2I, H] bf16 or fp8
    w2: torch.Tensor  # [E, H, I]
    w13_scale: torch.Tensor | None = None  # [E, 2I/128, H/128] float32
    w2_scale: torch.Tensor | None = None  # [E, H/128, I/128] float32


def random_experts(shape: MoeShape, fp8: bool, device, chunk: int = 32) -> Experts:
    """Random experts with the checkpoint's magnitude (about 1/sqrt(fan_in)), filled by chunks."""
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    w13 = torch.empty(e, 2 * i, h, dtype=FP8 if fp8 else BF16, device=device)
    w2 = torch.empty(e, h, i, dtype=w13.dtype, device=device)
    for w, fan_in in ((w13, h), (w2, i)):
        for start in range(0, e, chunk):
            part = torch.randn(w[start : start + chunk].shape, dtype=BF16, device=device)
            w[start : start + chunk] = part if fp8 else part.mul_(fan_in**-0.5)
    if not fp8:
        return Experts(w13, w2)

    def scales(w, fan_in):  # fp8 values ~N(0, 1): block scales near 1/sqrt(fan_in)
        blocks = (e, -(-w.shape[1] // 128), -(-w.shape[2] // 128))
        return (torch.rand(blocks, device=device) + 0.5) * fan_in**-0.5

    return Experts(w13, w2, scales(w13, h), scales(w2, i))


def random_routing(num_tokens: int, shape: MoeShape, device, seed: int = 0):
    """Uniformly random top-k experts per token with softmax weights: [T, K] f32, [T, K] i64."""
    generator = torch.Generator(device=device).manual_seed(seed)
    scores = torch.randn(num_tokens, shape.num_experts, device=device, generator=generator)
    weights, ids = scores.softmax(-1).topk(shape.top_k, dim=-1)
    return weights, ids


def grouped_mm_moe(x, experts: Experts, topk_weights, topk_ids):
    """Baseline: sort slots by expert, two `torch._grouped_mm` calls, weighted scatter-add."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.view(-1)  # [T*K]
    order = flat_ids.argsort()  # [T*K]
    ends = torch.bincount(flat_ids, minlength=experts.w13.shape[0]).cumsum(0).to(torch.int32)
    token_of_row = order // top_k  # [T*K]
    gate_up = torch._grouped_mm(x[token_of_row], experts.w13.transpose(1, 2), offs=ends)
    gate, up = gate_up.chunk(2, dim=-1)
    down = torch._grouped_mm(F.silu(gate) * up, experts.w2.transpose(1, 2), offs=ends)
    down = down * topk_weights.view(-1)[order, None]  # [T*K, H]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, token_of_row, down.float()).to(x.dtype)


def per_expert_loop_moe(x, experts: Experts, topk_weights, topk_ids):
    """Baseline: one pair of matmuls per expert that has tokens (host sync per expert)."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.view(-1)
    for expert in flat_ids.unique().tolist():
        slots = (flat_ids == expert).nonzero(as_tuple=True)[0]
        tokens = slots // top_k
        gate, up = (x[tokens] @ experts.w13[expert].t()).chunk(2, dim=-1)
        down = (F.silu(gate) * up) @ experts.w2[expert].t()
        out.index_add_(0, tokens, down.float() * topk_weights.view(-1)[slots, None])
    return out.to(x.dtype)


def float32_moe_reference(x, experts: Experts, topk_weights, topk_ids):
    """bf16 experts computed in float32, one expert at a time (upcast on the fly)."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.view(-1)
    for expert in flat_ids.unique().tolist():
        slots = (flat_ids == expert).nonzero(as_tuple=True)[0]
        tokens = slots // top_k
        gate, up = (x[tokens].float() @ experts.w13[expert].float().t()).chunk(2, dim=-1)
        down = (F.silu(gate) * up) @ experts.w2[expert].float().t()
        out.index_add_(0, tokens, down * topk_weights.view(-1)[slots, None])
    return out


def held_slots_only(topk_weights, topk_ids, num_held: int):
    """Routing for a reference that holds only experts [0, num_held): other slots get weight 0
    and expert 0 (so they add nothing), as the kernels skip ids outside the held range."""
    held = topk_ids < num_held
    return topk_weights * held, torch.where(held, topk_ids, 0)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check_moe_align(shape: MoeShape, device) -> float:
    """0.0 when the GPU alignment of 4,096 tokens equals the reference (runs sorted)."""
    _, ids = random_routing(4096, shape, device, seed=1)
    ours = moe_align(ids, shape.num_experts, 64)
    ref = moe_align_reference(ids.cpu(), shape.num_experts, 64)
    experts = ours.block_expert_ids.cpu().repeat_interleave(64)
    ours_ids, ref_ids = ours.sorted_slot_ids.cpu(), ref.sorted_slot_ids.clone()
    for expert in range(shape.num_experts):
        rows = (experts == expert).nonzero(as_tuple=True)[0]
        ours_ids[rows], ref_ids[rows] = ours_ids[rows].sort().values, ref_ids[rows].sort().values
    same = torch.equal(ours_ids, ref_ids) and torch.equal(ours.block_expert_ids.cpu(), ref[1])
    return 0.0 if same and ours.num_padded_slots.item() == ref[2].item() else 1.0


def correctness_checks(shape: MoeShape, bf16: Experts, fp8: Experts, device) -> dict:
    """Relative errors against float32 references on random (never zero) inputs."""
    results = {"moe_align_mismatch": check_moe_align(shape, device)}
    x = torch.randn(4096, shape.hidden, dtype=BF16, device=device)
    q, scale = fp8_quant(x)
    q_ref, scale_ref = fp8_quant_reference(x)
    results["fp8_quant_max_abs_diff"] = max(
        (q.float() - q_ref.float()).abs().max().item(), (scale - scale_ref).abs().max().item()
    )
    for n, k in ((7168, 2048), (4096, 7168), (24576, 1536)):
        a, a_scale = fp8_quant(torch.randn(256, k, dtype=BF16, device=device))
        b = torch.randn(n, k, device=device).to(FP8)
        b_scale = torch.rand(-(-n // 128), -(-k // 128), device=device) + 0.5
        ref = fp8_gemm_reference(a, a_scale, b, b_scale, torch.float32)
        results[f"fp8_gemm_N{n}_K{k}"] = relative_error(fp8_gemm(a, a_scale, b, b_scale), ref)
    weights, ids = random_routing(256, shape, device, seed=2)
    x = torch.randn(256, shape.hidden, dtype=BF16, device=device)
    ref = float32_moe_reference(x, bf16, weights, ids)
    results["fused_moe_bf16"] = relative_error(fused_moe(x, bf16.w13, bf16.w2, weights, ids), ref)
    results["grouped_mm_bf16"] = relative_error(grouped_mm_moe(x, bf16, weights, ids), ref)
    small = Experts(fp8.w13[:8], fp8.w2[:8], fp8.w13_scale[:8], fp8.w2_scale[:8])
    ids = ids[:64] % 8
    args = (x[:64], small.w13, small.w2, weights[:64], ids, small.w13_scale, small.w2_scale)
    results["fused_moe_fp8"] = relative_error(fused_moe(*args), fused_moe_fp8_reference(*args))
    return results
