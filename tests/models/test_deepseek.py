"""DeepSeek V2/V3 against transformers: prefill logits and 20 greedy tokens, float32.

The checkpoints exercise MLA with and without q_lora_rank, YaRN (with mscale != mscale_all_dim),
both rope layouts, V3 sigmoid routing with a non-zero correction bias and group-limited top-k, V2
softmax group_limited_greedy, a dense first layer and shared experts.
"""

from importlib import import_module

import pytest
import torch
from safetensors.torch import load_file

from rayinfer.config import ConfigError, ModelConfig
from rayinfer.layers.forward_context import ForwardContext, build_attention_metadata
from rayinfer.layers.mla import MLAAttention
from rayinfer.layers.rotary_yarn import DeepseekRotaryEmbedding, softmax_scale
from rayinfer.models.deepseek import DeepseekForCausalLM
from tests.models.harness import (
    TINY_MLA,
    allocate_caches,
    assert_matches_transformers,
    load_rayinfer,
    make_deepseek_checkpoint,
    make_prompts,
)

YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=0.8,
)
CASES = {
    "v3-q-lora": ("deepseek_v3", dict(q_lora_rank=24, n_group=4, topk_group=2, n_shared_experts=1)),
    "v3-yarn-neox": (
        "deepseek_v3",
        dict(
            q_lora_rank=None,
            n_group=2,
            topk_group=1,
            n_shared_experts=2,
            norm_topk_prob=False,
            rope_parameters=YARN,
            rope_interleave=False,
        ),
    ),
    "v2-group-limited": (
        "deepseek_v2",
        dict(
            q_lora_rank=None,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            n_shared_experts=2,
            routed_scaling_factor=2.0,
        ),
    ),
    "v2-yarn-q-lora-greedy": (
        "deepseek_v2",
        dict(q_lora_rank=24, topk_method="greedy", n_shared_experts=1, rope_parameters=YARN),
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    model_type, overrides = CASES[request.param]
    return make_deepseek_checkpoint(tmp_path_factory.mktemp(request.param), model_type, **overrides)


def test_prefill_and_greedy_match_transformers(checkpoint):
    assert_matches_transformers(checkpoint)


def test_chunked_prefill_and_mixed_batches_match_transformers(checkpoint):
    # 3-token chunks over the cached latent prefix; late joiners share steps with decodes.
    assert_matches_transformers(checkpoint, chunk_size=3, start_steps=[0, 2, 1, 5], block_size=3)


def test_correction_bias_is_loaded_and_nonzero(checkpoint):
    model, config = load_rayinfer(checkpoint)
    routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert routers, "every case has an MoE layer"
    if config.architecture == "DeepseekV3ForCausalLM":
        bias = routers[0].e_score_correction_bias
        assert bias.abs().min() > 0
        stored = load_file(checkpoint / "model.safetensors")[
            "model.layers.1.mlp.gate.e_score_correction_bias"
        ]
        torch.testing.assert_close(bias, stored, rtol=0, atol=0)
    else:
        assert routers[0].e_score_correction_bias is None


@torch.no_grad()
def test_absorbed_decode_equals_expanded(tmp_path, monkeypatch):
    path = make_deepseek_checkpoint(tmp_path, "deepseek_v3", **CASES["v3-q-lora"][1])
    model, config = load_rayinfer(path)
    prompts = make_prompts(config.vocab_size)
    lengths = [len(p) for p in prompts]
    tables = [[4 * i + b for b in range(4)] for i in range(len(prompts))]  # 4 blocks of 8 each
    caches = allocate_caches(config, num_blocks=4 * len(prompts), block_size=8, dtype=torch.float32)
    prefill = build_attention_metadata(lengths, lengths, tables, block_size=8)
    positions = torch.cat([torch.arange(n) for n in lengths])
    model(torch.tensor(sum(prompts, [])), positions, ForwardContext(prefill, caches))
    decode = build_attention_metadata([1] * 4, [n + 1 for n in lengths], tables, block_size=8)
    next_ids, next_positions = torch.tensor([5, 6, 7, 8]), torch.tensor(lengths)
    absorbed = model(next_ids, next_positions, ForwardContext(decode, caches))  # [4, H]
    monkeypatch.setattr(MLAAttention, "use_absorbed_decode", False)
    expanded = model(next_ids, next_positions, ForwardContext(decode, caches))  # [4, H]
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)
    assert not torch.equal(absorbed[0], absorbed[1])


def test_cache_holds_the_latent_not_expanded_kv(tmp_path):
    path = make_deepseek_checkpoint(tmp_path, "deepseek_v3", **CASES["v3-q-lora"][1])
    config = ModelConfig.from_pretrained(path)
    assert config.kv_shape_per_token(4) == (16 + 8,)


@pytest.mark.parametrize(
    "model_type,rope",
    [
        # DeepSeek-V3's config.json, and DeepSeek-V2-Lite's (mscale == mscale_all_dim != 1)
        ("deepseek_v3", dict(factor=40.0, mscale=1.0, mscale_all_dim=1.0, beta_fast=32)),
        ("deepseek_v2", dict(factor=40.0, mscale=0.707, mscale_all_dim=0.707, beta_fast=32)),
        ("deepseek_v3", dict(factor=8.0, mscale=1.0, mscale_all_dim=0.5, truncate=False)),
    ],
)
def test_yarn_frequencies_and_scales_match_transformers(model_type, rope):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    module = import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    scaling = dict(rope_type="yarn", rope_theta=10000.0, original_max_position_embeddings=4096)
    scaling.update(beta_slow=1, **rope)
    hf_config = AutoConfig.for_model(
        model_type, qk_rope_head_dim=64, qk_nope_head_dim=128, max_position_embeddings=163840,
        rope_parameters=scaling,
    )  # fmt: skip
    hf_inv_freq, hf_attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    rotary = DeepseekRotaryEmbedding(64, 10000.0, scaling, 163840, is_interleaved=True)
    torch.testing.assert_close(rotary.inv_freq, hf_inv_freq, rtol=1e-6, atol=0)
    assert rotary.attention_factor == pytest.approx(hf_attention_factor, rel=1e-7)
    hf_scale = module.yarn_apply_mscale(hf_config.rope_parameters, 192**-0.5)
    assert softmax_scale(192, scaling) == pytest.approx(hf_scale, rel=1e-7)
    assert softmax_scale(192, scaling) != pytest.approx(192**-0.5)


def _config(**overrides) -> ModelConfig:
    hf = {**TINY_MLA, "architectures": ["DeepseekV3ForCausalLM"], "q_lora_rank": None}
    hf.update(n_group=1, topk_group=1, n_shared_experts=1, **overrides)
    return ModelConfig.from_hf_dict(hf)


def test_dense_layers_follow_first_k_dense_replace_and_moe_layer_freq():
    config = _config(num_hidden_layers=5, first_k_dense_replace=1, moe_layer_freq=2)
    assert [config.is_moe_layer(i) for i in range(5)] == [False, False, True, False, True]


def test_unknown_v2_topk_method_is_refused():
    hf = {**TINY_MLA, "architectures": ["DeepseekV2ForCausalLM"], "topk_method": "sinkhorn"}
    with pytest.raises(ConfigError, match="topk_method='sinkhorn'"):
        DeepseekForCausalLM(ModelConfig.from_hf_dict(hf))


def test_load_weights_skips_mtp_layers_and_names_bad_tensors(tmp_path):
    path = make_deepseek_checkpoint(tmp_path, "deepseek_v3", **CASES["v3-q-lora"][1])
    state = load_file(path / "model.safetensors")
    config = ModelConfig.from_pretrained(path)
    model = DeepseekForCausalLM(config)
    extra = {
        "model.layers.2.eh_proj.weight": torch.zeros(64, 128),  # an MTP layer of a V3 checkpoint
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4),
    }
    model.load_weights([*state.items(), *extra.items()])
    bad_name = "model.layers.1.mlp.experts.3.down_proj.weight"
    bad = {**state, bad_name: torch.zeros(32, 64)}
    with pytest.raises(ValueError, match=rf"{bad_name}.*checkpoint shape \(32, 64\)"):
        model.load_weights(bad.items())
    with pytest.raises(ValueError, match="model.layers.0.mlp.gate.weight.*no such parameter"):
        model.load_weights([("model.layers.0.mlp.gate.weight", torch.zeros(8, 64))])
    missing = {k: v for k, v in state.items() if "kv_b_proj" not in k}
    with pytest.raises(ValueError, match="kv_b_proj"):
        model.load_weights(missing.items())
