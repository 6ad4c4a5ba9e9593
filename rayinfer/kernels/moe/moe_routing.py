"""MoE routing: router logits -> each token's top-k experts and their combine weights.

One op covers every family (see `rayinfer.layers.moe.RoutingMethod` for the per-family settings):
  1. scores = softmax(logits), sigmoid(logits) or sqrt(softplus(logits)) (DeepSeek-V4)  # [T, E]
  2. choice = scores + correction_bias (DeepSeek-V3 `noaux_tc`; selection only)
  3. group-limited top-k (num_groups > 1): keep the `topk_groups` best groups of E / num_groups
     experts, scored by the sum of each group's two best choice scores when a correction bias is
     given (V3) and by the group's best score otherwise (V2 `group_limited_greedy`)
  4. topk_ids = top-k of the kept choice scores; topk_weights = scores (no bias) at those ids
  5. optional renormalization to sum 1, then multiplication by `routed_scaling_factor`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SCORING_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")


def routing_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """[T, E] float32 logits -> [T, E] scores (transformers' ACT2FN[scoring] for V4's
    "sqrtsoftplus": softplus(x).sqrt(), softplus with its default threshold 20)."""
    if scoring == "softmax":
        return logits.softmax(dim=-1)
    if scoring == "sigmoid":
        return logits.sigmoid()
    return torch.nn.functional.softplus(logits).sqrt()


class MoeRouting(NamedTuple):
    topk_weights: torch.Tensor  # [T, K] float32: combine weight of each chosen expert
    topk_ids: torch.Tensor  # [T, K] int64: global expert ids, best first


def _group_mask(choice: torch.Tensor, num_groups: int, topk_groups: int, by_top2_sum: bool):
    """[T, E] choice scores -> [T, E] bool: True for experts in the kept groups."""
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)  # [T, G, E/G]
    if by_top2_sum:
        top2 = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values  # [T, G, 2]
        group_scores = top2.sum(dim=-1)  # [T, G]
    else:
        group_scores = grouped.max(dim=-1).values  # [T, G]
    kept_groups = group_scores.topk(topk_groups, dim=-1).indices  # [T, topk_groups]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
    group_mask.scatter_(1, kept_groups, True)  # [T, G]
    return group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)


def check_routing_args(
    num_experts: int, top_k: int, scoring: str, num_groups: int, topk_groups: int
):
    if scoring not in SCORING_FUNCTIONS:
        raise ValueError(f"scoring={scoring!r}; use one of {SCORING_FUNCTIONS}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in 1..num_experts={num_experts}")
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"n_group={num_groups} must divide n_routed_experts={num_experts}")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_group={topk_groups} must be in 1..n_group={num_groups}")
    if top_k > topk_groups * (num_experts // num_groups):
        raise ValueError(
            f"top_k={top_k} exceeds the {topk_groups * (num_experts // num_groups)} experts "
            f"of topk_group={topk_groups} groups; raise topk_group"
        )


def moe_routing_reference(
    router_logits: torch.Tensor,  # [T, E]: router output, any float dtype
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = False,
    num_groups: int = 1,
    topk_groups: int = 1,
    correction_bias: torch.Tensor | None = None,  # [E]: added for selection only (noaux_tc)
    routed_scaling_factor: float = 1.0,
) -> MoeRouting:
    num_experts = router_logits.shape[-1]
    check_routing_args(num_experts, top_k, scoring, num_groups, topk_groups)
    logits = router_logits.float()
    scores = routing_scores(logits, scoring)  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.float()  # [T, E]
    if num_groups > 1 and topk_groups < num_groups:
        keep = _group_mask(choice, num_groups, topk_groups, correction_bias is not None)
        choice = choice.masked_fill(~keep, float("-inf"))  # [T, E]
    topk_ids = choice.topk(top_k, dim=-1).indices  # [T, K]
    topk_weights = scores.gather(1, topk_ids)  # [T, K]
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return MoeRouting(topk_weights, topk_ids.to(torch.int64))
