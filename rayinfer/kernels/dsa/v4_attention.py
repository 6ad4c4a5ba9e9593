"""DeepSeek-V4 attention over the paged cache: one shared key/value head, a sliding window of raw
keys, pooled entries, and per-head sinks.

A layer's cache row holds the token's key (= value) at columns [0, D) and, in the row of the last
token of each pooled window, the pooled entry at [entry_col, entry_col + D) (config_v4.py). A
query at position p of sequence s attends, with all N heads sharing the keys, to
- the keys of positions max(0, p - window + 1) .. p;
- entries: none (sliding layers); a list of slots per query (CSA: the indexer's picks, -1
  padded); or every entry whose window ended at or before p (HCA, `entry_stride` m: entries
  j < (p + 1) // m, in the rows of positions j * m + m - 1);
- a sink logit per head, in the softmax's denominator only.

`v4_write_rows` stores a step's values into its tokens' rows, skipping negative slots (the padding
rows of a CUDA graph's bucket, and the tokens that close no window), with no data-dependent
shape, so a decode graph captures it.

On a GPU one Triton program per (query, BLOCK_H heads) walks the window, then the entries,
BLOCK_N keys at a time with an online softmax, loading each key tile once for its heads; the
entries of an HCA layer come from the block table in the kernel, so a 1M-token context needs no
[T, entries] list. The reference gathers the keys and runs a softmax over them.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.attention.paged_attention import dot_precision
from rayinfer.kernels.triton_compat import tl, triton

NO_ENTRIES, LISTED_ENTRIES, EVERY_ENTRY = 0, 1, 2


def slots_of(block_tables, seq_ids, positions, block_size: int) -> torch.Tensor:
    """Cache slots (int64) of `positions` [...] of sequences `seq_ids` (broadcast to them); -1
    where a position is negative."""
    where = positions.clamp(min=0)
    blocks = block_tables[seq_ids, torch.div(where, block_size, rounding_mode="floor")].long()
    slots = blocks * block_size + where % block_size
    return torch.where(positions >= 0, slots, -1)


def v4_attention_reference(
    queries: torch.Tensor,  # [T, N, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, W]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    seq_ids: torch.Tensor,  # [T] int64: each query's sequence (row of block_tables)
    positions: torch.Tensor,  # [T] int64
    window: int,
    entry_col: int,
    entry_slots: torch.Tensor | None,  # [T, K] int32 (-1 padded): LISTED_ENTRIES
    entry_stride: int,  # > 0: EVERY_ENTRY of that many tokens
    max_entries: int,  # with entry_stride: >= every query's visible entries
    sinks: torch.Tensor,  # [N] float32
    scale: float,
    max_position: int,  # >= every query's position + 1 (a host bound)
) -> torch.Tensor:  # [T, N, D]
    dim, block_size = queries.shape[-1], kv_cache.shape[1]
    rows = kv_cache.view(-1, kv_cache.shape[-1])
    width = min(window, max_position)
    where = positions[:, None] - torch.arange(width, device=positions.device)  # [T, w]
    window_slots = slots_of(block_tables, seq_ids[:, None], where, block_size)
    keys, valid = rows[window_slots.clamp(min=0), :dim], window_slots >= 0
    if entry_stride > 0:
        entry = torch.arange(max_entries, device=positions.device)  # [E]
        ends = entry * entry_stride + entry_stride - 1
        entry_slots = slots_of(block_tables, seq_ids[:, None], ends[None], block_size)
        visible = torch.div(positions + 1, entry_stride, rounding_mode="floor")
        entry_slots = entry_slots.masked_fill(entry[None] >= visible[:, None], -1)
    if entry_slots is not None:
        entry_slots = entry_slots.long()
        entries = rows[entry_slots.clamp(min=0), entry_col : entry_col + dim]
        keys = torch.cat([keys, entries], dim=1)
        valid = torch.cat([valid, entry_slots >= 0], dim=1)
    logits = torch.einsum("tnd,tkd->tnk", queries.float(), keys.float()) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("tnk,tkd->tnd", probs, keys.float()).to(queries.dtype)


def v4_write_rows_reference(
    rows: torch.Tensor,  # [num_slots, W]: the cache, updated in place
    slots: torch.Tensor,  # [T] int64; < 0 skips the token
    values: torch.Tensor,  # [T, C]
    column: int,  # written at [column, column + C)
) -> None:
    keep = slots >= 0
    rows[slots[keep], column : column + values.shape[1]] = values[keep].to(rows.dtype)


@triton.jit
def _write_rows_kernel(rows_ptr, slots_ptr, values_ptr, column, width, stride_row, stride_value,
                       BLOCK_C: tl.constexpr):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    values = tl.load(values_ptr + token * stride_value + offs, mask=offs < width)
    tl.store(rows_ptr + slot * stride_row + column + offs,
             values.to(rows_ptr.dtype.element_ty), mask=offs < width)  # fmt: skip


def v4_write_rows(rows, slots, values, column) -> None:
    """The reference's write from one Triton program per (token, 1024 columns)."""
    if values.shape[0] == 0:
        return
    values = values.contiguous()
    grid = (values.shape[0], triton.cdiv(values.shape[1], 1024))
    _write_rows_kernel[grid](rows, slots, values, column, values.shape[1], rows.stride(0),
                             values.stride(0), BLOCK_C=1024)  # fmt: skip


