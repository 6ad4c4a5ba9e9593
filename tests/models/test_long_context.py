"""Long prompts through many prefill chunks and many cache blocks stay token-exact with
transformers (MLA latent cache and GQA K/V cache), prefix caching on."""

import pytest
import torch

import rayinfer
from tests.models.harness import TINY_DENSE, TINY_MLA, make_hf_checkpoint

CASES = {
    "deepseek_v3": dict(TINY_MLA, q_lora_rank=24, n_group=4, topk_group=2, n_shared_experts=1),
    "qwen3_moe": dict(
        TINY_DENSE, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32
    ),
}


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_long_prompt_in_many_chunks_matches_transformers(tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    config = dict(CASES[model_type], max_position_embeddings=2048)
    path = make_hf_checkpoint(tmp_path, model_type, **config)
    prompt = torch.randint(
        0, config["vocab_size"], (1500,), generator=torch.Generator().manual_seed(3)
    )
    llm = rayinfer.LLM(str(path), device="cpu", max_num_batched_tokens=256, block_size=16)
    params = rayinfer.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ours = llm.generate(prompt.tolist(), params)[0].token_ids
    again = llm.generate(prompt.tolist(), params)[0]  # this time mostly from the prefix cache
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.inference_mode():
        expected = reference.generate(
            prompt[None], max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None
        )[0, 1500:].tolist()
    assert ours == expected
    assert again.token_ids == expected and again.num_cached_tokens == 1488
