"""DeepSeek-V4's router scoring, "sqrtsoftplus", in the routing reference and the one-launch
kernel (interpreter on CPU), against a float64 version of transformers' DeepseekV4TopKRouter:
scores = softplus(logits).sqrt(), ids = topk(scores + e_score_correction_bias), weights = the
scores at those ids, renormalized w / (w.sum() + 1e-20), times routed_scaling_factor."""

import pytest
import torch
import torch.nn.functional as F

from rayinfer.kernels import ops
from rayinfer.kernels.moe.moe_routing import moe_routing_reference
from rayinfer.kernels.moe.moe_routing_kernel import moe_routing


def _v4_router(logits: torch.Tensor, top_k: int, bias: torch.Tensor, scaling: float):
    scores = F.softplus(logits.double()).sqrt()
    ids = torch.topk(scores + bias.double(), top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scaling, ids


@pytest.mark.parametrize("route", [moe_routing_reference, moe_routing, ops.moe_routing],
                         ids=["reference", "kernel", "ops"])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k", [(1, 16, 6), (9, 60, 6), (4, 8, 8)],
    ids=["one-token", "odd-experts", "topk-all-experts"],
)  # fmt: skip
def test_routes_like_transformers(route, dtype, num_tokens, num_experts, top_k):
    gen = torch.Generator().manual_seed(num_experts + num_tokens)
    # Spread over softplus's regimes: far below zero (log1p of a tiny exp), near zero, past 20.
    logits = (torch.randn(num_tokens, num_experts, generator=gen) * 8).to(dtype)
    logits[0, :3] = torch.tensor([-30.0, 25.0, 0.0], dtype=dtype)
    bias = torch.randn(num_experts, generator=gen) * 0.1
    ours = route(logits, top_k, "sqrtsoftplus", True, 1, 1, bias, 1.5)
    weights, ids = _v4_router(logits, top_k, bias, 1.5)
    assert torch.equal(ours.topk_ids.sort(-1).values, ids.sort(-1).values)
    order = ours.topk_ids.argsort(-1)  # transformers takes topk unsorted: compare by expert id
    expected = weights.gather(1, ids.argsort(-1))
    torch.testing.assert_close(ours.topk_weights.gather(1, order).double(), expected,
                               rtol=1e-6, atol=1e-7)  # fmt: skip


def test_kernel_scores_tiny_softplus_accurately():
    """softplus(-30) = 9.4e-14: a plain log(1 + exp(x)) in float32 gives 0 there."""
    logits = torch.tensor([[-30.0, -25.0, -40.0, -35.0]])
    ours = moe_routing(logits, 2, "sqrtsoftplus", False, 1, 1, None, 1.0)
    weights, ids = _v4_router(logits, 2, torch.zeros(4), 1.0)
    assert ours.topk_ids.tolist() == [[1, 0]]
    raw = F.softplus(logits.double()).sqrt()[0, [1, 0]]
    torch.testing.assert_close(ours.topk_weights[0].double(), raw, rtol=1e-6, atol=0)
