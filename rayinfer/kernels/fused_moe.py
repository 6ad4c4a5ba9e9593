"""Routed experts: every token runs through its top-k experts' SwiGLU MLPs, weighted and summed."""

from __future__ import annotations

import torch

from rayinfer.kernels.activation import silu_and_mul_reference


def fused_moe_reference(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows then up rows of each expert
    w2: torch.Tensor,  # [E, H, I]: down projection of each expert
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int64: expert of each (token, slot); E_local ids
) -> torch.Tensor:  # [T, H]
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(x, dtype=torch.float32)
    flat_ids = topk_ids.reshape(-1)  # [T*K]
    token_of_slot = torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)  # [T*K]
    weight_of_slot = topk_weights.reshape(-1)  # [T*K]
    for expert in flat_ids.unique().tolist():
        if expert < 0 or expert >= w13.shape[0]:
            continue  # a slot routed to an expert this rank does not hold
        slots = (flat_ids == expert).nonzero(as_tuple=True)[0]  # [n]
        tokens = token_of_slot[slots]  # [n]
        hidden = silu_and_mul_reference(x[tokens] @ w13[expert].t())  # [n, I]
        expert_out = hidden @ w2[expert].t()  # [n, H]
        out.index_add_(0, tokens, expert_out.float() * weight_of_slot[slots, None].float())
    return out.to(x.dtype)
