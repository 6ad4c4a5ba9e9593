"""The lightning indexer's Triton scores + bounded top-k (interpreter on CPU) against the torch
reference. torch.topk breaks ties in no set order, so selections are compared by the reference
scores of the chosen tokens (sorted), and by the -1 padding, not by their slots."""

import pytest
import torch

from rayinfer.kernels.dsa.dsa_indexer import (
    chosen_slots,
    context_slots,
    dsa_index_topk,
    dsa_index_topk_reference,
    queries_per_chunk,
)
from rayinfer.kernels.dsa.sparse_mla import sparse_mla_attention, sparse_mla_attention_reference

TOLERANCES = {torch.float32: 1e-5, torch.float16: 1e-3}


def paged_batch(seq_lens, query_lens, block_size, generator):
    """(block_tables [B, max_blocks] int32 over shuffled blocks, -1 padded; query_seq [T] int32;
    positions [T] int64: each sequence's last query_lens tokens; number of blocks)."""
    counts = [-(-n // block_size) for n in seq_lens]
    pool = torch.randperm(sum(counts) + 2, generator=generator).to(torch.int32)
    tables = torch.full((len(seq_lens), max(counts) + 1), -1, dtype=torch.int32)
    start = 0
    for seq, count in enumerate(counts):
        tables[seq, :count] = pool[start : start + count]
        start += count
    query_seq = torch.cat([torch.full((q,), i, dtype=torch.int32)
                           for i, q in enumerate(query_lens)])  # fmt: skip
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(seq_lens, query_lens)])
    return tables, query_seq, positions, len(pool)


