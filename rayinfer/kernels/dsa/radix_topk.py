"""Top-k of float32 score rows by radix select: the indexer's selection without a sort.

The k highest of a row are the entries above a threshold T (its k-th highest value) plus as many
entries equal to T as are still needed. T is found one byte at a time, highest byte first: each
float maps to an int32 key that orders as the floats do, a pass histograms one byte of the keys
that share the bytes chosen so far (256 bins), and the bin where the count from the top reaches
the k still to place is the next byte. Four passes give T exactly; a count pass and a write pass
then place the entries, each row's in ascending column order (those above T first, then the
lowest-numbered ties), so the result is the same on every run and for every split of the row.

Each pass is one launch over (row, split of the row's columns): the splits add their histograms
into [rows, 4, 256] int32 counters with atomics, and every program of the next pass reads the
finished ones to know the bytes chosen so far. A decode step's few long rows thus spread over
the whole GPU, where torch.topk runs a row on few SMs; 7 launches and about 6 reads of the
scores (`python -m rayinfer.bench kernels dsa` times it against torch.topk in the same run).

With `to_slots` the write pass also maps each chosen context position to its cache slot through
the block table (dsa_indexer.chosen_slots' rule, -1 past the query's position), so the indexer's
decode path needs no further torch ops.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.triton_compat import tl, triton

BINS = 256  # one byte of the key per pass
PASSES = 4  # a float32 key has four bytes


@triton.jit
def _ordered_keys(x):
    """float32 -> int32 that orders as the floats do (-0.0 just below +0.0): a negative float's
    bits order backwards, so every bit but the sign is flipped."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _key_byte(keys, PASS: tl.constexpr):
    """The byte of the keys a pass histograms, as a bin in [0, 256): the top byte is signed."""
    if PASS == 0:
        return (keys >> 24) + 128
    return (keys >> (24 - 8 * PASS)) & 255


@triton.jit
def _chosen_prefix(hist_row, k, PASSES_DONE: tl.constexpr):
    """(the key bytes chosen by the finished passes, as an arithmetic-shifted key; how many of
    the k are still to place among the keys that share them)."""
    bins = tl.arange(0, 256)
    prefix = 0
    remaining = k
    for p in tl.static_range(PASSES_DONE):
        counts = tl.load(hist_row + p * 256 + bins)  # [256]
        above = tl.sum(counts, 0) - tl.cumsum(counts, 0)  # [256]: keys in higher bins
        # the one bin whose keys hold the remaining-th highest (bins without keys never match)
        is_bin = (above < remaining) & (above + counts >= remaining)
        chosen = tl.sum(tl.where(is_bin, bins, 0), 0)
        remaining -= tl.sum(tl.where(is_bin, above, 0), 0)
        if p == 0:
            prefix = chosen - 128
        else:
            prefix = prefix * 256 + chosen
    return prefix, remaining


