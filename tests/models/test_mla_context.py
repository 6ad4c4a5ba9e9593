"""MLA attention over a long cached context in bounded blocks (layers/mla_context.py): the merge
by log-sum-exp is exact, the blocked chunk equals the one-shot expansion, and a model whose
blocks are forced small stays token-exact with transformers."""

import pytest
import torch

import rayinfer
from rayinfer.config import ModelConfig
from rayinfer.kernels.attention.prefill_attention import prefill_attention_reference
from rayinfer.layers.mla import MLAAttention
from rayinfer.layers.mla_context import context_block_tokens, merge_attention
from tests.models.harness import TINY_MLA, make_hf_checkpoint


@pytest.mark.parametrize("split", [1, 17, 39])
def test_merging_two_parts_equals_attention_over_all_keys(split):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(6, 3, 16, generator=generator)
    key = torch.randn(40, 3, 16, generator=generator)
    value = torch.randn(40, 3, 8, generator=generator)

    def attend(keys):  # every key visible: (out [6, 3, 8], lse [6, 3])
        lse = torch.empty(6, 3)
        cu_q, cu_k = torch.tensor([0, 6]).int(), torch.tensor([0, keys.stop - keys.start]).int()
        out = prefill_attention_reference(query, key[keys], value[keys], cu_q, cu_k, 6, 0.3,
                                          is_causal=False, lse=lse)  # fmt: skip
        return out, lse

    out, lse = attend(slice(0, split))
    merge_attention(out, lse, *attend(slice(split, 40)))
    expected, expected_lse = attend(slice(0, 40))
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, expected_lse, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "elements,heads,width,block_size,tokens",
    [
        (2**30, 16, 256, 16, 262144),  # DeepSeek-V2-Lite: 262k tokens expand at once
        (2**30, 128, 256, 64, 32768),  # DeepSeek-V3 on one GPU
        (2**30, 16, 256, 96, 262080),  # whole cache blocks
        (100, 4, 20, 16, 16),  # at least one block
    ],
)
def test_context_blocks_are_whole_cache_blocks_within_the_bound(elements, heads, width,
                                                                block_size, tokens):  # fmt: skip
    assert context_block_tokens(elements, heads, width, block_size) == tokens


def tiny_mla_layer() -> MLAAttention:
    hf = dict(TINY_MLA, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    layer = MLAAttention(ModelConfig.from_hf_dict(hf), layer_idx=0)
    generator = torch.Generator().manual_seed(1)
    for param in layer.parameters():
        param.data = torch.randn(param.shape, generator=generator) * 0.3
    return layer


@pytest.mark.parametrize("block_tokens", [4, 12, 32, 96])
def test_a_chunk_over_context_blocks_equals_the_whole_context_at_once(block_tokens):
    """7 new tokens of a 100-token context (cache blocks of 4, shuffled) attended to in blocks
    of 4 to 96 prefix tokens: the same outputs as one expansion of all 100."""
    layer, generator = tiny_mla_layer(), torch.Generator().manual_seed(2)
    seq_len, num_new, block_size = 100, 7, 4
    width = layer.kv_lora_rank + layer.rope_dim
    cache = torch.randn(30, block_size, width, generator=generator)
    table = torch.randperm(30, generator=generator)[:25].int()
    q_nope = torch.randn(num_new, layer.num_local_heads, layer.nope_dim, generator=generator)
    q_pe = torch.randn(num_new, layer.num_local_heads, layer.rope_dim, generator=generator)
    kv_c, k_pe = layer._cached_latents(cache, table, 0, seq_len, torch.float32)
    expected = q_nope.new_empty(num_new, layer.num_local_heads, layer.v_head_dim)
    layer._attend_expanded(q_nope, q_pe, kv_c, k_pe, expected)
    own = (q_nope, q_pe, kv_c[-num_new:], k_pe[-num_new:])
    ours = torch.empty_like(expected)
    layer._attend_long_context(own, cache, table, seq_len, block_tokens, ours)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_long_prompt_in_small_context_blocks_matches_transformers(tmp_path, monkeypatch):
    """Chunks of 64 over contexts of up to 400 tokens, expanded 32 tokens at a time."""
    from transformers import AutoModelForCausalLM

    config = dict(
        TINY_MLA, n_group=4, topk_group=2, n_shared_experts=1, max_position_embeddings=1024
    )
    path = make_hf_checkpoint(tmp_path, "deepseek_v3", **config)
    width = config["num_attention_heads"] * (config["qk_nope_head_dim"] + config["v_head_dim"])
    monkeypatch.setattr(MLAAttention, "context_block_elements", 32 * width)
    prompt = torch.randint(
        0, config["vocab_size"], (400,), generator=torch.Generator().manual_seed(4)
    )
    llm = rayinfer.LLM(str(path), device="cpu", max_num_batched_tokens=64, block_size=16)
    params = rayinfer.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ours = llm.generate(prompt.tolist(), params)[0].token_ids
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.inference_mode():
        expected = reference.generate(
            prompt[None], max_new_tokens=6, min_new_tokens=6, do_sample=False, eos_token_id=None
        )[0, 400:].tolist()
    assert ours == expected
