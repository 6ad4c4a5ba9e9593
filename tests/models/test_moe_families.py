"""Qwen3-MoE and Mixtral against transformers: prefill logits and 20 greedy tokens, float32."""

import pytest
import torch

from tests.models.harness import TINY_DENSE, assert_matches_transformers, make_hf_checkpoint

TINY_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
CASES = {
    "qwen3_moe-norm-topk": ("qwen3_moe", dict(TINY_MOE, num_experts=8, norm_topk_prob=True)),
    "qwen3_moe-no-norm-dense-layer": (
        "qwen3_moe",
        dict(TINY_MOE, num_experts=8, norm_topk_prob=False, mlp_only_layers=[1], head_dim=24),
    ),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    model_type, overrides = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return make_hf_checkpoint(folder, model_type, **{**TINY_DENSE, **overrides})


def test_prefill_and_greedy_match_transformers(checkpoint):
    assert_matches_transformers(checkpoint)


def test_chunked_prefill_and_mixed_batches_match_transformers(checkpoint):
    assert_matches_transformers(checkpoint, chunk_size=4, start_steps=[0, 3, 1, 6], block_size=3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_matches_transformers_on_cuda(checkpoint):
    assert_matches_transformers(checkpoint, device="cuda", chunk_size=4, start_steps=[0, 3, 1, 6])
