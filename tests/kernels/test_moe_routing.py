"""ops.moe_routing against the routers of transformers (DeepSeek V2/V3, Qwen3-MoE, Mixtral)."""

import pytest
import torch
from transformers import AutoConfig

from rayinfer.kernels import ops
from rayinfer.layers.fused_experts import (
    MIXTRAL_EXPERT_PROJECTIONS,
    FusedExperts,
    parse_expert_weight_name,
)
from rayinfer.layers.parallel import ParallelContext


def _sorted_by_id(weights, ids):
    """Routing results compared independently of the order of the k slots."""
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


def _assert_same_routing(ours, hf_weights, hf_ids):
    ours_weights, ours_ids = _sorted_by_id(ours.topk_weights, ours.topk_ids)
    hf_weights, hf_ids = _sorted_by_id(hf_weights.float(), hf_ids.long())
    torch.testing.assert_close(ours_ids, hf_ids, rtol=0, atol=0)
    torch.testing.assert_close(ours_weights, hf_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("num_tokens", [1, 7, 64])
@pytest.mark.parametrize("n_group,topk_group,top_k", [(4, 2, 3), (1, 1, 2), (8, 3, 6), (4, 4, 16)])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_deepseek_v3_noaux_tc(num_tokens, n_group, topk_group, top_k, norm_topk_prob):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = AutoConfig.for_model(
        "deepseek_v3", hidden_size=32, n_routed_experts=16, num_experts_per_tok=top_k,
        n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=2.5,
    )  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    generator = torch.Generator().manual_seed(num_tokens * 100 + top_k)
    router.weight.data.normal_(0, 0.5, generator=generator)
    router.e_score_correction_bias.normal_(0, 0.3, generator=generator)
    x = torch.randn(num_tokens, 32, generator=generator)
    logits, hf_weights, hf_ids = router(x)
    ours = ops.moe_routing(
        logits, top_k, scoring="sigmoid", renormalize=norm_topk_prob, num_groups=n_group,
        topk_groups=topk_group, correction_bias=router.e_score_correction_bias,
        routed_scaling_factor=2.5,
    )  # fmt: skip
    _assert_same_routing(ours, hf_weights, hf_ids)


@pytest.mark.parametrize("num_tokens", [1, 9, 64])
@pytest.mark.parametrize(
    "topk_method,n_group,topk_group,top_k",
    [("group_limited_greedy", 4, 2, 3), ("group_limited_greedy", 8, 1, 2), ("greedy", 1, 1, 4)],
)
def test_deepseek_v2_softmax(num_tokens, topk_method, n_group, topk_group, top_k):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = AutoConfig.for_model(
        "deepseek_v2", hidden_size=32, n_routed_experts=16, num_experts_per_tok=top_k,
        n_group=n_group, topk_group=topk_group, topk_method=topk_method,
        routed_scaling_factor=16.0,
    )  # fmt: skip
    router = DeepseekV2TopkRouter(config)
    generator = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    router.weight.data.normal_(0, 0.5, generator=generator)
    x = torch.randn(num_tokens, 32, generator=generator)
    logits, hf_weights, hf_ids = router(x)
    ours = ops.moe_routing(
        logits, top_k, scoring="softmax", num_groups=n_group, topk_groups=topk_group,
        routed_scaling_factor=16.0,
    )  # fmt: skip
    _assert_same_routing(ours, hf_weights, hf_ids)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_qwen3_moe_softmax(norm_topk_prob, top_k):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = AutoConfig.for_model(
        "qwen3_moe", hidden_size=32, num_experts=8, num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
    )  # fmt: skip
    router = Qwen3MoeTopKRouter(config)
    generator = torch.Generator().manual_seed(top_k)
    router.weight.data.normal_(0, 0.5, generator=generator)
    x = torch.randn(13, 32, generator=generator)
    logits, hf_weights, hf_ids = router(x)
    ours = ops.moe_routing(logits, top_k, scoring="softmax", renormalize=norm_topk_prob)
    _assert_same_routing(ours, hf_weights, hf_ids)


def test_mixtral_is_renormalized_softmax():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(11, 8, generator=generator)
    top_logits, top_ids = logits.topk(2, dim=-1)
    ours = ops.moe_routing(logits, 2, scoring="softmax", renormalize=True)
    _assert_same_routing(ours, top_logits.softmax(dim=-1), top_ids)


def test_correction_bias_changes_selection_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    plain = ops.moe_routing(logits, 1, scoring="sigmoid")
    biased = ops.moe_routing(logits, 1, scoring="sigmoid", correction_bias=bias)
    assert plain.topk_ids.tolist() == [[0]] and biased.topk_ids.tolist() == [[3]]
    torch.testing.assert_close(biased.topk_weights, torch.tensor([[-1.0]]).sigmoid())


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(top_k=9), "top_k=9"),
        (dict(top_k=2, scoring="relu"), "scoring='relu'"),
        (dict(top_k=2, num_groups=3), "n_group=3"),
        (dict(top_k=2, num_groups=4, topk_groups=5), "topk_group=5"),
        (dict(top_k=3, num_groups=4, topk_groups=1), "raise topk_group"),
    ],
)
def test_bad_arguments_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ops.moe_routing(torch.zeros(2, 8), **kwargs)


def test_expert_names_and_expert_parallel_loading():
    name = "model.layers.3.block_sparse_moe.experts.5.w3.weight"
    parsed = parse_expert_weight_name(name, MIXTRAL_EXPERT_PROJECTIONS)
    assert parsed == ("model.layers.3.block_sparse_moe", 5, "up")
    assert parse_expert_weight_name("model.layers.3.mlp.gate.weight") is None
    experts = FusedExperts(8, 4, 3, ParallelContext(ep_rank=1, ep_size=2))
    assert experts.w13.shape == (4, 6, 4) and experts.first_local_expert == 4
    assert not experts.load_expert_weight(2, "gate", torch.ones(3, 4))
    assert experts.load_expert_weight(5, "up", torch.ones(3, 4))
    assert experts.w13[1, 3:].eq(1).all()
    with pytest.raises(ValueError, match=r"expert 5 down: checkpoint shape \(3, 4\)"):
        experts.load_expert_weight(5, "down", torch.ones(3, 4))
