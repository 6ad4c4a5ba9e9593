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

from rayinfer.kernels.paged_attention import causal_attention, split_k_decode
from rayinfer.kernels.prefill_attention import prefill_attention
from rayinfer.kernels.triton_compat import tl, triton


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
    """Expanded MLA is plain multi-head attention (value dim may differ from the key's)."""
    return causal_attention(query, key, value, scale)


def mla_decode_attention_reference(
    q_latent: torch.Tensor,  # [B, N, L]: q_nope absorbed through W_UK
    q_pe: torch.Tensor,  # [B, N, R]: roped query rope part
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    seq_lens: list[int],  # [B] context length of each sequence, its new token included
    scale: float,
) -> torch.Tensor:  # [B, N, L]: attention output in latent space (before W_UV)
    latent_rank = q_latent.shape[-1]
    block_size = kv_cache.shape[1]
    lengths = torch.as_tensor(seq_lens, device=q_latent.device)  # [B]
    max_len = int(lengths.max()) if lengths.numel() else 0
    tables = block_tables[:, : -(-max_len // block_size)].long().clamp(min=0)  # [B, nb]
    context = kv_cache[tables].flatten(1, 2)[:, :max_len].to(q_latent.dtype)  # [B, S, L + R]
    kv_c, k_pe = context[..., :latent_rank], context[..., latent_rank:]  # [B, S, L], [B, S, R]
    scores = q_latent @ kv_c.transpose(1, 2) + q_pe @ k_pe.transpose(1, 2)  # [B, N, S]
    is_context = torch.arange(max_len, device=q_latent.device) < lengths[:, None]  # [B, S]
    scores = (scores.float() * scale).masked_fill(~is_context[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(kv_c.dtype)  # [B, N, S]
    return probs @ kv_c  # [B, N, L]


# ---- Triton paths: absorbed decode (split-K over the latent cache) and expanded prefill ----


def mla_decode_attention(
    q_latent: torch.Tensor,  # [B, N, L]
    q_pe: torch.Tensor,  # [B, N, R]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]: new tokens already written
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    seq_lens: torch.Tensor | list[int],  # [B] context length, the new token included
    scale: float,
) -> torch.Tensor:  # [B, N, L]
    """Each program holds BLOCK_H heads' queries and streams the shared latent rows once; the
    value tile is the key's latent part, so a cached byte is read once per head tile."""
    latent_rank, rope_dim = q_latent.shape[-1], q_pe.shape[-1]
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != latent_rank + rope_dim:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be [blocks, bs, "
                         f"L + R = {latent_rank + rope_dim}]")  # fmt: skip
    if q_latent.stride(-1) != 1 or q_pe.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("q_latent, q_pe need a dense last dim; kv_cache must be contiguous")
    if not torch.is_tensor(seq_lens):
        seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=q_latent.device)
    layout = dict(
        heads_per_program=None, queries_per_kv=q_latent.shape[1], block_size=kv_cache.shape[1],
        head_dim_v=latent_rank, has_pe=True, stride_kv_head=0, value_offset=0, value_is_key=True,
    )  # fmt: skip
    slots = kv_cache.view(-1, latent_rank + rope_dim)  # [num_slots, L + R]
    return split_k_decode(q_latent, q_pe, slots, block_tables, seq_lens.to(torch.int32), scale,
                          layout, "mla_attention")  # fmt: skip


def mla_causal_attention(
    query: torch.Tensor,  # [q, N, Dqk]: the last q tokens of the context
    key: torch.Tensor,  # [s, N, Dqk]
    value: torch.Tensor,  # [s, N, Dv]
    scale: float,
) -> torch.Tensor:  # [q, N, Dv]
    """Expanded-form prefill of one sequence (Dqk = 128 nope + 64 rope runs as two dots)."""
    device = query.device
    cu_seqlens_q = torch.tensor([0, query.shape[0]], dtype=torch.int32, device=device)
    cu_seqlens_k = torch.tensor([0, key.shape[0]], dtype=torch.int32, device=device)
    return prefill_attention(query, key.to(query.dtype), value.to(query.dtype), cu_seqlens_q,
                             cu_seqlens_k, query.shape[0], scale)  # fmt: skip


@triton.jit
def _mla_write_cache_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_mapping_ptr,
    stride_kv_c, stride_k_pe, stride_slot,
    LATENT_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    kv_c = tl.load(kv_c_ptr + token * stride_kv_c + offs_l, mask=offs_l < LATENT_RANK)
    k_pe = tl.load(k_pe_ptr + token * stride_k_pe + offs_r, mask=offs_r < ROPE_DIM)
    row = cache_ptr + slot * stride_slot
    tl.store(row + offs_l, kv_c.to(cache_ptr.dtype.element_ty), mask=offs_l < LATENT_RANK)
    tl.store(row + LATENT_RANK + offs_r, k_pe.to(cache_ptr.dtype.element_ty),
             mask=offs_r < ROPE_DIM)  # fmt: skip


def mla_write_cache(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]: updated in place
    slot_mapping: torch.Tensor,  # [T] int64; < 0 skips the token
    kv_c: torch.Tensor,  # [T, L]
    k_pe: torch.Tensor,  # [T, R]
) -> None:
    latent_rank, rope_dim = kv_c.shape[-1], k_pe.shape[-1]
    if kv_cache.shape[-1] != latent_rank + rope_dim or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be contiguous [blocks, bs, "
                         f"{latent_rank + rope_dim}]")  # fmt: skip
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1 or slot_mapping.shape[0] != kv_c.shape[0]:
        raise ValueError("kv_c/k_pe must be contiguous in the last dim, one slot per token")
    if kv_c.shape[0] == 0:
        return
    _mla_write_cache_kernel[(kv_c.shape[0],)](
        kv_c, k_pe, kv_cache, slot_mapping, kv_c.stride(0), k_pe.stride(0), kv_cache.shape[-1],
        LATENT_RANK=latent_rank, ROPE_DIM=rope_dim,
        BLOCK_L=triton.next_power_of_2(latent_rank), BLOCK_R=triton.next_power_of_2(rope_dim),
    )  # fmt: skip
