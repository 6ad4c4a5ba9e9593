"""The Triton kernels of the absorbed MLA decode: the split kernel (`_mla_decode_split_kernel`,
one program per head group, sequence and split of the context, streaming the latent cache once) with
its jit helpers, and the kernel that combines the splits by their log-sum-exps. Launched by
mla_decode.mla_decode_launches.
"""

from __future__ import annotations

from rayinfer.kernels.triton_compat import tl, triton


@triton.jit
def _mla_scores(
    kv_c, k_pe, q_latent, q_pe, qk_scale, in_bounds,
    TOKENS_MAJOR: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Scaled log2 scores; masked tokens -inf. [BLOCK_N, BLOCK_H] tokens-major (queries are
    given transposed: [BLOCK_L, BLOCK_H], [BLOCK_R, BLOCK_H]), else [BLOCK_H, BLOCK_N]."""
    if TOKENS_MAJOR:
        scores = tl.dot(kv_c, q_latent, input_precision=DOT_PRECISION)
        scores = tl.dot(k_pe, q_pe, scores, input_precision=DOT_PRECISION)
        scores = tl.where(in_bounds[:, None], scores * qk_scale, float("-inf"))
    else:
        scores = tl.dot(q_latent, tl.trans(kv_c), input_precision=DOT_PRECISION)
        scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=DOT_PRECISION)
        scores = tl.where(in_bounds[None, :], scores * qk_scale, float("-inf"))
    return scores


@triton.jit
def _tile_slots(table_ptr, offs_n, split_end, BLOCK_SIZE: tl.constexpr):
    """[BLOCK_N] int64 cache slots of context positions offs_n (slot 0 past split_end)."""
    block_ids = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=offs_n < split_end, other=0)
    return block_ids.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE


@triton.jit
def _mla_update(
    acc, m_i, l_i, kv_c, k_pe, q_latent, q_pe, qk_scale, in_bounds,
    TOKENS_MAJOR: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One cache tile into the online softmax: (acc, m_i, l_i) updated."""
    scores = _mla_scores(kv_c, k_pe, q_latent, q_pe, qk_scale, in_bounds, TOKENS_MAJOR,
                         DOT_PRECISION)  # fmt: skip
    if TOKENS_MAJOR:  # scores [BLOCK_N, BLOCK_H]
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        p = tl.math.exp2(scores - m_new[None, :])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = tl.dot(
            tl.trans(kv_c), p.to(kv_c.dtype), acc * alpha[None, :], input_precision=DOT_PRECISION
        )  # [BLOCK_L, BLOCK_H]
    else:  # scores [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.math.exp2(scores - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(
            p.to(kv_c.dtype), kv_c, acc * alpha[:, None], input_precision=DOT_PRECISION
        )  # [BLOCK_H, BLOCK_L]
    return acc, m_new, l_i


@triton.jit
def _mla_pointer_tile(
    cache_ptr, rows, offs_n, split_end, offs_l, offs_r, stride_slot,
    LATENT_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, EVICT_FIRST: tl.constexpr,
):  # fmt: skip
    """(kv_c [BLOCK_N, BLOCK_L], k_pe [BLOCK_N, BLOCK_R], in_bounds [BLOCK_N]) through masked
    pointer loads of the cache rows `rows`; positions past split_end read as zeros."""
    in_bounds = offs_n < split_end
    row_ptrs = cache_ptr + rows[:, None] * stride_slot  # [BLOCK_N, 1]
    l_mask = in_bounds[:, None] & (offs_l[None, :] < LATENT_RANK)
    r_mask = in_bounds[:, None] & (offs_r[None, :] < ROPE_DIM)
    if EVICT_FIRST:
        kv_c = tl.load(row_ptrs + offs_l[None, :], mask=l_mask, other=0.0,
                       eviction_policy="evict_first")  # fmt: skip
        k_pe = tl.load(row_ptrs + LATENT_RANK + offs_r[None, :], mask=r_mask, other=0.0,
                       eviction_policy="evict_first")  # fmt: skip
    else:
        kv_c = tl.load(row_ptrs + offs_l[None, :], mask=l_mask, other=0.0)
        k_pe = tl.load(row_ptrs + LATENT_RANK + offs_r[None, :], mask=r_mask, other=0.0)
    return kv_c, k_pe, in_bounds


