"""MLA at a 1M-token context on one GPU (DeepSeek-V2-Lite shapes, random weights): kernels over
operands of more than 2**31 elements, the blocked long-context chunk against one expansion of
the whole context, and a 2-layer model that prefills 1,048,576 tokens in 16k chunks and decodes.

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/gpu/test_long_context.py

(about 2 minutes on an H200, most of it the 1M-token prefill: two layers of causal attention
over 1M tokens, ~5.6e15 FLOPs each).
"""

import json
import math
import os

import pytest
import torch

from rayinfer.config import ModelConfig
from rayinfer.kernels.mla import mla_attention as mla
from rayinfer.layers.mla import MLAAttention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1",
        reason="tests/conftest.py turns the interpreter on: run with TRITON_INTERPRET=0",
    ),
]

V2_LITE = "benchmarks/configs/deepseek-v2-lite/config.json"
HEADS, NOPE, ROPE, VALUE, LATENT = 16, 128, 64, 128, 512
PAST_INT32 = 2**31 + 2**20  # elements


def mla_scores_reference(q_nope, q_pe, k_nope, k_pe, value, scale):
    """float32 causal attention of the last q of s tokens -> [q, N, Dv], keys in 64k slices
    (a [N, q, s] float32 score matrix of 1M keys would not fit)."""
    query = torch.cat([q_nope, q_pe], -1).float()  # [q, N, 192]
    num_queries, seq_len = query.shape[0], k_nope.shape[0]
    positions = torch.arange(seq_len - num_queries, seq_len, device=query.device)
    scores = []
    for start in range(0, seq_len, 65536):
        keys = slice(start, min(start + 65536, seq_len))
        rope = k_pe[keys].expand(-1, HEADS, -1)
        key = torch.cat([k_nope[keys], rope], -1).float()  # [k, N, 192]
        part = torch.einsum("qhd,khd->hqk", query, key) * scale
        visible = torch.arange(keys.start, keys.stop, device=query.device) <= positions[:, None]
        scores.append(part.masked_fill(~visible, float("-inf")))
    probs = torch.cat(scores, -1).softmax(-1)  # [N, q, s]
    return torch.einsum("hqk,khd->qhd", probs, value.float())


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_mla_prefill_over_keys_of_more_than_2_31_elements(backend):
    """kv_b_proj's output [s, 16 x 256] past 2**31 elements (s = 540k): K_nope and V are views
    of it, as in the layer; 256 queries at the end of the context, against float32; `backend`
    as KernelBackends.prefill_attention passes it."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    seq_len, num_queries = math.ceil(PAST_INT32 / (HEADS * (NOPE + VALUE))), 256
    kv = torch.randn(seq_len, HEADS, NOPE + VALUE, device="cuda", generator=generator)
    kv = kv.bfloat16()  # [s, N, 256]: 4.4e9 bytes
    k_nope, value = kv.split([NOPE, VALUE], -1)
    k_pe = torch.randn(seq_len, 1, ROPE, device="cuda", generator=generator).bfloat16()
    query = torch.randn(num_queries, HEADS, NOPE + ROPE, device="cuda", generator=generator)
    q_nope, q_pe = query.bfloat16().split([NOPE, ROPE], -1)
    out = q_nope.new_empty(num_queries, HEADS, VALUE)
    # scale 0.5: score std ~7, so a few keys dominate and the outputs are O(1), not averages ~0
    mla.mla_prefill_attention(
        q_nope, q_pe.contiguous(), k_nope, k_pe, value, 0.5, out, backend=backend
    )
    expected = mla_scores_reference(q_nope, q_pe, k_nope, k_pe, value, 0.5)
    # bf16 probabilities in P.V: a few elements of peaked rows land ~4e-2 off
    torch.testing.assert_close(out.float(), expected, atol=6e-2, rtol=2e-2)


def test_mla_decode_over_a_cache_of_more_than_2_31_elements():
    """A 4096-token context in the last blocks of a [blocks, 16, 576] cache past 2**31
    elements (block ids x row in int64; the Gluon kernel's TMA rows stay int32)."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    num_blocks = math.ceil(PAST_INT32 / (16 * (LATENT + ROPE)))
    cache = torch.empty(num_blocks, 16, LATENT + ROPE, dtype=torch.bfloat16, device="cuda")
    table = torch.arange(num_blocks - 256, num_blocks, device="cuda", dtype=torch.int32)[None]
    cache[-256:] = torch.randn(256, 16, LATENT + ROPE, device="cuda", generator=generator)
    q_latent = torch.randn(1, HEADS, LATENT, device="cuda", generator=generator).bfloat16()
    q_pe = torch.randn(1, HEADS, ROPE, device="cuda", generator=generator).bfloat16()
    ours = mla.mla_decode_attention(q_latent, q_pe, cache, table, [4096], 0.25)  # peaked
    expected = mla.mla_decode_attention_reference(
        q_latent.float(), q_pe.float(), cache, table, [4096], 0.25
    )
    torch.testing.assert_close(ours.float(), expected, atol=2e-2, rtol=2e-2)


def v2_lite_layer() -> MLAAttention:
    hf = json.loads(open(V2_LITE).read())
    layer = MLAAttention(ModelConfig.from_hf_dict(hf), layer_idx=0).cuda()
    generator = torch.Generator(device="cuda").manual_seed(2)
    for param in layer.parameters():
        param.data = torch.randn(param.shape, device="cuda", generator=generator) * 0.05
    return layer.bfloat16()


def test_a_chunk_over_context_blocks_equals_one_expansion():
    """16k new tokens of a 96k context in 16k-token blocks (the Triton kernel with lse, merged
    in float32) against the whole context expanded at once (the H200's Gluon kernel)."""
    layer, generator = v2_lite_layer(), torch.Generator(device="cuda").manual_seed(3)
    seq_len, num_new, block_size = 98304, 16384, 16
    cache = torch.randn(seq_len // block_size, block_size, LATENT + ROPE, device="cuda",
                        generator=generator).bfloat16()  # fmt: skip
    table = torch.randperm(seq_len // block_size, device="cuda", generator=generator).int()
    # x4: peaked softmax rows (outputs O(1), not averages ~0 over 96k keys)
    q_nope = 4 * torch.randn(num_new, HEADS, NOPE, device="cuda", generator=generator).bfloat16()
    q_pe = 4 * torch.randn(num_new, HEADS, ROPE, device="cuda", generator=generator).bfloat16()
    kv_c, k_pe = layer._cached_latents(cache, table, 0, seq_len, torch.bfloat16)
    with torch.inference_mode():
        expected = q_nope.new_empty(num_new, HEADS, VALUE)
        layer._attend_expanded(q_nope, q_pe, kv_c, k_pe, expected)
        ours = torch.empty_like(expected)
        own = (q_nope, q_pe, kv_c[-num_new:], k_pe[-num_new:])
        layer._attend_long_context(own, cache, table, seq_len, 16384, ours)
    # both round to bf16 on their own (outputs O(1), merged vs one softmax): up to ~8e-2 apart
    torch.testing.assert_close(ours.float(), expected.float(), atol=1.2e-1, rtol=2e-2)


def test_a_two_layer_v2_lite_prefills_a_1m_token_prompt_and_decodes(tmp_path):
    """1,048,576 tokens in 16k chunks (the last 48 over contexts past 262k expand in blocks),
    then 4 decode steps at that context; every prefill step's final hidden states finite."""
    import rayinfer

    hf = json.loads(open(V2_LITE).read())
    hf.update(num_hidden_layers=2, max_position_embeddings=1 << 21)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    prompt_len, new_tokens, block_size = 1 << 20, 4, 16
    llm = rayinfer.LLM(
        str(tmp_path), device="cuda", dtype="bfloat16", load_format="dummy",
        max_model_len=prompt_len + 64, max_num_batched_tokens=16384, max_num_seqs=2,
        block_size=block_size, num_kv_blocks=(prompt_len + 64) // block_size + 4,
        enable_prefix_caching=False,
    )  # fmt: skip
    finite = []
    model = llm.engine.executor.runner.model
    model.model.norm.register_forward_hook(
        lambda module, inputs, output: finite.append(bool(torch.isfinite(output[0]).all()))
    )
    prompt = torch.randint(0, hf["vocab_size"], (prompt_len,)).tolist()
    params = rayinfer.SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    output = llm.generate([prompt], params)[0]
    torch.cuda.synchronize()
    assert len(output.token_ids) == new_tokens
    assert all(0 <= token < hf["vocab_size"] for token in output.token_ids)
    assert len(finite) >= 48 and all(finite)  # eager steps (a prefill graph calls no hook)
    llm.shutdown()
