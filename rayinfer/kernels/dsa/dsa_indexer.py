"""DeepSeek Sparse Attention's lightning indexer: which cached tokens each query attends to.

A DSA layer's cache row is `[c_kv (L) | k_pe (R) | index key (D)]`; the indexer key of every token
sits at columns `[key_offset, key_offset + D)`. For a query at position p with indexer heads
q [Hi, D] and per-head weights w [Hi], the score of an earlier token t <= p is

    score(t) = sum_h w[h] * relu(q[h] . k[t])

and the query attends to the `topk` tokens of highest score (all of its p + 1 tokens when there
are no more). The softmax scale D^-0.5 and transformers' Hi^-0.5 are folded into w (relu commutes
with a positive factor).

- `dsa_write_cache`: store each new token's full row (latent, rope key, indexer key).
- `dsa_index_topk`: the selection, as cache slots (block * block_size + offset), -1 padded.

DeepSeek-V4's CSA layers index pooled entries instead of tokens (`spread` = (m, share)): entry
j pools positions [j * m, (j + 1) * m), which a query at p sees once it has passed them
(j < (p + 1) // m); its key's element c lies in the row of token j * m + c // share, column
key_offset + c % share (config_v4.EntrySpread). Every "context position" below is then an
entry number, and the selection is entry numbers (-1 padded) instead of cache slots.

On a GPU, `dsa_index_topk` scores with a Triton kernel: one program per (query, chunk of
KEYS_PER_PROGRAM context positions) holds the query's Hi x D heads and reads the chunk's keys
BLOCK_N at a time through the block table; the head sum is fused, so only the [T, S] float32
scores are written (never [T, Hi, S]). A radix select (kernels/dsa/radix_topk.py) for small
decode steps, torch.topk for the rest (SELECTIONS), then picks from the scores of a bounded
number of queries at a time (SCORE_BUFFER_BYTES), so a 1M-token context needs no more than 1 GiB.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.attention.paged_attention import dot_precision, launch_params
from rayinfer.kernels.dsa.dsa_index_fp8 import (
    check_key_region,
    gather_index_keys,
    write_index_keys_reference,
)
from rayinfer.kernels.dsa.radix_topk import radix_topk
from rayinfer.kernels.triton_compat import tl, triton

# How dsa_index_topk picks the top-k of its scores; "auto": the radix select for chunks of at
# most configs/radix_topk.json's `max_elements` scores (small decode steps: 1.5-1.8x torch.topk
# at 1 x 128k, 1.07x at 16 x 128k, slower from 64 x 128k and at 16 x 1M), torch.topk for more
# (benchmarks/topk_probe.py over the indexer's own scores, CUDA graphs, H200).
SELECTIONS = ("auto", "radix", "torch")
SCORE_BUFFER_BYTES = 1 << 30  # [queries, max_context] float32 scores: 256 queries at 1M tokens
# float32 on a GPU (parity checks): 64-key tiles of 128-wide float32 keys spill registers
# (sm_89: 256 spill instructions, benchmarks/compile_dsa_kernels.py), 16-key ones do not.
FLOAT32_TILES = dict(BLOCK_N=16, num_stages=2)


def dsa_write_cache_reference(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, W]: updated in place
    slot_mapping: torch.Tensor,  # [T] int64: block_id * block_size + offset; < 0 skips the token
    kv_c: torch.Tensor,  # [T, L] normed latent
    k_pe: torch.Tensor,  # [T, R] roped shared key
    index_key: torch.Tensor | None,  # [T, D] roped indexer key; None: a layer without indexer
    index_fp8: bool = False,  # the key as FP8 bytes + float32 scale (kernels/dsa/dsa_index_fp8.py)
) -> None:
    """The rows' L + R + D columns (the first L + R without an index key) at their slots."""
    is_real = slot_mapping >= 0  # [T]: padding tokens have no slot
    parts = [kv_c, k_pe] if index_key is None or index_fp8 else [kv_c, k_pe, index_key]
    rows = torch.cat(parts, dim=-1)[is_real].to(kv_cache.dtype)  # [T', L + R (+ D)]
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    flat[slot_mapping[is_real], : rows.shape[1]] = rows
    if index_key is not None and index_fp8:
        key_offset = kv_c.shape[-1] + k_pe.shape[-1]
        write_index_keys_reference(kv_cache, slot_mapping[is_real], key_offset, index_key[is_real])


