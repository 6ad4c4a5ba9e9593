"""Paged GQA attention and reshape-and-cache against plain causal SDPA over whole sequences."""

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from rayinfer.kernels import ops
from rayinfer.kernels.attention.paged_attention import (
    causal_attention,
    choose_split,
    gather_context,
    paged_decode_attention,
)
from rayinfer.kernels.attention.prefill_attention import paged_mixed_attention
from rayinfer.kernels.attention.reshape_and_cache import reshape_and_cache
from rayinfer.layers.forward_context import build_attention_metadata

# (context length, new tokens): full prefill, chunk over a cached prefix, decodes, one token.
MIXED_BATCH = [(9, 9), (13, 5), (7, 1), (1, 1), (20, 1)]
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclass
class Sequence:
    query: torch.Tensor  # [s, Hq, D]: queries of every position (only the new ones are used)
    key: torch.Tensor  # [s, Hkv, D]
    value: torch.Tensor  # [s, Hkv, D]
    num_new: int

    @property
    def num_cached(self) -> int:
        return self.key.shape[0] - self.num_new


def make_sequences(batch, num_heads, num_kv_heads, head_dim, dtype, generator):
    def randn(n, heads):
        return torch.randn(n, heads, head_dim, generator=generator).to(dtype)

    return [
        Sequence(randn(s, num_heads), randn(s, num_kv_heads), randn(s, num_kv_heads), q)
        for s, q in batch
    ]


