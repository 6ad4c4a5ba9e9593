"""Llama, Qwen2 and Qwen3 against transformers: prefill logits and 20 greedy tokens, float32."""

import pytest
import torch

from tests.models.harness import TINY_DENSE, assert_matches_transformers, make_hf_checkpoint

LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)
LINEAR_ROPE = dict(rope_type="linear", rope_theta=500.0, factor=2.0)
YARN_ROPE = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64
)
CASES = {
    "llama": ("llama", {}),
    "llama3-rope-tied": ("llama", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)),
    "llama-linear-rope-bias": ("llama", dict(rope_parameters=LINEAR_ROPE, attention_bias=True)),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=24)),
    "qwen3-yarn-rope": ("qwen3", dict(rope_parameters=YARN_ROPE)),
    "qwen3-mha": ("qwen3", dict(num_key_value_heads=4, attention_bias=True)),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    model_type, overrides = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return make_hf_checkpoint(folder, model_type, **{**TINY_DENSE, **overrides})


def test_prefill_and_greedy_match_transformers(checkpoint):
    assert_matches_transformers(checkpoint)


def test_chunked_prefill_and_mixed_batches_match_transformers(checkpoint):
    # 4-token chunks over the cached prefix; sequences joining late share steps with decodes.
    assert_matches_transformers(checkpoint, chunk_size=4, start_steps=[0, 3, 1, 6], block_size=3)


def test_sliding_window_config_is_refused():
    from rayinfer.config import ModelConfig
    from rayinfer.models.llama import LlamaForCausalLM

    hf = dict(TINY_DENSE, architectures=["LlamaForCausalLM"], sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window=8"):
        LlamaForCausalLM(ModelConfig.from_hf_dict(hf))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_matches_transformers_on_cuda(checkpoint):
    assert_matches_transformers(checkpoint, device="cuda", chunk_size=4, start_steps=[0, 3, 1, 6])