def context_slots(
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    query_seq: torch.Tensor,  # [T] int: the sequence of each query
    block_size: int,
    max_context: int,
) -> torch.Tensor:  # [T, max_context] int64: slot of each of the query's context positions
    positions = torch.arange(max_context, device=block_tables.device)  # [S]
    tables = block_tables.long()[query_seq.long()]  # [T, max_blocks]
    block_index = (positions // block_size).clamp(max=tables.shape[1] - 1)  # [S]
    return tables[:, block_index] * block_size + positions % block_size  # [T, S]


def cached_keys(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, W]
    key_offset: int,
    head_dim: int,
    slots: torch.Tensor,  # [...] int64 slots (>= 0)
    index_fp8: bool,
) -> torch.Tensor:  # [..., D] float32: the slots' index keys (FP8 ones dequantized)
    if index_fp8:
        return gather_index_keys(kv_cache, key_offset, head_dim, slots)
    flat = kv_cache.view(-1, kv_cache.shape[-1])[:, key_offset : key_offset + head_dim]
    return flat[slots].float()


def dsa_index_topk_reference(
    q_index: torch.Tensor,  # [T, Hi, D] roped indexer queries
    weights: torch.Tensor,  # [T, Hi] float32: per-head weights, both scales folded in
    kv_cache: torch.Tensor,  # [num_blocks, block_size, W], index keys at [key_offset, +D)
    key_offset: int,
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    query_seq: torch.Tensor,  # [T] int32: the sequence (row of block_tables) of each query
    positions: torch.Tensor,  # [T] int64: each query's position; it sees positions <= its own
    topk: int,
    max_context: int,  # >= every query's position + 1 (a host bound: no device sync)
    index_fp8: bool = False,  # FP8 keys + scales from key_offset (kernels/dsa/dsa_index_fp8.py)
    spread: tuple[int, int] | None = None,  # V4: (rate, share) of pooled entries (see above)
) -> torch.Tensor:  # [T, topk] int32: cache slots (V4: entry numbers) chosen, -1 padded
    """Scores in float32 over every query's context, highest `topk` kept, in no set order."""
    num_queries, head_dim = q_index.shape[0], q_index.shape[-1]
    block_size = kv_cache.shape[1]
    entry_stride = spread[0] if spread is not None else 1
    if spread is None:
        slots = context_slots(block_tables, query_seq, block_size, max_context)
        keys = cached_keys(kv_cache, key_offset, head_dim, slots.clamp(min=0), index_fp8)
    else:  # [T, S, D] from the rows the entries spread over
        from rayinfer.kernels.dsa.v4_attention import gather_entries

        entries = torch.arange(max_context, device=q_index.device).expand(num_queries, -1)
        keys = gather_entries(kv_cache, block_tables.long(), query_seq.long(), entries,
                              (*spread, key_offset), head_dim).float()  # fmt: skip
        slots = entries
    scores = torch.einsum("thd,tsd->ths", q_index.float(), keys).relu()  # [T, Hi, S]
    scores = torch.einsum("th,ths->ts", weights.float(), scores)  # [T, S]
    entries = torch.arange(max_context, device=q_index.device)
    visible = entries < torch.div(positions[:, None] + 1, entry_stride, rounding_mode="floor")
    scores = scores.masked_fill(~visible, float("-inf"))
    k = min(topk, max_context)
    chosen = scores.topk(k, dim=-1).indices  # [T, k]
    chosen_slots = slots.gather(1, chosen)
    chosen_slots = chosen_slots.masked_fill(~visible.gather(1, chosen), -1)
    out = torch.full((num_queries, topk), -1, dtype=torch.int32, device=q_index.device)
    out[:, :k] = chosen_slots.to(torch.int32)
    return out


