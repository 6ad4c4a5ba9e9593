"""RoPE (Triton, interpreter on CPU) against the reference, and the reference against the layers."""

import pytest
import torch

from rayinfer.kernels.attention.reshape_and_cache import reshape_and_cache_reference
from rayinfer.kernels.elementwise import rotary
from rayinfer.kernels.mla.mla_attention import mla_write_cache_reference
from rayinfer.layers.rotary import RotaryEmbedding
from rayinfer.layers.rotary_yarn import DeepseekRotaryEmbedding

YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=0.8)  # fmt: skip
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3}


def inputs(num_tokens, num_q_heads, num_k_heads, head_dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 300, (num_tokens,), generator=generator)
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=generator).to(dtype)
    key = torch.randn(num_tokens, num_k_heads, head_dim, generator=generator).to(dtype)
    return positions, query, key


def llama_layer_math(positions, x, inv_freq, rotary_dim, attention_factor):
    """RotaryEmbedding's code before it called the op (rotate_half over cat(freqs, freqs))."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    cos = (angles.cos() * attention_factor)[:, None, :].to(x.dtype)
    sin = (angles.sin() * attention_factor)[:, None, :].to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = rot.chunk(2, dim=-1)
    rotated = rot * cos + torch.cat((-second, first), dim=-1) * sin
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


def deepseek_layer_math(positions, x, inv_freq, is_interleaved, attention_factor):
    """DeepseekRotaryEmbedding's code before it called the op."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos = (freqs.cos() * attention_factor)[:, None, :].to(x.dtype)
    sin = (freqs.sin() * attention_factor)[:, None, :].to(x.dtype)
    first, second = (x[..., 0::2], x[..., 1::2]) if is_interleaved else x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)  # fmt: skip


@pytest.mark.parametrize("scaling,rotary_dim", [(LLAMA3, 32), (LLAMA3, 16), (YARN, 32)])
def test_llama_layer_is_its_former_math_bit_for_bit(scaling, rotary_dim):
    layer = RotaryEmbedding(32, 10000.0, scaling, rotary_dim, max_position=256)
    positions, query, key = inputs(7, 4, 2, 32, torch.float32)
    ours = layer(positions, query, key)
    args = (layer.inv_freq, rotary_dim, layer.attention_factor)
    expected = [llama_layer_math(positions, x, *args) for x in (query, key)]
    assert all(torch.equal(a, b) for a, b in zip(ours, expected, strict=True))


@pytest.mark.parametrize("is_interleaved", [True, False])
def test_deepseek_layer_is_its_former_math_bit_for_bit(is_interleaved):
    layer = DeepseekRotaryEmbedding(16, 10000.0, YARN, 256, is_interleaved)
    positions, q_pe, k_pe = inputs(5, 3, 1, 16, torch.float32)
    q_out, k_out = layer(positions, q_pe, k_pe[:, 0])
    args = (layer.inv_freq, is_interleaved, layer.attention_factor)
    assert torch.equal(q_out, deepseek_layer_math(positions, q_pe, *args))
    assert torch.equal(k_out, deepseek_layer_math(positions, k_pe, *args)[:, 0])


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize(
    "num_tokens,num_q_heads,num_k_heads,head_dim,rotary_dim,is_interleaved,factor",
    [(6, 4, 2, 32, 32, False, 1.0), (1, 6, 1, 42, 20, False, 1.0), (9, 20, 1, 16, 16, True, 1.3)],
    ids=["neox-gqa", "partial-odd-one-token", "interleaved-yarn-many-heads"],
)
def test_triton_matches_reference(num_tokens, num_q_heads, num_k_heads, head_dim, rotary_dim,
                                  is_interleaved, factor, dtype):  # fmt: skip
    positions, query, key = inputs(num_tokens, num_q_heads, num_k_heads, head_dim, dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    ours = rotary.rotary_embedding(positions, query, key, inv_freq, is_interleaved, factor)
    expected = rotary.rotary_embedding_reference(
        positions, query.float(), key.float(), inv_freq, is_interleaved, factor
    )
    tol = TOLERANCES[dtype]
    for mine, theirs in zip(ours, expected, strict=True):
        torch.testing.assert_close(mine.float(), theirs, atol=tol, rtol=tol)


def test_fused_cache_write_gqa_and_mla():
    positions, query, key = inputs(5, 4, 2, 16, torch.float32)
    value = torch.randn(5, 2, 16)
    slots = torch.tensor([3, -1, 0, 9, 6])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    cache = torch.zeros(3, 4, 2, 2, 16)
    q_out, k_out = rotary.rotary_embedding_and_cache(
        positions, query, key, inv_freq, cache, slots, value
    )
    expected_cache = torch.zeros_like(cache)
    reshape_and_cache_reference(k_out, value, expected_cache, slots)
    assert torch.equal(cache, expected_cache)
    latent = torch.randn(5, 24)
    mla_cache = torch.zeros(3, 4, 24 + 16)
    _, k_pe = rotary.rotary_embedding_and_cache(
        positions, query, key[:, :1], inv_freq, mla_cache, slots, latent, is_interleaved=True
    )
    expected_mla = torch.zeros_like(mla_cache)
    mla_write_cache_reference(expected_mla, slots, latent, k_pe[:, 0])
    assert torch.equal(mla_cache, expected_mla)
    reference = rotary.rotary_embedding_and_cache_reference(
        positions, query, key[:, :1], inv_freq, torch.zeros_like(mla_cache), slots, latent, True
    )
    torch.testing.assert_close(k_pe, reference[1], atol=1e-5, rtol=1e-5)


def test_paged_attention_with_rotary_equals_rotating_first():
    from rayinfer.layers.attention import PagedAttention
    from rayinfer.layers.forward_context import ForwardContext, build_attention_metadata

    layer = PagedAttention(num_heads=4, head_dim=16, num_kv_heads=2, layer_idx=0)
    rope = RotaryEmbedding(16, 10000.0)
    positions, query, key = inputs(6, 4, 2, 16, torch.float32)
    positions = torch.arange(6)
    value = torch.randn(6, 2, 16)
    outputs = []
    for fused in (False, True):
        attn = build_attention_metadata([6], [6], [[1, 0]], 4)
        ctx = ForwardContext(attn, [torch.zeros(3, 4, 2, 2, 16)])
        if fused:
            outputs.append(layer(query, key, value, ctx, positions, rope))
        else:
            q, k = rope(positions, query, key)
            outputs.append(layer(q, k, value, ctx))
        outputs.append(ctx.kv_caches[0])
    assert torch.equal(outputs[0], outputs[2]) and torch.equal(outputs[1], outputs[3])