def shuffled_block_tables(seq_lens, block_size, generator):
    """Every sequence's blocks scattered over a shared pool with spare blocks."""
    counts = [-(-n // block_size) for n in seq_lens]
    pool = torch.randperm(sum(counts) + 3, generator=generator).tolist()
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [pool[s : s + c] for s, c in zip(starts, counts, strict=True)], len(pool)


def plain_causal_attention(seq: Sequence, scale: float) -> torch.Tensor:
    """Causal SDPA over the whole sequence in float32; rows of the new tokens [num_new, Hq, D]."""
    repeat = seq.query.shape[1] // seq.key.shape[1]
    out = F.scaled_dot_product_attention(
        seq.query.transpose(0, 1).float(),
        seq.key.repeat_interleave(repeat, dim=1).transpose(0, 1).float(),
        seq.value.repeat_interleave(repeat, dim=1).transpose(0, 1).float(),
        is_causal=True,
        scale=scale,
    )
    return out.transpose(0, 1)[seq.num_cached :]


def cache_tokens(seqs, tables, kv_cache, block_size, new: bool):
    """Write each sequence's cached prefix (new=False) or new tokens (new=True) into the cache."""
    seq_lens = [s.key.shape[0] if new else s.num_cached for s in seqs]
    query_lens = [s.num_new if new else s.num_cached for s in seqs]
    attn = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    rows = [slice(s.num_cached, None) if new else slice(0, s.num_cached) for s in seqs]
    keys = torch.cat([s.key[r] for s, r in zip(seqs, rows, strict=True)])
    values = torch.cat([s.value[r] for s, r in zip(seqs, rows, strict=True)])
    ops.reshape_and_cache(keys, values, kv_cache, attn.slot_mapping)
    return attn


def run_mixed_batch(batch, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """Cache the prefixes, then write and attend the new tokens: (ours, reference) [T, Hq, D]."""
    generator = torch.Generator().manual_seed(0)
    seqs = make_sequences(batch, num_heads, num_kv_heads, head_dim, dtype, generator)
    tables, num_blocks = shuffled_block_tables([s for s, _ in batch], block_size, generator)
    kv_cache = torch.zeros(num_blocks, block_size, 2, num_kv_heads, head_dim, dtype=dtype)
    cache_tokens(seqs, tables, kv_cache, block_size, new=False)
    attn = cache_tokens(seqs, tables, kv_cache, block_size, new=True)
    query = torch.cat([s.query[s.num_cached :] for s in seqs])  # [T, Hq, D]
    scale = head_dim**-0.5
    ours = ops.paged_attention(
        query, kv_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc, scale
    )
    reference = torch.cat([plain_causal_attention(s, scale) for s in seqs])
    return ours, reference


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_mixed_batch_matches_causal_sdpa(dtype, num_heads, num_kv_heads, block_size):
    ours, reference = run_mixed_batch(MIXED_BATCH, num_heads, num_kv_heads, 40, block_size, dtype)
    assert ours.dtype == dtype
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(ours.float(), reference, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "batch",
    [[(1, 1)], [(17, 17)], [(17, 1)], [(30, 7)], [(5, 1)] * 4],
    ids=["single-token", "prefill-only", "decode-only", "chunk-over-prefix", "decodes"],
)
def test_edge_batches_match_causal_sdpa(batch):
    ours, reference = run_mixed_batch(batch, 4, 2, 16, 4, torch.float32)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


def test_reshape_and_cache_writes_exactly_its_slots():
    kv_cache = torch.zeros(4, 2, 2, 3, 5)  # [blocks, block_size, 2, Hkv, D]
    key, value = torch.randn(3, 3, 5), torch.randn(3, 3, 5)
    slot_mapping = torch.tensor([5, -1, 2])  # the middle token is padding
    ops.reshape_and_cache(key, value, kv_cache, slot_mapping)
    flat = kv_cache.view(8, 2, 3, 5)
    assert torch.equal(flat[5, 0], key[0]) and torch.equal(flat[5, 1], value[0])
    assert torch.equal(flat[2, 0], key[2]) and torch.equal(flat[2, 1], value[2])
    untouched = [slot for slot in range(8) if slot not in (2, 5)]
    assert torch.count_nonzero(flat[untouched]) == 0


# ---- Triton kernels (interpreter on CPU): same batches, the launchers called directly ----

TRITON_TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3}


def triton_paged_attention(query, kv_cache, attn, scale, new_kv=None):
    """What ops.paged_attention runs on CUDA: decodes through the split-K decode kernel, prefill
    chunks through the varlen kernel (a mixed batch uses both)."""
    return paged_mixed_attention(
        query, kv_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc,
        attn.query_lens_cpu, scale, attn.seq_lens_cpu, new_kv,
    )  # fmt: skip


def run_triton_batch(batch, num_heads, num_kv_heads, head_dim, block_size, dtype,
                     pass_new_kv=False):  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    seqs = make_sequences(batch, num_heads, num_kv_heads, head_dim, dtype, generator)
    tables, num_blocks = shuffled_block_tables([s for s, _ in batch], block_size, generator)
    kv_cache = torch.zeros(num_blocks, block_size, 2, num_kv_heads, head_dim, dtype=dtype)
    cache_tokens(seqs, tables, kv_cache, block_size, new=False)
    new_keys = torch.cat([s.key[s.num_cached :] for s in seqs])
    new_values = torch.cat([s.value[s.num_cached :] for s in seqs])
    attn = build_attention_metadata(
        [s.num_new for s in seqs], [s.key.shape[0] for s in seqs], tables, block_size
    )
    reshape_and_cache(new_keys, new_values, kv_cache, attn.slot_mapping)
    query = torch.cat([s.query[s.num_cached :] for s in seqs])  # [T, Hq, D]
    new_kv = (new_keys, new_values) if pass_new_kv else None
    ours = triton_paged_attention(query, kv_cache, attn, head_dim**-0.5, new_kv)
    reference = torch.cat([plain_causal_attention(s, head_dim**-0.5) for s in seqs])
    return ours, reference


@pytest.mark.parametrize("dtype", list(TRITON_TOLERANCES))
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(4, 4, 16), (8, 2, 3), (6, 1, 1)])
@pytest.mark.parametrize(
    "batch",
    [
        MIXED_BATCH,
        [(7, 1), (9, 9), (1, 1), (13, 5), (40, 1)],
        [(1, 1), (40, 1), (7, 1), (100, 1), (16, 1)],
        [(9, 9), (30, 4)],
    ],
    ids=["mixed-both-kernels", "interleaved-both-kernels", "decodes-split-k", "chunks-varlen"],
)
def test_triton_matches_causal_sdpa(batch, dtype, num_heads, num_kv_heads, block_size):
    ours, reference = run_triton_batch(batch, num_heads, num_kv_heads, 40, block_size, dtype)
    assert ours.dtype == dtype
    tol = TRITON_TOLERANCES[dtype]
    torch.testing.assert_close(ours.float(), reference, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "batch",
    [[(1, 1)], [(17, 17)], [(17, 1)], [(30, 7)], [(3, 1)] * 3],
    ids=["single-token", "prefill-only", "decode-only", "chunk-over-prefix", "short-decodes"],
)
def test_triton_edge_batches(batch):
    ours, reference = run_triton_batch(batch, 4, 2, 16, 4, torch.float32)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "batch,direct_calls,paged_calls",
    [
        ([(9, 9), (30, 30)], 1, 0),
        ([(7, 1), (9, 9), (1, 1), (13, 13), (40, 1)], 1, 0),
        ([(9, 9), (30, 4)], 1, 1),
        ([(7, 1), (13, 5), (20, 20)], 1, 1),
        ([(13, 5), (30, 4)], 0, 1),
    ],
    ids=["prefill-only", "prefills-among-decodes", "beside-a-chunk-over-a-prefix",
         "mixed-prefix-and-decodes", "prefixed-chunks-only"],
)  # fmt: skip
def test_prefix_free_chunks_attend_to_the_steps_own_kv(monkeypatch, batch, direct_calls,
                                                       paged_calls):  # fmt: skip
    """Given the step's K/V, the chunks that start their sequences take the contiguous kernel
    over them (never the block tables), the chunks over a cached prefix the paged kernel, in one
    call each; the batch's results match SDPA."""
    from rayinfer.kernels.attention import prefill_attention as prefill_module

    calls = []
    for name in ("prefill_attention", "paged_prefill_attention"):
        kernel = getattr(prefill_module, name)
        spy = lambda *a, _name=name, _kernel=kernel, **k: calls.append(_name) or _kernel(*a, **k)  # noqa: E731
        monkeypatch.setattr(prefill_module, name, spy)
    ours, reference = run_triton_batch(batch, 4, 2, 16, 4, torch.float32, pass_new_kv=True)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    assert calls.count("prefill_attention") == direct_calls
    assert calls.count("paged_prefill_attention") == paged_calls


