"""MLA kernels (Triton, interpreter on CPU) against the torch references."""

import pytest
import torch

from rayinfer.kernels import mla_attention as mla

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3}


def shuffled_tables(seq_lens, block_size, generator):
    counts = [-(-n // block_size) for n in seq_lens]
    pool = torch.randperm(sum(counts) + 2, generator=generator).to(torch.int32)
    tables = torch.full((len(seq_lens), max(counts)), -1, dtype=torch.int32)
    start = 0
    for seq, count in enumerate(counts):
        tables[seq, :count] = pool[start : start + count]
        start += count
    return tables, len(pool)


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize(
    "seq_lens,num_heads,latent_rank,rope_dim,block_size",
    [
        ([1, 5, 37, 70], 5, 64, 16, 4),  # odd head count, splits over a short context
        ([3], 16, 32, 16, 16),  # a sequence shorter than a block
        ([50, 2], 20, 48, 8, 1),  # non-power-of-two latent, heads over two programs
    ],
)
def test_decode_matches_reference(seq_lens, num_heads, latent_rank, rope_dim, block_size, dtype):
    generator = torch.Generator().manual_seed(0)
    tables, num_blocks = shuffled_tables(seq_lens, block_size, generator)
    batch = len(seq_lens)
    kv_cache = torch.randn(num_blocks, block_size, latent_rank + rope_dim, generator=generator)
    q_latent = torch.randn(batch, num_heads, latent_rank, generator=generator)
    q_pe = torch.randn(batch, num_heads, rope_dim, generator=generator)
    scale = 0.1
    ours = mla.mla_decode_attention(
        q_latent.to(dtype), q_pe.to(dtype), kv_cache.to(dtype), tables, seq_lens, scale
    )
    reference = mla.mla_decode_attention_reference(
        q_latent, q_pe, kv_cache.to(dtype).float(), tables, seq_lens, scale
    )
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(ours.float(), reference, atol=tol, rtol=tol)


@pytest.mark.parametrize("query_len,seq_len", [(7, 7), (3, 20), (1, 9)])
def test_causal_attention_matches_reference(query_len, seq_len):
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(query_len, 3, 48, generator=generator)  # 32 nope + 16 rope
    key = torch.randn(seq_len, 3, 48, generator=generator)
    value = torch.randn(seq_len, 3, 24, generator=generator)
    ours = mla.mla_causal_attention(query, key, value, 0.2)
    reference = mla.mla_causal_attention_reference(query, key, value, 0.2)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_cache_is_exact_and_skips_padding(dtype):
    kv_c, k_pe = torch.randn(5, 24), torch.randn(5, 8)
    slots = torch.tensor([7, -1, 0, 11, 3])
    ours = torch.zeros(3, 4, 32, dtype=dtype)
    reference = torch.zeros(3, 4, 32, dtype=dtype)
    mla.mla_write_cache(ours, slots, kv_c, k_pe)
    mla.mla_write_cache_reference(reference, slots, kv_c, k_pe)
    assert torch.equal(ours, reference)
    assert torch.count_nonzero(ours.view(12, 32)[[1, 2, 4, 5, 6, 8, 9, 10]]) == 0