@triton.jit
def _tile_first_slot(table_ptr, start_n, end, BLOCK_SIZE: tl.constexpr):
    """Cache slot of context position start_n (slot 0 at or past end): a tile's first row, in
    int32 (a TMA coordinate: mla_tma_fits keeps the flat cache under 2**31 slots)."""
    block_id = tl.load(table_ptr + start_n // BLOCK_SIZE, mask=start_n < end, other=0)
    return block_id * BLOCK_SIZE + start_n % BLOCK_SIZE


@triton.jit
def _mla_decode_split_kernel(
    q_latent_ptr, q_pe_ptr, cache_ptr, mid_out_ptr, mid_lse_ptr, block_tables_ptr, seq_lens_ptr,
    scale, num_heads, tokens_per_split, num_slots,
    stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_slot, stride_block_table,
    stride_mid_b, stride_mid_h, stride_mid_s,
    LATENT_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TOKENS_MAJOR: tl.constexpr, DOT_PRECISION: tl.constexpr,
    IS_ONLY_SPLIT: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    EVICT_FIRST: tl.constexpr, TABLE_IN_LOOP: tl.constexpr,
):  # fmt: skip
    """One (head group, sequence, split): partial softmax . c_kv over the split's tokens.

    Each [BLOCK_N, L + R] tile of cached rows is loaded once and feeds both dots: the scores
    (q_latent . c_kv + q_pe . k_pe) and the output (p @ c_kv, c_kv being the value too).
    TOKENS_MAJOR computes the transposed problem (scores^T = c_kv @ q^T, out^T = c_kv^T @ p^T):
    the token and latent dims are then the dots' M (BLOCK_N and L: wgmma-sized on Hopper even with
    16 heads), the queries stay in shared memory and the accumulator is [L, BLOCK_H].
    USE_TMA: the split's full tiles come through TMA descriptors (one table load per tile, no
    per-row addresses), its last partial tile through masked pointer loads."""
    head_start = tl.program_id(0) * BLOCK_H  # head groups vary fastest: they share rows in L2
    seq = tl.program_id(1).to(tl.int64)  # seq * stride: int64, as are the cache rows
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_start = split * tokens_per_split
    if not IS_ONLY_SPLIT and split > 0 and split_start >= seq_len:
        return  # past the context: the combine reads only the splits that hold tokens
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)
    heads = head_start + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    head_mask = heads < num_heads
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    qk_scale = scale * 1.4426950408889634  # log2(e): exp2 instead of exp
    ql_base = q_latent_ptr + seq * stride_qlb
    qp_base = q_pe_ptr + seq * stride_qpb
    if TOKENS_MAJOR:  # queries transposed: [BLOCK_L, BLOCK_H], [BLOCK_R, BLOCK_H]
        ql_mask = (offs_l[:, None] < LATENT_RANK) & head_mask[None, :]
        q_latent = tl.load(ql_base + heads[None, :] * stride_qlh + offs_l[:, None], mask=ql_mask,
                           other=0.0)  # fmt: skip
        qp_mask = (offs_r[:, None] < ROPE_DIM) & head_mask[None, :]
        q_pe = tl.load(qp_base + heads[None, :] * stride_qph + offs_r[:, None], mask=qp_mask,
                       other=0.0)  # fmt: skip
        acc = tl.zeros([BLOCK_L, BLOCK_H], tl.float32)
    else:  # [BLOCK_H, BLOCK_L], [BLOCK_H, BLOCK_R]
        ql_mask = head_mask[:, None] & (offs_l[None, :] < LATENT_RANK)
        q_latent = tl.load(ql_base + heads[:, None] * stride_qlh + offs_l[None, :], mask=ql_mask,
                           other=0.0)  # fmt: skip
        qp_mask = head_mask[:, None] & (offs_r[None, :] < ROPE_DIM)
        q_pe = tl.load(qp_base + heads[:, None] * stride_qph + offs_r[None, :], mask=qp_mask,
                       other=0.0)  # fmt: skip
        acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_block_table
    offs_tile = tl.arange(0, BLOCK_N)
    if USE_TMA:
        kv_desc = tl.make_tensor_descriptor(cache_ptr, shape=[num_slots, LATENT_RANK],
                                            strides=[stride_slot, 1],
                                            block_shape=[BLOCK_N, BLOCK_L])  # fmt: skip
        pe_desc = tl.make_tensor_descriptor(cache_ptr + LATENT_RANK, shape=[num_slots, ROPE_DIM],
                                            strides=[stride_slot, 1],
                                            block_shape=[BLOCK_N, BLOCK_R])  # fmt: skip
        full_end = split_start + tl.maximum(split_end - split_start, 0) // BLOCK_N * BLOCK_N
        all_in = offs_tile < BLOCK_N  # full tiles: every row is context
        # As for pointer loads: the next tile's first slot is loaded one iteration ahead.
        first_slot = _tile_first_slot(table_ptr, split_start, full_end, BLOCK_SIZE)
        if WARP_SPECIALIZE:
            for start_n in tl.range(split_start, full_end, BLOCK_N, warp_specialize=True):
                kv_c, k_pe = kv_desc.load([first_slot, 0]), pe_desc.load([first_slot, 0])
                first_slot = _tile_first_slot(table_ptr, start_n + BLOCK_N, full_end, BLOCK_SIZE)
                acc, m_i, l_i = _mla_update(acc, m_i, l_i, kv_c, k_pe, q_latent, q_pe, qk_scale,
                                            all_in, TOKENS_MAJOR, DOT_PRECISION)  # fmt: skip
        else:
            for start_n in range(split_start, full_end, BLOCK_N):
                kv_c, k_pe = kv_desc.load([first_slot, 0]), pe_desc.load([first_slot, 0])
                first_slot = _tile_first_slot(table_ptr, start_n + BLOCK_N, full_end, BLOCK_SIZE)
                acc, m_i, l_i = _mla_update(acc, m_i, l_i, kv_c, k_pe, q_latent, q_pe, qk_scale,
                                            all_in, TOKENS_MAJOR, DOT_PRECISION)  # fmt: skip
        if full_end < split_end:  # the sequence's last, partial tile
            offs_n = full_end + offs_tile
            rows = _tile_slots(table_ptr, offs_n, split_end, BLOCK_SIZE)
            kv_c, k_pe, in_bounds = _mla_pointer_tile(cache_ptr, rows, offs_n, split_end, offs_l,
                                                      offs_r, stride_slot, LATENT_RANK, ROPE_DIM,
                                                      EVICT_FIRST)  # fmt: skip
            acc, m_i, l_i = _mla_update(acc, m_i, l_i, kv_c, k_pe, q_latent, q_pe, qk_scale,
                                        in_bounds, TOKENS_MAJOR, DOT_PRECISION)  # fmt: skip
    elif TABLE_IN_LOOP:
        # Each tile's slots come from a table load of its own iteration: Triton's pipeliner makes
        # that load asynchronous too (an indirect load, a stage before the cache rows it
        # addresses), so neither waits in the loop.
        for start_n in range(split_start, split_end, BLOCK_N):
            offs_n = start_n + offs_tile  # [BLOCK_N] context positions
            rows = _tile_slots(table_ptr, offs_n, split_end, BLOCK_SIZE)
            kv_c, k_pe, in_bounds = _mla_pointer_tile(cache_ptr, rows, offs_n, split_end, offs_l,
                                                      offs_r, stride_slot, LATENT_RANK, ROPE_DIM,
                                                      EVICT_FIRST)  # fmt: skip
            acc, m_i, l_i = _mla_update(acc, m_i, l_i, kv_c, k_pe, q_latent, q_pe, qk_scale,
                                        in_bounds, TOKENS_MAJOR, DOT_PRECISION)  # fmt: skip
    else:
        # The next tile's slots are loaded one iteration ahead (carried). The pipeliner then
        # keeps that table load synchronous and issues it in the iteration whose cache copies
        # it addresses (seen in the TTGIR for sm_90): its latency is exposed every tile.
        rows = _tile_slots(table_ptr, split_start + offs_tile, split_end, BLOCK_SIZE)
        for start_n in range(split_start, split_end, BLOCK_N):
            offs_n = start_n + offs_tile  # [BLOCK_N] context positions
            kv_c, k_pe, in_bounds = _mla_pointer_tile(cache_ptr, rows, offs_n, split_end, offs_l,
                                                      offs_r, stride_slot, LATENT_RANK, ROPE_DIM,
                                                      EVICT_FIRST)  # fmt: skip
            rows = _tile_slots(table_ptr, offs_n + BLOCK_N, split_end, BLOCK_SIZE)
            acc, m_i, l_i = _mla_update(acc, m_i, l_i, kv_c, k_pe, q_latent, q_pe, qk_scale,
                                        in_bounds, TOKENS_MAJOR, DOT_PRECISION)  # fmt: skip
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty split stores zeros, weighted 0 when combined
    mid_base = mid_out_ptr + seq * stride_mid_b + split * stride_mid_s
    if TOKENS_MAJOR:
        mid_ptrs = mid_base + heads[None, :] * stride_mid_h + offs_l[:, None]
        mid_mask = (offs_l[:, None] < LATENT_RANK) & head_mask[None, :]
        part = acc / l_safe[None, :]
    else:
        mid_ptrs = mid_base + heads[:, None] * stride_mid_h + offs_l[None, :]
        mid_mask = head_mask[:, None] & (offs_l[None, :] < LATENT_RANK)
        part = acc / l_safe[:, None]
    tl.store(mid_ptrs, part.to(mid_out_ptr.dtype.element_ty), mask=mid_mask)
    if not IS_ONLY_SPLIT:  # else mid_out is the output and no combine follows
        lse = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))  # [BLOCK_H] log2
        num_splits = tl.num_programs(2)
        tl.store(mid_lse_ptr + (seq * num_heads + heads) * num_splits + split, lse,
                 mask=head_mask)  # fmt: skip