@triton.jit
def _attend_tile(q, keys, valid, m_i, l_i, acc, scale, DOT_PRECISION: tl.constexpr):
    """One tile of keys (= values) [BLOCK_N, BLOCK_D] into the running softmax of q's heads."""
    logits = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION) * scale  # [H, N]
    logits = tl.where(valid[None, :], logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of no key: nothing changes
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(logits - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(keys.dtype), keys, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _v4_attention_kernel(
    q_ptr, cache_ptr, tables_ptr, seq_ptr, pos_ptr, list_ptr, sinks_ptr, out_ptr,
    num_heads, scale, window, entry_col, list_len,
    stride_qt, stride_qh, stride_row, stride_table, stride_list, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, ENTRIES: tl.constexpr, ENTRY_STRIDE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    query = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head_mask, dim_mask = offs_h < num_heads, offs_d < HEAD_DIM
    q_ptrs = q_ptr + query * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
    position = tl.load(pos_ptr + query).to(tl.int32)
    table = tables_ptr + tl.load(seq_ptr + query).to(tl.int64) * stride_table
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(tl.maximum(position - window + 1, 0), position + 1, BLOCK_N):
        where = start + tl.arange(0, BLOCK_N)
        valid = where <= position
        blocks = tl.load(table + where // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = tl.maximum(blocks, 0) * BLOCK_SIZE + where % BLOCK_SIZE  # -1: past the table
        k_ptrs = cache_ptr + rows[:, None] * stride_row + offs_d[None, :]
        keys = tl.load(k_ptrs, mask=valid[:, None] & dim_mask[None, :], other=0.0).to(q.dtype)
        m_i, l_i, acc = _attend_tile(q, keys, valid, m_i, l_i, acc, scale, DOT_PRECISION)
    if ENTRIES == 1:  # the listed slots
        for start in range(0, list_len, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            slots = tl.load(list_ptr + query * stride_list + offs_n, mask=offs_n < list_len,
                            other=-1).to(tl.int64)  # fmt: skip
            valid = slots >= 0
            k_ptrs = cache_ptr + slots[:, None] * stride_row + entry_col + offs_d[None, :]
            keys = tl.load(k_ptrs, mask=valid[:, None] & dim_mask[None, :], other=0.0)
            keys = keys.to(q.dtype)
            m_i, l_i, acc = _attend_tile(q, keys, valid, m_i, l_i, acc, scale, DOT_PRECISION)
    if ENTRIES == 2:  # every entry whose window has ended
        for start in range(0, (position + 1) // ENTRY_STRIDE, BLOCK_N):
            entry = start + tl.arange(0, BLOCK_N)
            valid = entry < (position + 1) // ENTRY_STRIDE
            where = entry * ENTRY_STRIDE + ENTRY_STRIDE - 1
            blocks = tl.load(table + where // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            rows = tl.maximum(blocks, 0) * BLOCK_SIZE + where % BLOCK_SIZE
            k_ptrs = cache_ptr + rows[:, None] * stride_row + entry_col + offs_d[None, :]
            keys = tl.load(k_ptrs, mask=valid[:, None] & dim_mask[None, :], other=0.0)
            keys = keys.to(q.dtype)
            m_i, l_i, acc = _attend_tile(q, keys, valid, m_i, l_i, acc, scale, DOT_PRECISION)
    sink = tl.load(sinks_ptr + offs_h, mask=head_mask, other=0.0)
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp(m_i - m_new)
    total = l_i * alpha + tl.exp(sink - m_new)
    out = acc * (alpha / total)[:, None]
    o_ptrs = out_ptr + query * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & dim_mask[None, :])


def kernel_constants(dtype: torch.dtype, num_heads: int, head_dim: int, block_size: int,
                     entries: int, entry_stride: int) -> dict:  # fmt: skip
    """Meta-parameters of the kernel (the launcher's, and an offline compile's)."""
    return dict(
        HEAD_DIM=head_dim, BLOCK_H=16, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=16 if dtype == torch.float32 else 32, BLOCK_SIZE=block_size, ENTRIES=entries,
        ENTRY_STRIDE=max(entry_stride, 1), DOT_PRECISION=dot_precision(dtype),
    )  # fmt: skip


def v4_attention(queries, kv_cache, block_tables, seq_ids, positions, window, entry_col,
                 entry_slots, entry_stride, max_entries, sinks, scale, max_position,
                 num_warps: int = 8):  # fmt: skip
    """The reference's result (same arguments) from the Triton kernel."""
    num_queries, num_heads, head_dim = queries.shape
    if queries.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("queries and kv_cache rows must be dense in their last dim")
    if kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):
        raise ValueError("kv_cache blocks must be one after another")
    kind = EVERY_ENTRY if entry_stride > 0 else NO_ENTRIES
    listed = entry_slots if entry_slots is not None else block_tables  # any int tensor
    if entry_slots is not None:
        kind = LISTED_ENTRIES
    out = torch.empty_like(queries)
    constants = kernel_constants(
        queries.dtype, num_heads, head_dim, kv_cache.shape[1], kind, entry_stride
    )
    grid = (num_queries, triton.cdiv(num_heads, constants["BLOCK_H"]))
    _v4_attention_kernel[grid](
        queries, kv_cache, block_tables, seq_ids, positions, listed, sinks, out,
        num_heads, scale, window, entry_col, listed.shape[1] if entry_slots is not None else 0,
        queries.stride(0), queries.stride(1), kv_cache.stride(1), block_tables.stride(0),
        listed.stride(0), out.stride(0), out.stride(1),
        **constants, num_warps=num_warps,
    )  # fmt: skip
    return out
