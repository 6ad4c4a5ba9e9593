"""MoE routing in one launch: router logits -> each token's top-k experts and combine weights.

The same five steps as `moe_routing.moe_routing_reference` (scores, correction bias, group-limited
selection, top-k, renormalization and scaling), one program per token with all E experts in
registers (scores: softmax, sigmoid or V4's sqrt(softplus), whose log1p is computed without
libdevice, accurate for logits far below zero). With torch ops the steps take ~4 launches per
MoE layer for softmax routers and ~15 for DeepSeek-V3's grouped sigmoid router; one launch each
is what a decode step wants (at batch 1 a step is bound by its kernel count, see
benchmarks/RESULTS.md).

Top-k is taken by repeated arg-max: ties go to the lowest expert id, and the k ids come out best
first, as `torch.topk` returns them (whose order among exact ties is unspecified).
"""

from __future__ import annotations

import torch

from rayinfer.kernels.moe.moe_routing import MoeRouting, check_routing_args
from rayinfer.kernels.triton_compat import tl, triton


@triton.jit
def _best(values, offs, BLOCK: tl.constexpr):
    """(max of values, the lowest index holding it)."""
    best = tl.max(values, 0)
    return best, tl.min(tl.where(values == best, offs, BLOCK), 0)


@triton.jit
def _log1p(y):
    """log(1 + y), accurate for tiny y without libdevice (Goldberg: log(u) * y / (u - 1))."""
    u = 1.0 + y
    is_tiny = u == 1.0
    return tl.where(is_tiny, y, tl.log(u) * (y / tl.where(is_tiny, 1.0, u - 1.0)))


@triton.jit
def _scores(logits, valid, SCORING: tl.constexpr):
    """[BLOCK_E] float32 router logits (-inf off the valid lanes) -> scores (0 off them)."""
    if SCORING == "sigmoid":
        scores = tl.where(valid, tl.sigmoid(logits), 0.0)
    elif SCORING == "sqrtsoftplus":  # softplus(x) = max(x, 0) + log1p(exp(-|x|)), then sqrt
        x = tl.where(valid, logits, 0.0)
        softplus = tl.maximum(x, 0.0) + _log1p(tl.exp(-tl.abs(x)))
        scores = tl.where(valid, tl.sqrt_rn(softplus), 0.0)
    else:
        exps = tl.exp(logits - tl.max(logits, 0))  # masked lanes: exp(-inf) = 0
        scores = exps / tl.sum(exps, 0)
    return scores


@triton.jit
def _kept_experts(choice, offs, valid, GROUP_SIZE: tl.constexpr, NUM_GROUPS: tl.constexpr,
                  TOPK_GROUPS: tl.constexpr, BY_TOP2_SUM: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr):  # fmt: skip
    """[BLOCK_E] bool: experts of the TOPK_GROUPS best groups (group score: its best choice, or
    the sum of its two best when BY_TOP2_SUM)."""
    group_of = offs // GROUP_SIZE
    groups = tl.arange(0, BLOCK_G)
    group_scores = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for g in tl.static_range(NUM_GROUPS):
        in_group = valid & (group_of == g)
        members = tl.where(in_group, choice, float("-inf"))
        best, at = _best(members, offs, BLOCK_E)
        score = best
        if BY_TOP2_SUM and GROUP_SIZE > 1:
            score += tl.max(tl.where(offs == at, float("-inf"), members), 0)
        group_scores = tl.where(groups == g, score, group_scores)
    kept_groups = groups < 0  # all False
    for _ in tl.static_range(TOPK_GROUPS):
        _, at = _best(group_scores, groups, BLOCK_G)
        kept_groups = kept_groups | (groups == at)
        group_scores = tl.where(groups == at, float("-inf"), group_scores)
    kept = offs < 0
    for g in tl.static_range(NUM_GROUPS):
        group_kept = tl.sum(tl.where(kept_groups & (groups == g), 1, 0), 0) > 0
        kept = kept | ((group_of == g) & group_kept)
    return kept


@triton.jit
def _moe_routing_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, stride_logits, scaling,
    TOP_K: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    GROUP_SIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    logits = tl.load(logits_ptr + token * stride_logits + offs, mask=valid, other=0.0)
    logits = tl.where(valid, logits.to(tl.float32), float("-inf"))
    scores = _scores(logits, valid, SCORING)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if NUM_GROUPS > 1 and TOPK_GROUPS < NUM_GROUPS:
        kept = _kept_experts(choice, offs, valid, GROUP_SIZE, NUM_GROUPS, TOPK_GROUPS, HAS_BIAS,
                             BLOCK_E, BLOCK_G)  # fmt: skip
        choice = tl.where(kept, choice, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int64)
    weights = tl.zeros([BLOCK_K], tl.float32)
    for k in tl.static_range(TOP_K):
        _, at = _best(choice, offs, BLOCK_E)
        at = tl.minimum(at, num_experts - 1)  # NaN scores match no lane: still a real expert
        ids = tl.where(slots == k, at.to(tl.int64), ids)
        weights = tl.where(slots == k, tl.sum(tl.where(offs == at, scores, 0.0), 0), weights)
        choice = tl.where(offs == at, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    weights = weights * scaling
    tl.store(ids_ptr + token * TOP_K + slots, ids, mask=slots < TOP_K)
    tl.store(weights_ptr + token * TOP_K + slots, weights, mask=slots < TOP_K)


def moe_routing(
    router_logits: torch.Tensor,  # [T, E] any float dtype, rows contiguous
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = False,
    num_groups: int = 1,
    topk_groups: int = 1,
    correction_bias: torch.Tensor | None = None,  # [E]: added for selection only (noaux_tc)
    routed_scaling_factor: float = 1.0,
) -> MoeRouting:  # ([T, K] float32, [T, K] int64)
    num_tokens, num_experts = router_logits.shape
    check_routing_args(num_experts, top_k, scoring, num_groups, topk_groups)
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    if num_tokens == 0:
        return MoeRouting(weights, ids)
    # unread without a bias; else read as one dense row
    bias = correction_bias.contiguous() if correction_bias is not None else weights
    block_e = triton.next_power_of_2(num_experts)
    _moe_routing_kernel[(num_tokens,)](
        router_logits, bias, weights, ids, num_experts, router_logits.stride(0),
        float(routed_scaling_factor),
        TOP_K=top_k, SCORING=scoring, HAS_BIAS=correction_bias is not None,
        RENORMALIZE=renormalize, NUM_GROUPS=num_groups, TOPK_GROUPS=topk_groups,
        GROUP_SIZE=num_experts // num_groups, BLOCK_E=block_e,
        BLOCK_G=triton.next_power_of_2(num_groups), BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=1 if block_e <= 128 else 4,
    )  # fmt: skip
    return MoeRouting(weights, ids)
