"""Causal GQA attention of a mixed batch (prefill chunks and decodes) over the paged K/V cache.

Sequence i owns queries `query_start_loc[i]:query_start_loc[i+1]`; they are the last tokens of its
`seq_lens[i]`-token context, whose K/V (new tokens included) are already in the cache at the blocks
of `block_tables[i]`. Query j of a sequence with q new tokens sits at position
`seq_len - q + j` and sees context positions `0 .. seq_len - q + j`.

Here: the torch reference, and the Triton split-K decode (one new token per sequence) that the
absorbed MLA decode shares. A program owns (head group, sequence, split of the context): it reads
each cached row once for all query heads of its group, and `_decode_reduce_kernel` merges the
splits by their log-sum-exps, so a 1M-token context spreads over the whole GPU. Prefill chunks run
in `prefill_attention.py` (`paged_mixed_attention` routes a scheduler batch between the two).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from rayinfer.kernels.tile_configs import pick_tile_config, tile_entry_names
from rayinfer.kernels.triton_compat import tl, triton


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


# ---- Triton: split-K decode over the paged cache (shared by GQA and absorbed MLA) ----


def dot_precision(dtype: torch.dtype) -> str:
    """float32 runs are for checks: exact fp32 dots, not tf32 (p99 logit error 6e-3 on GPU)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def launch_params(op: str, device: torch.device, bucket: int = 1) -> dict:
    """Tile sizes of an attention kernel from `configs/<op>.json`: the entry of this GPU (or of
    the GPU tuned for its architecture, tile_configs.tile_entry_names), else the "default"
    entry; "cpu" for the interpreter. `bucket` picks among size buckets (MLA decode: the number
    of heads). Small decodes are host-bound (1 x 4k took 0.107 ms on H200): the names are
    cached, no driver query per launch."""
    names = tile_entry_names(device)
    params = pick_tile_config(op, names, "default", bucket)
    params = params or pick_tile_config(op, "default", "default", bucket)
    if params is None:
        raise FileNotFoundError(f"rayinfer/kernels/configs/{op}.json has no entry for {names[0]!r}")
    return params


