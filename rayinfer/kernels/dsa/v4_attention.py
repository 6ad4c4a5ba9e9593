"""DeepSeek-V4 attention over its hybrid cache (config_v4.py): one shared key/value head, a
sliding window of raw keys, pooled entries, and per-head sinks.

The window's keys (= values) come from the window pool, columns [0, D) of each token's row,
through the sequence's window table. Pooled entries come from the paged cache, each spread over
the rows of the tokens it pools (`spread` = (rate m, share s, column c0): element c of entry j in
the row of token j * m + c // s, column c0 + c % s). A query at position p of sequence s
attends, with all N heads sharing the keys, to
- the keys of positions max(0, p - window + 1) .. p;
- entries: none (sliding layers, `spread` None); a list of entry numbers per query (CSA: the
  indexer's picks, -1 padded); or every entry whose window ended at or before p (HCA: entries
  j < (p + 1) // m);
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
# An entry over at most this many whole blocks has them loaded once per entry and picked per
# element (V4-Flash's HCA entries: 2 blocks of 64 tokens); past it, a table load per element.
MAX_ENTRY_BLOCKS = tl.constexpr(8)


def slots_of(block_tables, seq_ids, positions, block_size: int) -> torch.Tensor:
    """Cache slots (int64) of `positions` [...] of sequences `seq_ids` (broadcast to them); -1
    where a position is negative."""
    where = positions.clamp(min=0)
    blocks = block_tables[seq_ids, torch.div(where, block_size, rounding_mode="floor")].long()
    slots = blocks * block_size + where % block_size
    return torch.where(positions >= 0, slots, -1)


def entry_slots(
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_ids: torch.Tensor,  # [T] int64
    entries: torch.Tensor,  # [T, K] int64 entry numbers (< 0: none)
    spread: tuple[int, int, int],  # (rate, share, column)
    dim: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the entries' elements lie: [T, K, dim] slots (-1 for no entry) and [dim] columns."""
    rate, share, column = spread
    element = torch.arange(dim, device=entries.device)
    where = entries[..., None] * rate + element // share  # [T, K, dim] token positions
    where = torch.where(entries[..., None] >= 0, where, -1)
    slots = slots_of(block_tables, seq_ids[:, None, None], where, block_size)
    return slots, column + element % share


def gather_entries(cache, block_tables, seq_ids, entries, spread, dim) -> torch.Tensor:
    """[T, K, dim] the entries' values (zeros for no entry) from the paged cache."""
    slots, columns = entry_slots(block_tables, seq_ids, entries, spread, dim, cache.shape[1])
    rows = cache.view(-1, cache.shape[-1])
    values = rows[slots.clamp(min=0), columns]
    return values.masked_fill(slots < 0, 0)


