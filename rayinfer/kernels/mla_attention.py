"""Multi-head latent attention (MLA) over the paged latent cache: torch references.

The cache of one layer is `[num_blocks, block_size, L + R]`: per token the normed compressed latent
c_kv (L = kv_lora_rank) followed by the roped shared key k_pe (R = qk_rope_head_dim).

- `mla_write_cache`: store the new tokens' (c_kv, k_pe) at their slots.
- `mla_gather_context`: one sequence's cached rows, for the expanded (prefill) form.
- `mla_causal_attention`: plain multi-head attention of the last q tokens over s context tokens.
- `mla_decode_attention`: the absorbed form, attention computed in latent space. With q_nope
  absorbed through W_UK (q_latent = q_nope @ W_UK, [N, L]) the score of a context token is
  q_latent . c_kv + q_pe . k_pe, and the output is softmax . c_kv ([N, L]), which the caller maps
  through W_UV. No per-token K or V is ever materialised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mla_write_cache_reference(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]: updated in place
    slot_mapping: torch.Tensor,  # [T] int64: block_id * block_size + offset; < 0 skips the token
    kv_c: torch.Tensor,  # [T, L]: normed latent
    k_pe: torch.Tensor,  # [T, R]: roped shared key
) -> None:
    flat_cache = kv_cache.view(-1, kv_cache.shape[-1])  # [num_slots, L + R]
    is_real = slot_mapping >= 0  # [T]
    latent_rank = kv_c.shape[-1]
    slots = slot_mapping[is_real]
    flat_cache[slots, :latent_rank] = kv_c[is_real].to(kv_cache.dtype)
    flat_cache[slots, latent_rank:] = k_pe[is_real].to(kv_cache.dtype)


def mla_gather_context_reference(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    block_table: torch.Tensor,  # [max_blocks] int32, -1 padded
    seq_len: int,
) -> torch.Tensor:  # [seq_len, L + R]
    block_size = kv_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = kv_cache[block_table[:num_blocks].long()]  # [n, block_size, L + R]
    return blocks.flatten(0, 1)[:seq_len]


def mla_causal_attention_reference(
    query: torch.Tensor,  # [q, N, Dqk]: the last q tokens of the context
    key: torch.Tensor,  # [s, N, Dqk]
    value: torch.Tensor,  # [s, N, Dv]
    scale: float,
) -> torch.Tensor:  # [q, N, Dv]
    query_len, seq_len = query.shape[0], key.shape[0]
    query_positions = torch.arange(seq_len - query_len, seq_len, device=query.device)  # [q]
    key_positions = torch.arange(seq_len, device=query.device)  # [s]
    mask = key_positions[None, :] <= query_positions[:, None]  # [q, s]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1),  # [N, q, Dqk]
        key.to(query.dtype).transpose(0, 1),  # [N, s, Dqk]
        value.to(query.dtype).transpose(0, 1),  # [N, s, Dv]
        attn_mask=mask,
        scale=scale,
    )  # [N, q, Dv]
    return out.transpose(0, 1)


def mla_decode_attention_reference(
    q_latent: torch.Tensor,  # [B, N, L]: q_nope absorbed through W_UK
    q_pe: torch.Tensor,  # [B, N, R]: roped query rope part
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    seq_lens: list[int],  # [B] context length of each sequence, its new token included
    scale: float,
) -> torch.Tensor:  # [B, N, L]: attention output in latent space (before W_UV)
    latent_rank = q_latent.shape[-1]
    out = torch.empty_like(q_latent)
    for seq, seq_len in enumerate(seq_lens):
        context = mla_gather_context_reference(kv_cache, block_tables[seq], seq_len)
        context = context.to(q_latent.dtype)  # [s, L + R]
        kv_c, k_pe = context[:, :latent_rank], context[:, latent_rank:]  # [s, L], [s, R]
        scores = q_latent[seq] @ kv_c.t() + q_pe[seq] @ k_pe.t()  # [N, s]
        probs = (scores.float() * scale).softmax(dim=-1).to(kv_c.dtype)  # [N, s]
        out[seq] = probs @ kv_c  # [N, L]
    return out
