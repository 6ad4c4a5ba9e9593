"""Sparse absorbed MLA (Triton, interpreter on CPU) against the torch reference."""

import pytest
import torch

from rayinfer.kernels.dsa.sparse_mla import sparse_mla_attention, sparse_mla_attention_reference

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3}
SPLITS = {
    "one_split": dict(target_programs=1),  # the split kernel writes the output itself
    "many_splits": dict(target_programs=4096, min_tokens_per_split=16, max_splits=64),
}


def random_case(num_queries, num_heads, latent_rank, rope_dim, row_width, num_slots, listed,
                seed=0):  # fmt: skip
    """(q_latent, q_pe, kv_cache [num_slots, 1, W], slots [T, listed] int32) with distinct
    slots per query, about one in five -1."""
    generator = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(num_slots, 1, row_width, generator=generator)
    q_latent = torch.randn(num_queries, num_heads, latent_rank, generator=generator)
    q_pe = torch.randn(num_queries, num_heads, rope_dim, generator=generator)
    slots = torch.stack(
        [torch.randperm(num_slots, generator=generator)[:listed] for _ in range(num_queries)]
    ).to(torch.int32)
    holes = torch.rand(num_queries, listed, generator=generator) < 0.2
    holes[:, 0] = False  # every query attends to something (the reference gives NaN otherwise)
    return q_latent, q_pe, kv_cache, slots.masked_fill(holes, -1)


