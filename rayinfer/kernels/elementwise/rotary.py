"""Rotary position embedding, optionally fused with writing the token's K (and V, or MLA's latent)
into the paged cache.

Pair i of a head (i < R/2, R = rotary_dim) is (x[i], x[i + R/2]) in the neox layout and
(x[2i], x[2i+1]) when interleaved (DeepSeek); either way the result is written de-interleaved:
out[i] = a cos - b sin, out[i + R/2] = b cos + a sin, with cos/sin of position * inv_freq[i] times
`attention_factor` (YaRN). Features past R pass through (partial rotary).

Fused cache write: each token's cache row holds the rotated key heads at `key_offset` and a
companion row (V for GQA, the latent c_kv for MLA) at `companion_offset`:
  GQA [2, Hkv, D]: key_offset 0, companion = V [Hkv * D] at Hkv * D
  MLA [L + R]:     key_offset L (k_pe), companion = c_kv [L] at 0
"""

from __future__ import annotations

import torch

from rayinfer.kernels.attention.reshape_and_cache import reshape_and_cache_reference
from rayinfer.kernels.mla.mla_attention import mla_write_cache_reference
from rayinfer.kernels.triton_compat import tl, triton


def rotary_embedding_reference(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hk, D]
    inv_freq: torch.Tensor,  # [R / 2] float32
    is_interleaved: bool = False,
    attention_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layers' math (rotary.py, rotary_yarn.py), bit for bit: cos/sin rounded to x's dtype."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, R / 2]
    cos = (freqs.cos() * attention_factor)[:, None, :]  # [T, 1, R / 2]
    sin = (freqs.sin() * attention_factor)[:, None, :]
    return (
        _rotate_reference(query, cos, sin, is_interleaved),
        _rotate_reference(key, cos, sin, is_interleaved),
    )


def _rotate_reference(x, cos, sin, is_interleaved: bool) -> torch.Tensor:
    rotary_dim = 2 * cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if is_interleaved:
        first, second = rot[..., 0::2], rot[..., 1::2]  # [T, H, R / 2] each
    else:
        first, second = rot.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