# tokens_per_split follows the batch's longest context: not specialized (its divisibility by 16
# would compile a variant per class while serving, workers/kernel_compiles.py).
@triton.jit(do_not_specialize=["tokens_per_split"])
def _mla_combine_kernel(
    mid_out_ptr, mid_lse_ptr, out_ptr, seq_lens_ptr, tokens_per_split,
    stride_mid_b, stride_mid_h, stride_mid_s, stride_lse_b, stride_lse_h, stride_ob, stride_oh,
    LATENT_RANK: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLITS_PER_STEP: tl.constexpr,
):  # fmt: skip
    """One (sequence, head, latent chunk): merge the splits that hold tokens by their
    log-sum-exps, reading SPLITS_PER_STEP partial rows per step so that many loads are in flight.

    A decode graph sizes its splits for the block table's width, so at short contexts most of
    them are empty: those wrote nothing and are not read. A sequence without tokens (a graph's
    padding row) gets zeros."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_l = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    l_mask = offs_l < LATENT_RANK
    live = tl.maximum(tl.cdiv(tl.load(seq_lens_ptr + seq), tokens_per_split), 1)
    lse_base = mid_lse_ptr + seq * stride_lse_b + head * stride_lse_h
    offs_all = tl.arange(0, BLOCK_S)
    lses = tl.load(lse_base + offs_all, mask=offs_all < live, other=float("-inf"))
    lse_max = tl.max(lses, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no tokens: weights all 0
    total = tl.sum(tl.math.exp2(lses - lse_max), 0)
    acc = tl.zeros([BLOCK_L], tl.float32)
    mid_base = mid_out_ptr + seq * stride_mid_b + head * stride_mid_h
    for first in range(0, live, SPLITS_PER_STEP):
        offs_s = first + tl.arange(0, SPLITS_PER_STEP)  # [SPLITS_PER_STEP]
        s_mask = offs_s < live
        weights = tl.math.exp2(tl.load(lse_base + offs_s, mask=s_mask, other=float("-inf"))
                               - lse_max)  # fmt: skip
        part_ptrs = mid_base + offs_s[:, None] * stride_mid_s + offs_l[None, :]
        parts = tl.load(part_ptrs, mask=s_mask[:, None] & l_mask[None, :], other=0.0)
        acc += tl.sum(weights[:, None] * parts, 0)  # [BLOCK_L]
    out = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_l, out, mask=l_mask)