def assert_matches_reference(q_latent, q_pe, kv_cache, slots, dtype, params=None):
    ours = sparse_mla_attention(
        q_latent.to(dtype), q_pe.to(dtype), kv_cache.to(dtype), slots, 0.1, params=params
    )
    reference = sparse_mla_attention_reference(
        q_latent.to(dtype).float(), q_pe.to(dtype).float(), kv_cache.to(dtype).float(), slots, 0.1
    )
    assert ours.dtype == dtype and ours.shape == reference.shape
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(ours.float(), reference, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize(
    "num_queries,num_heads,latent_rank,rope_dim,row_width,num_slots,listed",
    [
        (3, 5, 64, 16, 80, 90, 37),  # odd heads and list length, rows exactly L + R
        (2, 20, 48, 8, 80, 70, 50),  # two head groups, non-power-of-two latent, W > L + R
        (1, 16, 32, 16, 48, 8, 1),  # top-k = 1
        (4, 3, 16, 8, 40, 40, 33),  # a list one entry past two 16-slot tiles
    ],
)
def test_sparse_attention_matches_reference(
    num_queries, num_heads, latent_rank, rope_dim, row_width, num_slots, listed, split, dtype
):
    case = random_case(num_queries, num_heads, latent_rank, rope_dim, row_width, num_slots, listed)
    assert_matches_reference(*case, dtype, SPLITS[split])


@pytest.mark.parametrize("split", list(SPLITS))
def test_minus_one_tail_and_whole_empty_splits(split):
    """A list of 64 with 5 slots in front (a query shorter than top-k): the splits of -1 only
    weigh nothing."""
    q_latent, q_pe, kv_cache, slots = random_case(2, 4, 32, 16, 48, 64, 64, seed=1)
    slots[:, 5:] = -1
    slots[1, :5] = torch.tensor([29, 0, 7, -1, 3])
    assert_matches_reference(q_latent, q_pe, kv_cache, slots, torch.float32, SPLITS[split])


def test_paged_cache_with_blocks_and_index_keys_after_the_latent():
    """[blocks, block_size, W] with W = L + R + D: a slot is block * block_size + offset."""
    generator = torch.Generator().manual_seed(2)
    latent_rank, rope_dim, index_dim, block_size = 32, 16, 24, 4
    kv_cache = torch.randn(6, block_size, latent_rank + rope_dim + index_dim, generator=generator)
    q_latent = torch.randn(3, 7, latent_rank, generator=generator)
    q_pe = torch.randn(3, 7, rope_dim, generator=generator)
    slots = torch.tensor([[23, 0, 5, -1], [4, 5, 6, 7], [-1, 12, -1, 1]], dtype=torch.int32)
    assert_matches_reference(q_latent, q_pe, kv_cache, slots, torch.float16)


def test_query_without_slots_gets_zeros():
    q_latent, q_pe, kv_cache, slots = random_case(2, 4, 16, 16, 32, 20, 8)
    slots[0] = -1
    out = sparse_mla_attention(q_latent, q_pe, kv_cache, slots, 0.1, params=SPLITS["many_splits"])
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    reference = sparse_mla_attention_reference(q_latent[1:], q_pe[1:], kv_cache, slots[1:], 0.1)
    torch.testing.assert_close(out[1:], reference, atol=1e-5, rtol=1e-5)


def test_rejects_a_cache_narrower_than_latent_and_rope():
    q_latent, q_pe, kv_cache, slots = random_case(1, 4, 32, 16, 40, 8, 4)
    with pytest.raises(ValueError, match="W >= L \\+ R = 48"):
        sparse_mla_attention(q_latent, q_pe, kv_cache, slots, 0.1)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize(
    "num_queries,num_heads,latent_rank,rope_dim,row_width,num_slots,listed,block_h",
    [
        (3, 20, 48, 8, 80, 70, 50, 16),  # heads past one tile, a non-power-of-two latent
        (2, 5, 64, 16, 80, 90, 37, 64),  # 5 heads in a 64-head tile (16 used), odd list
        (1, 16, 32, 16, 48, 8, 1, 16),  # a single listed row
        (4, 3, 16, 8, 40, 40, 33, 16),  # a list one entry past two 16-slot tiles
    ],
)
def test_odd_head_counts_and_lists_match_reference(num_queries, num_heads, latent_rank, rope_dim,
                                                   row_width, num_slots, listed, block_h, split,
                                                   dtype):  # fmt: skip
    case = random_case(num_queries, num_heads, latent_rank, rope_dim, row_width, num_slots, listed)
    assert_matches_reference(*case, dtype, {**SPLITS[split], "BLOCK_H": block_h})


def test_top_k_past_the_tokens_lists_them_all_then_nothing():
    """Top-k 64 over a cache of 12 tokens: each list names them all, then -1 to its end (whole
    splits of -1 only weigh nothing)."""
    q_latent, q_pe, kv_cache, _ = random_case(2, 7, 32, 16, 48, 12, 12, seed=3)
    slots = torch.full((2, 64), -1, dtype=torch.int32)
    slots[0, :12] = torch.randperm(12, generator=torch.Generator().manual_seed(4))
    slots[1, :12] = torch.arange(12)
    slots[1, 3] = -1  # a hole inside the listed part too
    for dtype in TOLERANCES:
        assert_matches_reference(q_latent, q_pe, kv_cache, slots, dtype, SPLITS["many_splits"])


def test_a_gluon_entry_runs_its_fallback_tiles_where_the_gluon_kernel_cannot(monkeypatch):
    """A config entry routing to the Gluon kernel (sm_90 only) runs the Triton kernel with the
    entry's "fallback" tiles elsewhere (here: the interpreter), and a tile override without a
    layout names Triton tiles (the sweeps'), not the Gluon entry's."""
    from rayinfer.kernels.dsa import sparse_mla

    seen = []
    gluon_entry = dict(layout="gluon_ws", BLOCK_H=64, BLOCK_N=64, num_warps=4, num_stages=2,
                       target_programs=132, min_tokens_per_split=64, max_splits=32,
                       whole_waves=True, programs_per_sm=1,
                       fallback=dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=1,
                                     target_programs=8, min_tokens_per_split=16,
                                     max_splits=64))  # fmt: skip
    monkeypatch.setattr(sparse_mla, "sparse_mla_params", lambda q: dict(gluon_entry))
    constants = sparse_mla.split_constants
    record = lambda params, *rest: seen.append(params) or constants(params, *rest)  # noqa: E731
    monkeypatch.setattr(sparse_mla, "split_constants", record)
    case = random_case(3, 5, 64, 16, 80, 90, 37)
    assert_matches_reference(*case, torch.float32)
    assert seen[-1]["BLOCK_N"] == 16 and "fallback" not in seen[-1]
    assert_matches_reference(*case, torch.float32, params=dict(BLOCK_N=32))
    assert seen[-1]["BLOCK_N"] == 32 and seen[-1]["max_splits"] == 64  # over the fallback
