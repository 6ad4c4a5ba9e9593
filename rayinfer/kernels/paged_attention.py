"""Causal GQA attention of a mixed batch (prefill chunks and decodes) over the paged K/V cache.

Sequence i owns queries `query_start_loc[i]:query_start_loc[i+1]`; they are the last tokens of its
`seq_lens[i]`-token context, whose K/V (new tokens included) are already in the cache at the blocks
of `block_tables[i]`. Query j of a sequence with q new tokens sits at position
`seq_len - q + j` and sees context positions `0 .. seq_len - q + j`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_context(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, Hkv, D]
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # K, V [seq_len, Hkv, D]
    block_size = kv_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = kv_cache[block_table[:num_blocks].long()]  # [n, block_size, 2, Hkv, D]
    context = blocks.flatten(0, 1)[:seq_len]  # [seq_len, 2, Hkv, D]
    return context[:, 0], context[:, 1]


def paged_attention_reference(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    seq_lens: torch.Tensor,  # [B] int32: context length after this step
    query_start_loc: torch.Tensor,  # [B + 1] int32: cumulative query lengths
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[seq], starts[seq + 1]
        key, value = gather_context(kv_cache, block_tables[seq], seq_len)
        out[start:end] = causal_attention(query[start:end], key, value, scale)
    return out


def causal_attention(
    query: torch.Tensor,  # [q, Hq, D]: the last q tokens of the context
    key: torch.Tensor,  # [s, Hkv, D]
    value: torch.Tensor,  # [s, Hkv, D]
    scale: float,
) -> torch.Tensor:  # [q, Hq, D]
    query_len, seq_len = query.shape[0], key.shape[0]
    query_positions = torch.arange(seq_len - query_len, seq_len, device=query.device)  # [q]
    key_positions = torch.arange(seq_len, device=query.device)  # [s]
    mask = key_positions[None, :] <= query_positions[:, None]  # [q, s]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1),  # [Hq, q, D]
        key.to(query.dtype).transpose(0, 1),  # [Hkv, s, D]
        value.to(query.dtype).transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )  # [Hq, q, D]
    return out.transpose(0, 1)