@triton.jit
def _decode_split_kernel(
    q0_ptr, q1_ptr, kv_ptr, mid_out_ptr, mid_lse_ptr, block_tables_ptr, seq_lens_ptr,
    scale, num_heads, tokens_per_split,
    stride_q0b, stride_q0h, stride_q1b, stride_q1h, stride_slot, stride_kv_head, value_offset,
    stride_block_table, stride_mid_b, stride_mid_h, stride_mid_s,
    HEAD_DIM0: tl.constexpr, HEAD_DIM1: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D0: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_DV: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr, QUERIES_PER_KV: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, VALUE_IS_KEY: tl.constexpr,
    DOT_PRECISION: tl.constexpr, IS_ONLY_SPLIT: tl.constexpr,
):  # fmt: skip
    """One (sequence, head group, split): partial softmax . V over the split's context tokens."""
    # Head groups vary fastest: MLA's groups of one (sequence, split) run together and share its
    # latent rows through L2 instead of each reading them from HBM.
    head_start = tl.program_id(0) * HEADS_PER_PROGRAM
    seq = tl.program_id(1).to(tl.int64)  # seq * stride: int64, as are the cache rows
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_start = split * tokens_per_split
    if not IS_ONLY_SPLIT and split > 0 and split_start >= seq_len:
        return  # past the context: the reduce reads only the splits that hold tokens
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)
    kv_head = head_start // QUERIES_PER_KV
    offs_h = tl.arange(0, BLOCK_H)
    heads = head_start + offs_h  # [BLOCK_H]
    head_mask = (offs_h < HEADS_PER_PROGRAM) & (heads < num_heads)
    offs_d0 = tl.arange(0, BLOCK_D0)
    offs_dv = tl.arange(0, BLOCK_DV)
    qk_scale = scale * 1.4426950408889634  # log2(e): exp2 instead of exp
    q_ptrs = q0_ptr + seq * stride_q0b + heads[:, None] * stride_q0h + offs_d0[None, :]
    q0 = tl.load(q_ptrs, mask=head_mask[:, None] & (offs_d0[None, :] < HEAD_DIM0), other=0.0)
    if HEAD_DIM1 > 0:
        offs_d1 = tl.arange(0, BLOCK_D1)
        q1_ptrs = q1_ptr + seq * stride_q1b + heads[:, None] * stride_q1h + offs_d1[None, :]
        q1 = tl.load(q1_ptrs, mask=head_mask[:, None] & (offs_d1[None, :] < HEAD_DIM1), other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_block_table
    head_base = kv_ptr + kv_head * stride_kv_head
    for start_n in range(split_start, split_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions
        in_bounds = offs_n < split_end
        block_ids = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=in_bounds, other=0)
        rows = block_ids.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE  # [BLOCK_N] slots
        row_ptrs = head_base + rows[:, None] * stride_slot
        k0 = tl.load(
            row_ptrs + offs_d0[None, :],
            mask=in_bounds[:, None] & (offs_d0[None, :] < HEAD_DIM0),
            other=0.0,
        )
        qk = tl.dot(q0, tl.trans(k0), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        if HEAD_DIM1 > 0:
            k1 = tl.load(
                row_ptrs + HEAD_DIM0 + offs_d1[None, :],
                mask=in_bounds[:, None] & (offs_d1[None, :] < HEAD_DIM1),
                other=0.0,
            )
            qk = tl.dot(q1, tl.trans(k1), qk, input_precision=DOT_PRECISION)
        qk = tl.where(in_bounds[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if VALUE_IS_KEY:
            v = k0
        else:
            v = tl.load(
                row_ptrs + value_offset + offs_dv[None, :],
                mask=in_bounds[:, None] & (offs_dv[None, :] < HEAD_DIM_V),
                other=0.0,
            )
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    mid_ptrs = mid_out_ptr + seq * stride_mid_b + heads[:, None] * stride_mid_h
    mid_ptrs += split * stride_mid_s + offs_dv[None, :]
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty split stores zeros, weighted 0 below
    mid_mask = head_mask[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    tl.store(mid_ptrs, (acc / l_safe[:, None]).to(mid_out_ptr.dtype.element_ty), mask=mid_mask)
    if not IS_ONLY_SPLIT:  # else mid_out is the output and no reduce follows
        lse = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))  # [BLOCK_H] log2
        num_splits = tl.num_programs(2)
        tl.store(mid_lse_ptr + (seq * num_heads + heads) * num_splits + split, lse, mask=head_mask)


@triton.jit
def _decode_reduce_kernel(
    mid_out_ptr, mid_lse_ptr, out_ptr, seq_lens_ptr, num_heads, num_splits, tokens_per_split,
    stride_mid_b, stride_mid_h, stride_mid_s, stride_ob, stride_oh,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Merge the splits of one (sequence, head) that hold tokens by their log-sum-exps (a decode
    graph's splits cover the block table's width; those past the context wrote nothing). A
    sequence without tokens (a graph's padding row) gets zeros."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < HEAD_DIM_V
    live = tl.maximum(tl.cdiv(tl.load(seq_lens_ptr + seq), tokens_per_split), 1)
    lse_base = mid_lse_ptr + (seq * num_heads + head) * num_splits
    mid_base = mid_out_ptr + seq * stride_mid_b + head * stride_mid_h
    offs_s = tl.arange(0, BLOCK_S)
    lses = tl.load(lse_base + offs_s, mask=offs_s < live, other=float("-inf"))  # [BLOCK_S]
    lse_max = tl.max(lses, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no tokens: weights all 0
    total = tl.sum(tl.math.exp2(lses - lse_max), 0)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for split in range(0, live):
        weight = tl.math.exp2(tl.load(lse_base + split) - lse_max)
        part = tl.load(mid_base + split * stride_mid_s + offs_dv, mask=dv_mask, other=0.0)
        acc += weight * part
    out = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_dv, out, mask=dv_mask)


class DecodeSplit(NamedTuple):
    num_splits: int
    tokens_per_split: int  # a multiple of BLOCK_N


def choose_split(num_seqs: int, num_head_groups: int, max_context: int, params: dict):
    """Enough (sequence, head group, split) programs to fill the GPU, never splits that are tiny.

    `max_context` bounds every sequence (block table width x block size), so no device sync.
    "whole_waves": at most target_programs programs (a kernel that runs one program per SM
    takes target_programs = the SM count: a program past it would start a second wave), else
    at least that many."""
    programs = max(num_seqs * num_head_groups, 1)
    if params.get("whole_waves"):
        wanted = max(1, params["target_programs"] // programs)
    else:
        wanted = triton.cdiv(params["target_programs"], programs)
    most = triton.cdiv(max(max_context, 1), params["min_tokens_per_split"])
    num_splits = max(1, min(wanted, most, params["max_splits"]))
    per_split = triton.cdiv(triton.cdiv(max(max_context, 1), num_splits), params["BLOCK_N"])
    tokens_per_split = per_split * params["BLOCK_N"]
    return DecodeSplit(triton.cdiv(max(max_context, 1), tokens_per_split), tokens_per_split)


def split_k_decode(q0, q1, kv_cache_slots, block_tables, seq_lens, scale, layout: dict, op: str):
    """Split + reduce launches -> [B, Hq, Dv]. q0 [B, Hq, D0]; q1 [B, Hq, D1] (or q0);
    kv_cache_slots [num_slots, ...] flat cache rows; `layout`: head grouping and row offsets."""
    num_seqs, num_heads = q0.shape[0], q0.shape[1]
    params = launch_params(op, q0.device, num_heads)
    heads_per_program = layout["heads_per_program"] or params["BLOCK_H"]
    num_groups = triton.cdiv(num_heads, heads_per_program)
    block_size = layout["block_size"]
    split = choose_split(num_seqs, num_groups, block_tables.shape[1] * block_size, params)
    dim_v = layout["head_dim_v"]
    out = q0.new_empty(num_seqs, num_heads, dim_v)
    is_only_split = split.num_splits == 1  # the split kernel writes `out`: one launch, not two
    mid_shape = (num_seqs, num_heads, split.num_splits, dim_v)
    mid_out = out[:, :, None] if is_only_split else q0.new_empty(mid_shape, dtype=torch.float32)
    mid_lse = q0.new_empty(num_seqs, num_heads, split.num_splits, dtype=torch.float32)
    dim0, dim1 = q0.shape[-1], (q1.shape[-1] if layout["has_pe"] else 0)
    block_dv = triton.next_power_of_2(dim_v)
    _decode_split_kernel[(num_groups, num_seqs, split.num_splits)](
        q0, q1, kv_cache_slots, mid_out, mid_lse, block_tables, seq_lens,
        scale, num_heads, split.tokens_per_split,
        q0.stride(0), q0.stride(1), q1.stride(0), q1.stride(1),
        kv_cache_slots.stride(0), layout["stride_kv_head"], layout["value_offset"],
        block_tables.stride(0), mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        HEAD_DIM0=dim0, HEAD_DIM1=dim1, HEAD_DIM_V=dim_v,
        BLOCK_D0=triton.next_power_of_2(dim0), BLOCK_D1=max(16, triton.next_power_of_2(dim1)),
        BLOCK_DV=block_dv, HEADS_PER_PROGRAM=heads_per_program,
        QUERIES_PER_KV=layout["queries_per_kv"],
        BLOCK_H=max(16, triton.next_power_of_2(heads_per_program)),
        BLOCK_N=params["BLOCK_N"], BLOCK_SIZE=block_size, VALUE_IS_KEY=layout["value_is_key"],
        DOT_PRECISION=dot_precision(q0.dtype), IS_ONLY_SPLIT=is_only_split,
        num_warps=params["num_warps"], num_stages=params["num_stages"],
    )  # fmt: skip
    if is_only_split:
        return out
    _decode_reduce_kernel[(num_seqs, num_heads)](
        mid_out, mid_lse, out, seq_lens, num_heads, split.num_splits, split.tokens_per_split,
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2), out.stride(0), out.stride(1),
        HEAD_DIM_V=dim_v, BLOCK_DV=block_dv, BLOCK_S=triton.next_power_of_2(split.num_splits),
    )  # fmt: skip
    return out


def paged_decode_attention(
    query: torch.Tensor,  # [B, Hq, D]: one new token per sequence
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, Hkv, D]: new tokens already written
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    seq_lens: torch.Tensor,  # [B] int32: context length, the new token included
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """GQA decode: each program reads one kv head's tokens once for all its query heads."""
    if kv_cache.dim() != 5 or kv_cache.shape[2] != 2:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be [blocks, bs, 2, Hkv, D]")
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    if query.shape[1] % num_kv_heads or query.shape[2] != head_dim:
        raise ValueError(f"query {tuple(query.shape)} does not fit kv heads {num_kv_heads} x "
                         f"head dim {head_dim}")  # fmt: skip
    if query.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("query must be contiguous in its last dim and kv_cache contiguous")
    group = query.shape[1] // num_kv_heads
    layout = dict(
        heads_per_program=group, queries_per_kv=group, block_size=kv_cache.shape[1],
        head_dim_v=head_dim, has_pe=False, stride_kv_head=head_dim,
        value_offset=num_kv_heads * head_dim, value_is_key=False,
    )  # fmt: skip
    slots = kv_cache.view(-1, 2 * num_kv_heads * head_dim)  # [num_slots, 2*Hkv*D]
    return split_k_decode(query, query, slots, block_tables, seq_lens, scale, layout,
                          "paged_attention")  # fmt: skip