def repeat_rows(kv_cache, columns: slice, distinct: int) -> None:
    """Cache rows' `columns` set to those of the first `distinct` rows, repeated."""
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    copies = -(-len(flat) // distinct)
    flat[:, columns] = flat[:distinct, columns].repeat(copies, 1)[: len(flat)]


def slot_scores(q_index, weights, kv_cache, key_offset, tables, query_seq, max_context):
    """{slot: reference score} per query, over its whole context window."""
    slots = context_slots(tables, query_seq, kv_cache.shape[1], max_context)  # [T, S]
    flat = kv_cache.view(-1, kv_cache.shape[-1])[:, key_offset : key_offset + q_index.shape[-1]]
    keys = flat[slots.clamp(min=0)].double()  # [T, S, D]
    logits = torch.einsum("thd,tsd->ths", q_index.double(), keys).relu()
    scores = torch.einsum("th,ths->ts", weights.double(), logits)  # [T, S]
    return [dict(zip(s.tolist(), v.tolist())) for s, v in zip(slots, scores)]


def assert_same_selection(ours, reference, scores, tol):
    """Same -1 count per query, distinct slots, and the same sorted scores chosen."""
    assert ours.shape == reference.shape and ours.dtype == torch.int32
    for row, ref_row, by_slot in zip(ours.tolist(), reference.tolist(), scores):
        chosen = [s for s in row if s >= 0]
        assert len(chosen) == len(set(chosen)) == sum(s >= 0 for s in ref_row)
        ours_scores = sorted(by_slot[s] for s in chosen)
        ref_scores = sorted(by_slot[s] for s in ref_row if s >= 0)
        torch.testing.assert_close(ours_scores, ref_scores, atol=tol, rtol=tol)


def run_case(seq_lens, query_lens, num_heads, head_dim, block_size, topk, dtype, key_offset=5,
             score_bytes=1 << 30, seed=0, tie_keys=False):  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    tables, query_seq, positions, num_blocks = paged_batch(seq_lens, query_lens, block_size,
                                                           generator)  # fmt: skip
    width = key_offset + head_dim + 3  # columns after the key too
    kv_cache = torch.randn(num_blocks, block_size, width, generator=generator).to(dtype)
    if tie_keys:  # four distinct keys only: most scores tie
        repeat_rows(kv_cache, slice(key_offset, key_offset + head_dim), 4)
    q_index = torch.randn(len(positions), num_heads, head_dim, generator=generator).to(dtype)
    weights = torch.randn(len(positions), num_heads, generator=generator)
    max_context = max(seq_lens) + 3  # a host bound past every query
    args = (q_index, weights, kv_cache, key_offset, tables, query_seq, positions, topk,
            max_context)  # fmt: skip
    ours = dsa_index_topk(*args, score_bytes=score_bytes)
    reference = dsa_index_topk_reference(*args)
    scores = slot_scores(q_index, weights, kv_cache, key_offset, tables, query_seq, max_context)
    assert_same_selection(ours, reference, scores, TOLERANCES[dtype])
    return ours, reference, args


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize(
    "seq_lens,query_lens,num_heads,head_dim,block_size,topk",
    [
        ([37, 9, 50], [6, 1, 3], 5, 24, 4, 8),  # a chunk over its cached prefix, decodes
        ([70], [70], 3, 16, 16, 20),  # a whole prompt: early queries see fewer than top-k
        ([12, 5], [1, 1], 4, 32, 1, 64),  # top-k past every context; block_size 1
        ([33, 40], [2, 2], 6, 16, 8, 1),  # top-k = 1
    ],
)
def test_selection_matches_reference(seq_lens, query_lens, num_heads, head_dim, block_size,
                                     topk, dtype):  # fmt: skip
    run_case(seq_lens, query_lens, num_heads, head_dim, block_size, topk, dtype)


def test_bounded_score_buffer_chunks_the_queries():
    """A 2-query score buffer: the queries are scored and selected in chunks of 2 (one ends
    inside a sequence's chunk)."""
    max_context = 53
    assert queries_per_chunk(9, max_context, 2 * 4 * max_context) == 2
    run_case([50, 20], [5, 4], 5, 16, 4, 12, torch.float32, score_bytes=2 * 4 * max_context)


def test_tied_scores_select_sets_that_attend_alike():
    """Four distinct keys and latents repeated over the cache: the scores tie and either
    selection attends to the same rows' values."""
    ours, reference, args = run_case([40, 26], [4, 2], 3, 16, 4, 10, torch.float32,
                                     tie_keys=True)  # fmt: skip
    kv_cache = args[2]
    repeat_rows(kv_cache, slice(0, 5), 4)  # latent and rope key (L 3 + R 2) of the same rows
    generator = torch.Generator().manual_seed(3)
    q_latent = torch.randn(ours.shape[0], 2, 3, generator=generator)
    q_pe = torch.randn(ours.shape[0], 2, 2, generator=generator)
    attend = lambda slots: sparse_mla_attention(q_latent, q_pe, kv_cache, slots, 0.5)
    torch.testing.assert_close(attend(ours), attend(reference), atol=1e-5, rtol=1e-5)
    expected = sparse_mla_attention_reference(q_latent, q_pe, kv_cache, reference, 0.5)
    torch.testing.assert_close(attend(ours), expected, atol=1e-5, rtol=1e-5)


def test_chosen_slots_moves_positions_to_slots_exactly():
    """Pure data movement: the same slots as the reference's [T, S] slot table, -1 past each
    query's position."""
    generator = torch.Generator().manual_seed(4)
    tables, query_seq, positions, _ = paged_batch([9, 30], [2, 3], 4, generator)
    chosen = torch.randint(0, 33, (5, 7), generator=generator)  # some past the positions
    ours = chosen_slots(chosen, tables, query_seq, positions, 4)
    table = context_slots(tables, query_seq, 4, 33)  # [T, 33]
    expected = table.gather(1, chosen).masked_fill(chosen > positions[:, None], -1)
    assert torch.equal(ours, expected.to(torch.int32))


def test_a_million_token_context_scores_256_queries_at_a_time():
    assert queries_per_chunk(16384, 1 << 20, 1 << 30) == 256
    assert queries_per_chunk(16, 8192, 1 << 30) == 16