@triton.jit
def _rotate_heads(
    src_ptr, dst_ptr, num_heads, stride_src_h, stride_dst_h, cos, sin,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    IS_INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """Rotate the first 2*HALF features of `num_heads` heads of one token; cos/sin [BLOCK_HALF]."""
    offs_i = tl.arange(0, BLOCK_HALF)
    for head_start in range(0, num_heads, BLOCK_H):
        heads = head_start + tl.arange(0, BLOCK_H)
        mask = (heads[:, None] < num_heads) & (offs_i[None, :] < HALF)
        src = src_ptr + heads[:, None] * stride_src_h
        if IS_INTERLEAVED:
            first = tl.load(src + 2 * offs_i[None, :], mask=mask, other=0.0)
            second = tl.load(src + 2 * offs_i[None, :] + 1, mask=mask, other=0.0)
        else:
            first = tl.load(src + offs_i[None, :], mask=mask, other=0.0)
            second = tl.load(src + HALF + offs_i[None, :], mask=mask, other=0.0)
        a, b = first.to(tl.float32), second.to(tl.float32)
        dst = dst_ptr + heads[:, None] * stride_dst_h + offs_i[None, :]
        out_type = dst_ptr.dtype.element_ty
        tl.store(dst, (a * cos[None, :] - b * sin[None, :]).to(out_type), mask=mask)
        tl.store(dst + HALF, (b * cos[None, :] + a * sin[None, :]).to(out_type), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, inv_freq_ptr, query_ptr, key_ptr, query_out_ptr, key_out_ptr,
    companion_ptr, cache_ptr, slot_mapping_ptr, attention_factor,
    num_q_heads, num_k_heads, stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_ct, stride_slot,
    key_offset, companion_offset,
    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, COMPANION: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_C: tl.constexpr,
    IS_INTERLEAVED: tl.constexpr, WRITE_CACHE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    inv_freq = tl.load(inv_freq_ptr + offs_i, mask=offs_i < HALF, other=0.0)
    freqs = tl.load(positions_ptr + token).to(tl.float32) * inv_freq  # [BLOCK_HALF]
    cos = tl.cos(freqs) * attention_factor
    sin = tl.sin(freqs) * attention_factor
    _rotate_heads(
        query_ptr + token * stride_qt,
        query_out_ptr + token * stride_qot,
        num_q_heads,
        stride_qh,
        stride_qoh,
        cos,
        sin,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
        IS_INTERLEAVED,
    )
    _rotate_heads(
        key_ptr + token * stride_kt,
        key_out_ptr + token * stride_kot,
        num_k_heads,
        stride_kh,
        stride_koh,
        cos,
        sin,
        HALF,
        BLOCK_H,
        BLOCK_HALF,
        IS_INTERLEAVED,
    )
    if WRITE_CACHE:
        slot = tl.load(slot_mapping_ptr + token)
        if slot >= 0:
            row = cache_ptr + slot * stride_slot
            # Only this program wrote key_out's row: make its stores visible before re-reading.
            tl.debug_barrier()
            offs_d = tl.arange(0, BLOCK_C)
            key_row = key_out_ptr + token * stride_kot
            for head in range(0, num_k_heads):
                part = tl.load(key_row + head * stride_koh + offs_d, mask=offs_d < HEAD_DIM)
                tl.store(
                    row + key_offset + head * HEAD_DIM + offs_d,
                    part.to(cache_ptr.dtype.element_ty),
                    mask=offs_d < HEAD_DIM,
                )
            for start in range(0, COMPANION, BLOCK_C):
                offs_c = start + offs_d
                part = tl.load(companion_ptr + token * stride_ct + offs_c, mask=offs_c < COMPANION)
                tl.store(row + companion_offset + offs_c, part.to(cache_ptr.dtype.element_ty),
                         mask=offs_c < COMPANION)  # fmt: skip


def _check(positions, query, key, inv_freq):
    half = inv_freq.shape[0]
    if query.dim() != 3 or key.dim() != 3 or positions.shape[0] != query.shape[0]:
        raise ValueError(f"query {tuple(query.shape)} / key {tuple(key.shape)} must be [T, H, D] "
                         f"with T = positions' {positions.shape[0]}")  # fmt: skip
    if 2 * half > min(query.shape[-1], key.shape[-1]):
        raise ValueError(f"rotary_dim {2 * half} exceeds the head dims of query/key")
    if query.stride(-1) != 1 or key.stride(-1) != 1 or inv_freq.dtype != torch.float32:
        raise ValueError("query/key need a dense last dim and inv_freq must be float32")


def _launch(positions, query, key, inv_freq, is_interleaved, attention_factor, cache_write):
    """cache_write: None, or (kv_cache, slot_mapping, companion [T, C], key_offset, offset)."""
    _check(positions, query, key, inv_freq)
    # Read an element a token (positions, slots) or a row (inv_freq) without strides: dense.
    positions, inv_freq = positions.contiguous(), inv_freq.contiguous()
    if cache_write is not None:
        cache_write = (cache_write[0], cache_write[1].contiguous(), *cache_write[2:])
    rotated = 2 * inv_freq.shape[0]  # the kernel writes these features of every head
    # Features past the rotary dim pass through: only then do the outputs start as copies.
    query_out = torch.empty_like(query) if query.shape[-1] == rotated else query.clone()
    key_out = torch.empty_like(key) if key.shape[-1] == rotated else key.clone()
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return query_out, key_out
    kv_cache, slot_mapping, companion, key_offset, companion_offset = cache_write or (
        query_out,
        positions,
        query_out.view(num_tokens, -1),
        0,
        0,
    )
    half, head_dim = inv_freq.shape[0], key.shape[-1]
    companion_size = companion.shape[-1] if cache_write else 0
    _rotary_kernel[(num_tokens,)](
        positions, inv_freq, query, key, query_out, key_out, companion, kv_cache, slot_mapping,
        attention_factor, query.shape[1], key.shape[1],
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        query_out.stride(0), query_out.stride(1), key_out.stride(0), key_out.stride(1),
        companion.stride(0), kv_cache[0, 0].numel() if cache_write else 0,
        key_offset, companion_offset,
        HALF=half, HEAD_DIM=head_dim, COMPANION=companion_size,
        BLOCK_H=min(16, triton.next_power_of_2(max(query.shape[1], key.shape[1]))),
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_C=min(1024, triton.next_power_of_2(max(head_dim, companion_size))),
        IS_INTERLEAVED=is_interleaved, WRITE_CACHE=cache_write is not None,
    )  # fmt: skip
    return query_out, key_out


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hk, D]
    inv_freq: torch.Tensor,  # [R / 2] float32
    is_interleaved: bool = False,
    attention_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # rotated copies of query and key
    return _launch(positions, query, key, inv_freq, is_interleaved, attention_factor, None)


def rotary_embedding_and_cache(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hk, D] (MLA: k_pe as [T, 1, R])
    inv_freq: torch.Tensor,  # [R / 2] float32
    kv_cache: torch.Tensor,  # GQA [blocks, bs, 2, Hkv, D] or MLA [blocks, bs, L + R]
    slot_mapping: torch.Tensor,  # [T] int64; < 0 skips the token
    companion: torch.Tensor,  # GQA: value [T, Hkv, D]; MLA: normed latent c_kv [T, L]
    is_interleaved: bool = False,
    attention_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate, then store the rotated key and its companion at each token's slot."""
    if not kv_cache.is_contiguous() or slot_mapping.shape[0] != query.shape[0]:
        raise ValueError("kv_cache must be contiguous and slot_mapping hold one slot per token")
    rows = companion.reshape(companion.shape[0], -1)  # [T, C]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if kv_cache.dim() == 5:  # GQA: K heads then V heads
        key_offset, companion_offset = 0, key.shape[1] * key.shape[2]
    elif kv_cache.dim() == 3:  # MLA: latent then rope key
        key_offset, companion_offset = rows.shape[-1], 0
    else:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} is neither GQA nor MLA layout")
    if kv_cache[0, 0].numel() != rows.shape[-1] + key.shape[1] * key.shape[2]:
        raise ValueError(f"kv_cache rows of {kv_cache[0, 0].numel()} do not hold key "
                         f"{tuple(key.shape[1:])} plus companion {rows.shape[-1]}")  # fmt: skip
    cache_write = (kv_cache, slot_mapping, rows, key_offset, companion_offset)
    return _launch(positions, query, key, inv_freq, is_interleaved, attention_factor, cache_write)


def rotary_embedding_and_cache_reference(
    positions,
    query,
    key,
    inv_freq,
    kv_cache,
    slot_mapping,
    companion,
    is_interleaved=False,
    attention_factor=1.0,
):
    query, key = rotary_embedding_reference(
        positions, query, key, inv_freq, is_interleaved, attention_factor
    )
    if kv_cache.dim() == 5:
        reshape_and_cache_reference(key, companion, kv_cache, slot_mapping)
    else:
        mla_write_cache_reference(kv_cache, slot_mapping, companion, key[:, 0])
    return query, key