@triton.jit
def _radix_histogram_kernel(
    scores_ptr, hist_ptr, num_cols, stride_row, k, cols_per_split,
    PASS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One (row, split): the histogram of byte PASS over the split's keys that share the bytes
    chosen so far, added into hist[row, PASS]."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * cols_per_split
    last = tl.minimum(first + cols_per_split, num_cols)
    hist_row = hist_ptr + row * (4 * 256)
    prefix, _ = _chosen_prefix(hist_row, k, PASS)
    counts = tl.zeros([256], tl.int32)
    num_skipped = 0
    for start in range(first, last, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < last
        keys = _ordered_keys(tl.load(scores_ptr + row * stride_row + offs, mask=valid, other=0.0))
        if PASS > 0:
            valid = valid & ((keys >> (32 - 8 * PASS)) == prefix)
        # bins of skipped keys go to 0 and are taken off it after the loop (a histogram mask is
        # not in every Triton this runs on)
        counts += tl.histogram(tl.where(valid, _key_byte(keys, PASS), 0), 256)
        num_skipped += tl.sum((~valid).to(tl.int32), 0)
    counts -= tl.where(tl.arange(0, 256) == 0, num_skipped, 0)
    tl.atomic_add(hist_row + PASS * 256 + tl.arange(0, 256), counts)


@triton.jit
def _radix_count_kernel(
    scores_ptr, hist_ptr, split_counts_ptr, num_cols, stride_row, k, cols_per_split,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One (row, split): how many of the split's keys are above the threshold, and equal to it,
    into split_counts[row, split, 0 / 1]."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    first = split * cols_per_split
    last = tl.minimum(first + cols_per_split, num_cols)
    threshold, _ = _chosen_prefix(hist_ptr + row * (4 * 256), k, 4)
    num_above = 0
    num_equal = 0
    for start in range(first, last, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < last
        keys = _ordered_keys(tl.load(scores_ptr + row * stride_row + offs, mask=valid, other=0.0))
        num_above += tl.sum((valid & (keys > threshold)).to(tl.int32), 0)
        num_equal += tl.sum((valid & (keys == threshold)).to(tl.int32), 0)
    counts_ptr = split_counts_ptr + (row * tl.num_programs(1) + split) * 2
    tl.store(counts_ptr, num_above)
    tl.store(counts_ptr + 1, num_equal)


@triton.jit
def _radix_write_kernel(
    scores_ptr, hist_ptr, split_counts_ptr, out_ptr, block_tables_ptr, query_seq_ptr,
    positions_ptr, num_cols, stride_row, stride_out, stride_table, k, cols_per_split,
    num_splits, block_size,
    BLOCK: tl.constexpr, BLOCK_SPLITS: tl.constexpr, TO_SLOTS: tl.constexpr,
):  # fmt: skip
    """One (row, split): the split's chosen columns into out[row, :k], after those of the
    splits before it: above-threshold ones from 0, ties from the count above it overall."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    first = split * cols_per_split
    last = tl.minimum(first + cols_per_split, num_cols)
    threshold, ties_needed = _chosen_prefix(hist_ptr + row * (4 * 256), k, 4)
    splits = tl.arange(0, BLOCK_SPLITS)
    before = splits < split
    counts_row = split_counts_ptr + row * num_splits * 2
    next_above = tl.sum(tl.load(counts_row + splits * 2, mask=before, other=0), 0)
    next_tie = tl.sum(tl.load(counts_row + splits * 2 + 1, mask=before, other=0), 0)
    num_above_all = k - ties_needed  # every split's above-threshold keys come first
    out_row = out_ptr + row * stride_out
    if TO_SLOTS:
        table_row = block_tables_ptr + tl.load(query_seq_ptr + row).to(tl.int64) * stride_table
        position = tl.load(positions_ptr + row)
    for start in range(first, last, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < last
        keys = _ordered_keys(tl.load(scores_ptr + row * stride_row + offs, mask=valid, other=0.0))
        is_above = valid & (keys > threshold)
        is_tie = valid & (keys == threshold)
        above_at = next_above + tl.cumsum(is_above.to(tl.int32), 0) - 1  # [BLOCK]
        tie_rank = next_tie + tl.cumsum(is_tie.to(tl.int32), 0) - 1
        is_tie_taken = is_tie & (tie_rank < ties_needed)
        at = tl.where(is_above, above_at, num_above_all + tie_rank)
        chosen = offs
        if TO_SLOTS:  # dsa_indexer.chosen_slots: the position's slot; -1 past the query
            where = offs.to(tl.int64)
            in_query = (is_above | is_tie_taken) & (where <= position)  # the table's reach
            block = tl.load(table_row + where // block_size, mask=in_query, other=0).to(tl.int64)
            chosen = tl.where(where > position, -1, block * block_size + where % block_size)
        tl.store(out_row + at, chosen.to(out_ptr.dtype.element_ty), mask=is_above | is_tie_taken)
        next_above += tl.sum(is_above.to(tl.int32), 0)
        next_tie += tl.sum(is_tie.to(tl.int32), 0)


def choose_splits(num_rows: int, num_cols: int, params: dict) -> tuple[int, int]:
    """(splits per row, columns per split): enough programs to fill the GPU
    (`target_programs`), none with fewer than `min_cols_per_split` columns."""
    block = params["BLOCK"]
    most = max(1, num_cols // params["min_cols_per_split"])
    splits = max(1, min(most, triton.cdiv(params["target_programs"], num_rows)))
    cols_per_split = triton.cdiv(triton.cdiv(num_cols, splits), block) * block
    return triton.cdiv(num_cols, cols_per_split), cols_per_split


def radix_topk(
    scores: torch.Tensor,  # [n, S] float32, no NaN; a row's -inf entries rank lowest
    k: int,  # 1 <= k <= S
    out: torch.Tensor,  # [n, >= k] int32 or int64, columns [0, k) written
    params: dict,  # BLOCK, num_warps, target_programs, min_cols_per_split
    slot_map: tuple | None = None,  # (block_tables, query_seq, positions, block_size): write
    #                                  cache slots, not columns
) -> torch.Tensor:  # out
    """The k highest columns of every row (module docstring), in ascending column order within
    the above-threshold ones and within the ties taken."""
    num_rows, num_cols = scores.shape
    if not 1 <= k <= num_cols:
        raise ValueError(f"k = {k} must be in [1, {num_cols}] (the row length)")
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError(f"scores must be float32 with dense rows, not {scores.dtype}")
    if out.shape[0] != num_rows or out.shape[1] < k or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must be [{num_rows}, >= {k}], dense rows")
    if num_rows == 0:
        return out
    splits, cols_per_split = choose_splits(num_rows, num_cols, params)
    hist = torch.zeros(num_rows, PASSES, BINS, dtype=torch.int32, device=scores.device)
    split_counts = torch.empty(num_rows, splits, 2, dtype=torch.int32, device=scores.device)
    grid = (num_rows, splits)
    block, warps = params["BLOCK"], params["num_warps"]
    for pass_ in range(PASSES):
        _radix_histogram_kernel[grid](
            scores, hist, num_cols, scores.stride(0), k, cols_per_split,
            PASS=pass_, BLOCK=block, num_warps=warps,
        )  # fmt: skip
    _radix_count_kernel[grid](
        scores, hist, split_counts, num_cols, scores.stride(0), k, cols_per_split,
        BLOCK=block, num_warps=warps,
    )  # fmt: skip
    if slot_map is None:
        tables, query_seq, positions, block_size = out, out, out, 1
    else:
        tables, query_seq, positions, block_size = slot_map
    _radix_write_kernel[grid](
        scores, hist, split_counts, out, tables, query_seq, positions,
        num_cols, scores.stride(0), out.stride(0), tables.stride(0), k, cols_per_split,
        splits, block_size,
        BLOCK=block, BLOCK_SPLITS=max(2, triton.next_power_of_2(splits)),
        TO_SLOTS=slot_map is not None, num_warps=warps,
    )  # fmt: skip
    return out