def test_triton_decode_with_a_graph_wide_table_and_a_padding_row():
    """As in a decode graph: a block table far wider than the contexts (most splits hold no
    tokens and are skipped) and a padding row without context, which comes out as zeros."""
    generator = torch.Generator().manual_seed(5)
    seq_lens, width, block_size, heads, kv_heads, dim = [3, 50, 0], 40, 4, 8, 2, 16
    tables = torch.randperm(3 * width, generator=generator).to(torch.int32).view(3, width)
    kv_cache = torch.randn(3 * width, block_size, 2, kv_heads, dim, generator=generator)
    query = torch.randn(3, heads, dim, generator=generator)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    ours = paged_decode_attention(query, kv_cache, tables, lens, dim**-0.5)
    for seq in range(2):
        key, value = gather_context(kv_cache, tables[seq], seq_lens[seq])  # [S, Hkv, D]
        expected = causal_attention(query[seq : seq + 1], key, value, dim**-0.5)
        torch.testing.assert_close(ours[seq : seq + 1], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours[2], torch.zeros_like(ours[2]))


def test_triton_decode_rejects_a_cache_of_another_shape():
    query = torch.randn(2, 4, 16)
    kv_cache = torch.zeros(3, 4, 2, 2, 32)
    with pytest.raises(ValueError, match="head dim 32"):
        paged_decode_attention(query, kv_cache, torch.zeros(2, 1, dtype=torch.int32),
                               torch.ones(2, dtype=torch.int32), 1.0)  # fmt: skip


H200_DECODE = dict(BLOCK_N=32, target_programs=528, min_tokens_per_split=512, max_splits=256)


@pytest.mark.parametrize(
    "num_seqs,num_groups,max_context,num_splits",
    [(1, 8, 1 << 20, 66), (1, 8, 4096, 8), (128, 8, 4096, 1), (1, 8, 100, 1)],
    ids=["1M-context-fills-the-gpu", "short-context-capped", "big-batch-one-split", "tiny"],
)
def test_choose_split_covers_the_context(num_seqs, num_groups, max_context, num_splits):
    split = choose_split(num_seqs, num_groups, max_context, H200_DECODE)
    assert split.num_splits == num_splits
    assert split.tokens_per_split % H200_DECODE["BLOCK_N"] == 0
    assert split.num_splits * split.tokens_per_split >= max_context
    assert (split.num_splits - 1) * split.tokens_per_split < max_context  # no empty split


def test_whole_waves_keep_the_programs_within_one_wave():
    """32 sequences of 8k on 132 one-program-per-SM slots: 4 splits (128 programs), where
    rounding up would make 5 (160: a second wave of 28); a batch past the slots gets one."""
    tiles = dict(target_programs=132, min_tokens_per_split=64, max_splits=256, BLOCK_N=64)
    assert choose_split(32, 1, 8192, tiles).num_splits == 5
    waves = dict(tiles, whole_waves=True)
    assert choose_split(32, 1, 8192, waves) == (4, 2048)
    assert choose_split(8, 1, 32768, waves) == (16, 2048)
    assert choose_split(200, 1, 4096, waves).num_splits == 1
    assert choose_split(1, 1, 4096, waves) == (64, 64)  # min_tokens_per_split still bounds
