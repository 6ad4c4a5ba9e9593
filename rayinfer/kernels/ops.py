"""The engine's only door to kernels: Triton on CUDA where a kernel exists, the torch reference
elsewhere. Layers call `ops.<name>`; nothing else picks an implementation."""

from __future__ import annotations

import torch

from rayinfer.kernels.activation import silu_and_mul_reference
from rayinfer.kernels.fused_moe import fused_moe_reference
from rayinfer.kernels.rms_norm import rms_norm_reference


def _on_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda


def rms_norm(x, weight, eps, residual=None):
    return rms_norm_reference(x, weight, eps, residual)


def silu_and_mul(x):
    return silu_and_mul_reference(x)


def fused_moe(x, w13, w2, topk_weights, topk_ids):
    return fused_moe_reference(x, w13, w2, topk_weights, topk_ids)


from rayinfer.kernels.moe_routing import MoeRouting, moe_routing_reference  # noqa: E402


def moe_routing(
    router_logits,
    top_k,
    scoring="softmax",
    renormalize=False,
    num_groups=1,
    topk_groups=1,
    correction_bias=None,
    routed_scaling_factor=1.0,
) -> MoeRouting:
    """[T, E] router logits -> MoeRouting(topk_weights [T, K] float32, topk_ids [T, K] int64)."""
    return moe_routing_reference(
        router_logits,
        top_k,
        scoring,
        renormalize,
        num_groups,
        topk_groups,
        correction_bias,
        routed_scaling_factor,
    )


from rayinfer.kernels.paged_attention import paged_attention_reference  # noqa: E402
from rayinfer.kernels.reshape_and_cache import reshape_and_cache_reference  # noqa: E402


def reshape_and_cache(key, value, kv_cache, slot_mapping):
    reshape_and_cache_reference(key, value, kv_cache, slot_mapping)


def paged_attention(query, kv_cache, block_tables, seq_lens, query_start_loc, scale):
    return paged_attention_reference(query, kv_cache, block_tables, seq_lens, query_start_loc, scale)


from rayinfer.kernels.mla_attention import (  # noqa: E402
    mla_causal_attention_reference,
    mla_decode_attention_reference,
    mla_gather_context_reference,
    mla_write_cache_reference,
)


def mla_write_cache(kv_cache, slot_mapping, kv_c, k_pe):
    """Store latents kv_c [T, L] and k_pe [T, R] into kv_cache [blocks, block_size, L + R]."""
    mla_write_cache_reference(kv_cache, slot_mapping, kv_c, k_pe)


def mla_gather_context(kv_cache, block_table, seq_len):
    """One sequence's cached latents -> [seq_len, L + R]."""
    return mla_gather_context_reference(kv_cache, block_table, seq_len)


def mla_causal_attention(query, key, value, scale):
    """query [q, N, Dqk] (last q of s tokens), key [s, N, Dqk], value [s, N, Dv] -> [q, N, Dv]."""
    return mla_causal_attention_reference(query, key, value, scale)


def mla_decode_attention(q_latent, q_pe, kv_cache, block_tables, seq_lens, scale):
    """Absorbed MLA decode: q_latent [B, N, L], q_pe [B, N, R] -> latent output [B, N, L]."""
    return mla_decode_attention_reference(q_latent, q_pe, kv_cache, block_tables, seq_lens, scale)
