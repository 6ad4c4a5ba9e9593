"""The one-launch MoE routing kernel (Triton, interpreter on CPU) against the torch reference that
tests/kernels/test_moe_routing.py checks against transformers' routers: same experts, best first,
same weights; for softmax and sigmoid scoring, with and without DeepSeek-V3's correction bias,
group-limited selection (V2 by the group's best, V3 by its two best), renormalization, scaling,
odd expert counts, one token, no tokens and top-k equal to the number of experts."""

import pytest
import torch

from rayinfer.kernels.moe.moe_routing import moe_routing_reference
from rayinfer.kernels.moe.moe_routing_kernel import moe_routing

CASES = {
    # name: (num_experts, top_k, scoring, renormalize, num_groups, topk_groups, bias, scaling)
    "qwen3-softmax-renorm": (8, 2, "softmax", True, 1, 1, False, 1.0),
    "mixtral-odd-experts": (60, 4, "softmax", True, 1, 1, False, 1.0),
    "v2-greedy": (64, 6, "softmax", False, 1, 1, False, 1.0),
    "v2-group-limited": (16, 3, "softmax", False, 4, 2, False, 16.0),
    "v3-noaux-tc": (32, 8, "sigmoid", True, 8, 4, True, 2.5),
    "v3-groups-of-one": (8, 2, "sigmoid", True, 8, 3, True, 2.5),
    "topk-all-experts": (16, 16, "softmax", False, 4, 4, False, 1.0),
    "sigmoid-no-bias": (16, 4, "sigmoid", False, 1, 1, False, 1.0),
}


@pytest.mark.parametrize("num_tokens", [1, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_routes_like_the_reference(case, dtype, num_tokens):
    num_experts, top_k, scoring, renormalize, groups, topk_groups, has_bias, scaling = CASES[case]
    generator = torch.Generator().manual_seed(num_experts * 31 + top_k + num_tokens)
    logits = (torch.randn(num_tokens, num_experts, generator=generator) * 2).to(dtype)
    bias = torch.randn(num_experts, generator=generator) * 0.3 if has_bias else None
    args = (logits, top_k, scoring, renormalize, groups, topk_groups, bias, scaling)
    ours, expected = moe_routing(*args), moe_routing_reference(*args)
    assert ours.topk_ids.dtype == torch.int64 and ours.topk_weights.dtype == torch.float32
    assert torch.equal(ours.topk_ids, expected.topk_ids)  # the same experts, best first
    torch.testing.assert_close(ours.topk_weights, expected.topk_weights, rtol=1e-5, atol=1e-6)


def test_no_tokens_and_bad_arguments():
    empty = moe_routing(torch.zeros(0, 8), 2)
    assert empty.topk_ids.shape == (0, 2) and empty.topk_weights.shape == (0, 2)
    with pytest.raises(ValueError, match="top_k=9 must be in 1..num_experts=8"):
        moe_routing(torch.zeros(3, 8), 9)


@pytest.mark.parametrize("case", ["v2-greedy", "v3-noaux-tc", "mixtral-odd-experts"])
def test_a_nan_row_names_real_experts_and_leaves_the_others_alone(case):
    """A NaN row (e.g. a padding row that read a cache block never written) matches no lane in
    the top-k's argmax; its ids must still name experts the fused MoE can index, and the other
    rows route as without it."""
    num_experts, top_k, scoring, renormalize, groups, topk_groups, has_bias, scaling = CASES[case]
    logits = torch.randn(3, num_experts, generator=torch.Generator().manual_seed(7))
    logits[1] = float("nan")
    bias = torch.zeros(num_experts) if has_bias else None
    args = (top_k, scoring, renormalize, groups, topk_groups, bias, scaling)
    routed = moe_routing(logits, *args)
    assert 0 <= int(routed.topk_ids.min()) and int(routed.topk_ids.max()) < num_experts
    expected = moe_routing_reference(logits[[0, 2]], *args)
    assert torch.equal(routed.topk_ids[[0, 2]], expected.topk_ids)