@triton.jit
def _index_scores_kernel(
    q_ptr, weights_ptr, cache_ptr, block_tables_ptr, query_seq_ptr, positions_ptr, scores_ptr,
    num_heads, max_context, key_offset,
    stride_qt, stride_qh, stride_wt, stride_row, stride_table, stride_scores,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    KEYS_PER_PROGRAM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    KEY_FP8: tl.constexpr, ENTRY_STRIDE: tl.constexpr, SHARE: tl.constexpr,
):  # fmt: skip
    """One (query, chunk of context positions): scores[t, s] = sum_h w[h] * relu(q[h] . k[s])
    for the visible positions s <= the query's, -inf for the rest of the chunk.

    KEY_FP8: cache_ptr is the cache's fp8 byte view (key_offset, stride_row in bytes), each key
    D fp8 bytes then its float32 scale. fp8 -> q's dtype is exact, and q . (k_fp8 * scale) is
    (q . k_fp8) * scale: the scale multiplies the [BLOCK_H, BLOCK_N] logits (relu commutes with
    a scale >= 0) instead of the [BLOCK_N, D] keys.

    SHARE > 0 (V4's spread entries): the key of entry j from the rows of tokens
    j * ENTRY_STRIDE + c // SHARE, columns key_offset + c % SHARE."""
    query = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * KEYS_PER_PROGRAM
    chunk_end = tl.minimum(first + KEYS_PER_PROGRAM, max_context)
    position = tl.load(positions_ptr + query).to(tl.int32)
    visible_end = tl.minimum((position + 1) // ENTRY_STRIDE, chunk_end)
    score_row = scores_ptr + query * stride_scores
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head_mask = offs_h < num_heads
    q_ptrs = q_ptr + query * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=head_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    w = tl.load(weights_ptr + query * stride_wt + offs_h, mask=head_mask, other=0.0)  # [BLOCK_H]
    table_ptr = block_tables_ptr + tl.load(query_seq_ptr + query).to(tl.int64) * stride_table
    key_base = cache_ptr + key_offset
    for start in range(first, visible_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] context positions (entries)
        is_visible = offs_n < visible_end
        k_mask = is_visible[:, None] & (offs_d[None, :] < HEAD_DIM)
        if SHARE > 0 and BLOCK_SIZE % ENTRY_STRIDE == 0:
            # An entry's rows lie in one block: one table load per entry, and each row's SHARE
            # columns contiguous, so the keys load as vectors (per element, the table loads and
            # scalar key loads made this kernel most of V4's prefill: profile_long_prefill.py).
            first_row = offs_n * ENTRY_STRIDE  # [BLOCK_N] the entry's first token
            block_ids = tl.load(table_ptr + first_row // BLOCK_SIZE, mask=is_visible, other=0)
            rows = tl.maximum(block_ids.to(tl.int64), 0) * BLOCK_SIZE + first_row % BLOCK_SIZE
            columns = (offs_d // SHARE) * stride_row + offs_d % SHARE  # [BLOCK_D]
            k_ptrs = key_base + (rows * stride_row)[:, None] + columns[None, :]
        elif SHARE > 0:  # an entry across blocks: each element's row through the table
            where = offs_n[:, None].to(tl.int64) * ENTRY_STRIDE + offs_d[None, :] // SHARE
            block_ids = tl.load(table_ptr + where // BLOCK_SIZE, mask=k_mask, other=0)
            rows = tl.maximum(block_ids.to(tl.int64), 0) * BLOCK_SIZE + where % BLOCK_SIZE
            k_ptrs = key_base + rows * stride_row + offs_d[None, :] % SHARE
        else:
            block_ids = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=is_visible, other=0)
            rows = block_ids.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE  # [BLOCK_N] slots
            k_ptrs = key_base + rows[:, None] * stride_row + offs_d[None, :]
        keys = tl.load(k_ptrs, mask=k_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        logits = tl.dot(q, tl.trans(keys), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        if KEY_FP8:
            scale_ptrs = key_base + rows * stride_row + HEAD_DIM  # [BLOCK_N] after each key
            scale_ptrs = scale_ptrs.to(tl.pointer_type(tl.float32), bitcast=True)
            logits *= tl.load(scale_ptrs, mask=is_visible, other=0.0)[None, :]
        scores = tl.sum(w[:, None] * tl.maximum(logits, 0.0), 0)  # [BLOCK_N]
        scores = tl.where(is_visible, scores, float("-inf"))
        tl.store(score_row + offs_n, scores, mask=offs_n < chunk_end)
    # The chunk's tiles past the query's position (whole tiles: the loop's last one ended there).
    hidden_start = first + tl.cdiv(tl.maximum(visible_end - first, 0), BLOCK_N) * BLOCK_N
    for start in range(hidden_start, chunk_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        hidden = tl.full([BLOCK_N], float("-inf"), tl.float32)
        tl.store(score_row + offs_n, hidden, mask=offs_n < chunk_end)


def score_constants(params: dict, dtype: torch.dtype, num_heads: int, head_dim: int,
                    block_size: int, key_fp8: bool = False,
                    spread: tuple[int, int] | None = None) -> dict:  # fmt: skip
    """The score kernel's meta-parameters (the launcher's, and the offline compile's in
    benchmarks/compile_dsa_kernels.py)."""
    return dict(
        HEAD_DIM=head_dim, BLOCK_H=max(16, triton.next_power_of_2(num_heads)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=params["BLOCK_N"],
        KEYS_PER_PROGRAM=params["KEYS_PER_PROGRAM"], BLOCK_SIZE=block_size,
        DOT_PRECISION=dot_precision(dtype), KEY_FP8=key_fp8,
        ENTRY_STRIDE=spread[0] if spread else 1, SHARE=spread[1] if spread else 0,
    )  # fmt: skip


def index_scores(
    q_index: torch.Tensor,  # [T, Hi, D]
    weights: torch.Tensor,  # [T, Hi] float32
    kv_cache: torch.Tensor,  # [num_blocks, block_size, W]
    key_offset: int,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_seq: torch.Tensor,  # [T] int32
    positions: torch.Tensor,  # [T] int64
    scores: torch.Tensor,  # [T, max_context] float32, written
    params: dict,
    index_fp8: bool = False,  # FP8 keys + scales from key_offset (kernels/dsa/dsa_index_fp8.py)
    spread: tuple[int, int] | None = None,
) -> None:
    """The Triton kernel's launch over every query and context chunk."""
    num_queries, num_heads, head_dim = q_index.shape
    max_context = scores.shape[1]
    block_size, stride_row = kv_cache.shape[1], kv_cache.stride(1)
    if index_fp8:  # the kernel reads the rows as bytes
        element = kv_cache.element_size()
        key_offset, stride_row = key_offset * element, stride_row * element
        kv_cache = kv_cache.view(torch.float8_e4m3fn)  # [blocks, block_size, W x element]
    grid = (num_queries, triton.cdiv(max_context, params["KEYS_PER_PROGRAM"]))
    constants = score_constants(
        params, q_index.dtype, num_heads, head_dim, block_size, index_fp8, spread
    )
    _index_scores_kernel[grid](
        q_index, weights, kv_cache, block_tables, query_seq, positions, scores,
        num_heads, max_context, key_offset,
        q_index.stride(0), q_index.stride(1), weights.stride(0), stride_row,
        block_tables.stride(0), scores.stride(0),
        **constants, num_warps=params["num_warps"], num_stages=params["num_stages"],
    )  # fmt: skip


def queries_per_chunk(num_queries: int, max_context: int, score_bytes: int) -> int:
    """Queries scored at once so that their [n, max_context] float32 scores fit score_bytes."""
    return max(1, min(num_queries, score_bytes // (4 * max_context)))


def index_params(q_index: torch.Tensor) -> dict:
    """Tiles of the score kernel from configs/dsa_indexer.json."""
    params = launch_params("dsa_indexer", q_index.device)
    if q_index.dtype == torch.float32 and q_index.is_cuda:
        params = {**params, **FLOAT32_TILES}
    return params


def chosen_slots(
    chosen: torch.Tensor,  # [T, k] int64: chosen context positions
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_seq: torch.Tensor,  # [T] int
    positions: torch.Tensor,  # [T] int64
    block_size: int,
) -> torch.Tensor:  # [T, k] int32: their cache slots, -1 where past the query's position
    """Positions to slots without a [T, max_blocks] copy of the tables (one gather of [T, k])."""
    block_index = (chosen // block_size).clamp(max=block_tables.shape[1] - 1)  # [T, k]
    blocks = block_tables[query_seq.long()[:, None], block_index].long()  # [T, k]
    slots = blocks * block_size + chosen % block_size
    return slots.masked_fill(chosen > positions[:, None], -1).to(torch.int32)


def dsa_index_topk(
    q_index: torch.Tensor,  # [T, Hi, D] roped indexer queries
    weights: torch.Tensor,  # [T, Hi] float32
    kv_cache: torch.Tensor,  # [num_blocks, block_size, W], index keys at [key_offset, +D)
    key_offset: int,
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    query_seq: torch.Tensor,  # [T] int32
    positions: torch.Tensor,  # [T] int64
    topk: int,
    max_context: int,  # >= every query's position + 1
    index_fp8: bool = False,  # FP8 keys + scales from key_offset (kernels/dsa/dsa_index_fp8.py)
    score_bytes: int = SCORE_BUFFER_BYTES,  # bound of the score buffer (tests make it small)
    params: dict | None = None,  # tile override; else configs/dsa_indexer.json
    spread: tuple[int, int] | None = None,  # V4: (rate, share) of pooled entries (see above)
    selection: str = "auto",  # SELECTIONS: radix (kernels/dsa/radix_topk.py), torch.topk
) -> torch.Tensor:  # [T, topk] int32: cache slots (V4: entry numbers) chosen, -1 padded
    """The reference's selection: Triton scores, then the top-k of bounded chunks of queries."""
    num_queries, num_heads, head_dim = q_index.shape
    if weights.shape != (num_queries, num_heads) or weights.dtype != torch.float32:
        raise ValueError(f"weights {tuple(weights.shape)} {weights.dtype} must be "
                         f"[T, Hi] = [{num_queries}, {num_heads}] float32")  # fmt: skip
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache rows must be dense")
    if index_fp8:
        check_key_region(kv_cache, key_offset, head_dim)
    elif kv_cache.shape[-1] < key_offset + (spread[1] if spread else head_dim):
        width = spread[1] if spread else head_dim
        raise ValueError(f"kv_cache rows {kv_cache.shape[-1]} must hold the index keys (or "
                         f"their shares) at [{key_offset}, {key_offset + width})")  # fmt: skip
    if kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1) or q_index.stride(-1) != 1:
        raise ValueError("kv_cache blocks must be one after another; q_index's last dim dense")
    if selection not in SELECTIONS:
        raise ValueError(f"selection={selection!r}; use one of {', '.join(SELECTIONS)}")
    params = {**index_params(q_index), **(params or {})}
    topk_params = launch_params("radix_topk", q_index.device)
    # The kernels step through these one element at a time, without their strides.
    block_tables, query_seq = block_tables.contiguous(), query_seq.contiguous()
    positions, weights = positions.contiguous(), weights.contiguous()
    out = torch.full((num_queries, topk), -1, dtype=torch.int32, device=q_index.device)
    k = min(topk, max_context)
    chunk = queries_per_chunk(num_queries, max_context, score_bytes)
    scores = torch.empty(chunk, max_context, dtype=torch.float32, device=q_index.device)
    for start in range(0, num_queries, chunk):
        rows = slice(start, min(start + chunk, num_queries))
        part = scores[: rows.stop - start]  # [n, S]
        index_scores(q_index[rows], weights[rows], kv_cache, key_offset, block_tables,
                     query_seq[rows], positions[rows], part, params, index_fp8,
                     spread)  # fmt: skip
        use_radix = selection == "radix" or (
            selection == "auto" and part.numel() <= topk_params["max_elements"]
        )
        if use_radix:  # the slots written by its last pass (V4: the entry numbers)
            slot_map = None
            if spread is None:
                slot_map = (block_tables, query_seq[rows], positions[rows], kv_cache.shape[1])
            radix_topk(part, k, out[rows], topk_params, slot_map)
        else:
            # unsorted: the order is not needed; 1.05-1.34x torch's sorted topk on an H200 at
            # [1-256, 128k] (benchmarks/RESULTS.md, DeepSeek Sparse Attention)
            chosen = part.topk(k, dim=-1, sorted=False).indices  # [n, k]
            if spread is None:
                out[rows, :k] = chosen_slots(chosen, block_tables, query_seq[rows],
                                             positions[rows], kv_cache.shape[1])  # fmt: skip
            else:
                out[rows, :k] = chosen.to(torch.int32)
    if spread is not None:  # entries past a query's position (fewer than k visible): none
        visible = torch.div(positions + 1, spread[0], rounding_mode="floor")
        out = out.masked_fill(out >= visible[:, None].to(out.dtype), -1)
    return out