def v4_attention_reference(
    queries: torch.Tensor,  # [T, N, D]
    window_cache: torch.Tensor,  # [num_window_blocks, block_size, Ww]: keys at [0, D)
    window_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    cache: torch.Tensor,  # [num_blocks, block_size, Wm]: the spread entries
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    seq_ids: torch.Tensor,  # [T] int64: each query's sequence (row of the tables)
    positions: torch.Tensor,  # [T] int64
    window: int,
    spread: tuple[int, int, int] | None,  # the entries' (rate, share, column); None: no entries
    entry_list: torch.Tensor | None,  # [T, K] int32 entry numbers (-1 padded); None: every
    max_entries: int,  # without a list: >= every query's visible entries
    sinks: torch.Tensor,  # [N] float32
    scale: float,
    max_position: int,  # >= every query's position + 1 (a host bound)
) -> torch.Tensor:  # [T, N, D]
    dim, block_size = queries.shape[-1], window_cache.shape[1]
    rows = window_cache.view(-1, window_cache.shape[-1])
    width = min(window, max_position)
    where = positions[:, None] - torch.arange(width, device=positions.device)  # [T, w]
    window_slots = slots_of(window_tables, seq_ids[:, None], where, block_size)
    keys, valid = rows[window_slots.clamp(min=0), :dim], window_slots >= 0
    if spread is not None:
        if entry_list is None:  # every entry it has reached
            entry = torch.arange(max_entries, device=positions.device)  # [E]
            visible = torch.div(positions + 1, spread[0], rounding_mode="floor")
            entries = torch.where(entry[None] < visible[:, None], entry[None], -1)  # [T, E]
        else:
            entries = entry_list.long()
        values = gather_entries(cache, block_tables, seq_ids, entries, spread, dim)
        keys = torch.cat([keys, values.to(keys.dtype)], dim=1)
        valid = torch.cat([valid, entries >= 0], dim=1)
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
    values, slots = values.contiguous(), slots.contiguous()
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
def _spread_keys(cache_ptr, table, entry, valid, offs_d, dim_mask, stride_row, column,
                 RATE: tl.constexpr, SHARE: tl.constexpr, BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_D] the entries' values: element c of entry j in the row of token
    j * RATE + c // SHARE at column + c % SHARE (zeros where not valid)."""
    mask = valid[:, None] & dim_mask[None, :]
    if BLOCK_SIZE % RATE == 0:
        # An entry's rows lie in one block (CSA): one table load per entry, and each row's
        # SHARE columns contiguous, so the values load as vectors (per element, the table and
        # scalar loads made this kernel a third of V4's prefill: profile_long_prefill.py).
        first_row = entry.to(tl.int32) * RATE  # [BLOCK_N] the entry's first token
        blocks = tl.load(table + first_row // BLOCK_SIZE, mask=valid, other=0)
        rows = tl.maximum(blocks, 0) * BLOCK_SIZE + first_row % BLOCK_SIZE  # [BLOCK_N] slots
        columns = (offs_d // SHARE) * stride_row + offs_d % SHARE  # [BLOCK_D]
        ptrs = cache_ptr + column + (rows.to(tl.int64) * stride_row)[:, None] + columns[None, :]
        return tl.load(ptrs, mask=mask, other=0.0)
    # int32 positions and slots ([BLOCK_N, BLOCK_D] of int64 spilled registers on sm_90,
    # benchmarks/compile_dsa_kernels.py); only the byte offsets are int64
    where = entry.to(tl.int32)[:, None] * RATE + offs_d[None, :] // SHARE  # tokens
    if RATE % BLOCK_SIZE == 0 and RATE // BLOCK_SIZE <= MAX_ENTRY_BLOCKS:
        # An entry over whole blocks (HCA: 128 tokens, blocks of 64): its few blocks loaded once
        # each ([BLOCK_N] loads) and picked per element, instead of a table load per element.
        parts = offs_d[None, :] // (SHARE * BLOCK_SIZE)  # [1, BLOCK_D] which of its blocks
        first_block = entry.to(tl.int32) * (RATE // BLOCK_SIZE)  # [BLOCK_N] table index
        blocks = tl.load(table + first_block, mask=valid, other=0)[:, None]
        for part in tl.static_range(1, RATE // BLOCK_SIZE):
            block = tl.load(table + first_block + part, mask=valid, other=0)
            blocks = tl.where(parts == part, block[:, None], blocks)
    else:  # an entry across blocks at any offset: each element's row through the table
        blocks = tl.load(table + where // BLOCK_SIZE, mask=mask, other=0)
    rows = tl.maximum(blocks, 0) * BLOCK_SIZE + where % BLOCK_SIZE
    ptrs = cache_ptr + rows.to(tl.int64) * stride_row + column + offs_d[None, :] % SHARE
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _v4_attention_kernel(
    q_ptr, window_ptr, window_tables_ptr, cache_ptr, tables_ptr, seq_ptr, pos_ptr, list_ptr,
    sinks_ptr, out_ptr, num_heads, scale, window, entry_col, list_len,
    stride_qt, stride_qh, stride_window_row, stride_window_table, stride_row, stride_table,
    stride_list, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, ENTRIES: tl.constexpr, RATE: tl.constexpr, SHARE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    query = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head_mask, dim_mask = offs_h < num_heads, offs_d < HEAD_DIM
    q_ptrs = q_ptr + query * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
    position = tl.load(pos_ptr + query).to(tl.int32)
    seq = tl.load(seq_ptr + query).to(tl.int64)
    window_table = window_tables_ptr + seq * stride_window_table
    table = tables_ptr + seq * stride_table
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(tl.maximum(position - window + 1, 0), position + 1, BLOCK_N):
        where = start + tl.arange(0, BLOCK_N)
        valid = where <= position
        blocks = tl.load(window_table + where // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        rows = tl.maximum(blocks, 0) * BLOCK_SIZE + where % BLOCK_SIZE  # -1: past the table
        k_ptrs = window_ptr + rows[:, None] * stride_window_row + offs_d[None, :]
        keys = tl.load(k_ptrs, mask=valid[:, None] & dim_mask[None, :], other=0.0).to(q.dtype)
        m_i, l_i, acc = _attend_tile(q, keys, valid, m_i, l_i, acc, scale, DOT_PRECISION)
    if ENTRIES == 1:  # the listed entries
        for start in range(0, list_len, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            entry = tl.load(list_ptr + query * stride_list + offs_n, mask=offs_n < list_len,
                            other=-1).to(tl.int64)  # fmt: skip
            valid = entry >= 0
            keys = _spread_keys(cache_ptr, table, entry, valid, offs_d, dim_mask, stride_row,
                                entry_col, RATE, SHARE, BLOCK_SIZE).to(q.dtype)  # fmt: skip
            m_i, l_i, acc = _attend_tile(q, keys, valid, m_i, l_i, acc, scale, DOT_PRECISION)
    if ENTRIES == 2:  # every entry whose window has ended
        for start in range(0, (position + 1) // RATE, BLOCK_N):
            entry = (start + tl.arange(0, BLOCK_N)).to(tl.int64)
            valid = entry < (position + 1) // RATE
            keys = _spread_keys(cache_ptr, table, entry, valid, offs_d, dim_mask, stride_row,
                                entry_col, RATE, SHARE, BLOCK_SIZE).to(q.dtype)  # fmt: skip
            m_i, l_i, acc = _attend_tile(q, keys, valid, m_i, l_i, acc, scale, DOT_PRECISION)
    sink = tl.load(sinks_ptr + offs_h, mask=head_mask, other=0.0)
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp(m_i - m_new)
    total = l_i * alpha + tl.exp(sink - m_new)
    out = acc * (alpha / total)[:, None]
    o_ptrs = out_ptr + query * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & dim_mask[None, :])


def kernel_constants(dtype: torch.dtype, num_heads: int, head_dim: int, block_size: int,
                     entries: int, rate: int = 1, share: int = 1) -> dict:  # fmt: skip
    """Meta-parameters of the kernel (the launcher's, and an offline compile's)."""
    return dict(
        HEAD_DIM=head_dim, BLOCK_H=16, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=16 if dtype == torch.float32 else 32, BLOCK_SIZE=block_size, ENTRIES=entries,
        RATE=max(rate, 1), SHARE=max(share, 1), DOT_PRECISION=dot_precision(dtype),
    )  # fmt: skip


def _check_dense(*caches: torch.Tensor) -> None:
    for cache in caches:
        if cache.stride(-1) != 1 or cache.stride(0) != cache.shape[1] * cache.stride(1):
            raise ValueError("caches must have dense rows and blocks one after another")


def v4_attention(queries, window_cache, window_tables, cache, block_tables, seq_ids, positions,
                 window, spread, entry_list, max_entries, sinks, scale, max_position,
                 num_warps: int = 8):  # fmt: skip
    """The reference's result (same arguments) from the Triton kernel."""
    num_queries, num_heads, head_dim = queries.shape
    if queries.stride(-1) != 1:
        raise ValueError("queries must be dense in their last dim")
    _check_dense(window_cache, cache)
    # The kernel reads these a row (tables) or an element (per query) at a time: dense.
    window_tables, block_tables = window_tables.contiguous(), block_tables.contiguous()
    seq_ids, positions = seq_ids.contiguous(), positions.contiguous()
    if entry_list is not None:
        entry_list = entry_list.contiguous()
    kind = NO_ENTRIES if spread is None else EVERY_ENTRY if entry_list is None else LISTED_ENTRIES
    rate, share, column = spread if spread is not None else (1, 1, 0)
    listed = entry_list if entry_list is not None else block_tables  # any int tensor
    out = torch.empty_like(queries)
    constants = kernel_constants(
        queries.dtype, num_heads, head_dim, window_cache.shape[1], kind, rate, share
    )
    grid = (num_queries, triton.cdiv(num_heads, constants["BLOCK_H"]))
    _v4_attention_kernel[grid](
        queries, window_cache, window_tables, cache, block_tables, seq_ids, positions, listed,
        sinks, out, num_heads, scale, window, column,
        listed.shape[1] if entry_list is not None else 0,
        queries.stride(0), queries.stride(1), window_cache.stride(1), window_tables.stride(0),
        cache.stride(1), block_tables.stride(0), listed.stride(0), out.stride(0), out.stride(1),
        **constants, num_warps=num_warps,
    )  # fmt: skip
    return out
