"""Random inputs for the attention benchmarks and GPU checks: paged caches, varlen batches.

Every builder returns plain tensors on `device`; block tables scatter each sequence's blocks over
a shuffled pool so that the kernels never see contiguous blocks by accident.
"""

from __future__ import annotations

import torch


def shuffled_block_tables(seq_lens: list[int], block_size: int, device) -> torch.Tensor:
    """[B, max_blocks] int32, -1 padded: each sequence's blocks drawn from one shuffled pool."""
    counts = [-(-n // block_size) for n in seq_lens]
    pool = torch.randperm(sum(counts), device=device).to(torch.int32)
    table = torch.full((len(seq_lens), max(counts)), -1, dtype=torch.int32, device=device)
    start = 0
    for seq, count in enumerate(counts):
        table[seq, :count] = pool[start : start + count]
        start += count
    return table


def paged_gqa_case(seq_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                   device):  # fmt: skip
    """A mixed batch: query [T, Hq, D], kv_cache [blocks, bs, 2, Hkv, D], metadata tensors."""
    table = shuffled_block_tables(seq_lens, block_size, device)
    num_blocks = int(table.max()) + 1
    kv_shape = (num_blocks, block_size, 2, num_kv_heads, head_dim)
    kv_cache = torch.randn(kv_shape, device=device, dtype=dtype)  # in dtype: 16 GB, not 48
    query = torch.randn(sum(query_lens), num_heads, head_dim, device=device)
    starts = torch.tensor([0, *query_lens], device=device).cumsum(0).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return dict(
        query=query.to(dtype),
        kv_cache=kv_cache,
        block_tables=table,
        seq_lens=lens,
        query_start_loc=starts,
    )


def paged_mla_case(seq_lens, num_heads, latent_rank, rope_dim, block_size, dtype, device):
    """Absorbed decode: q_latent [B, N, L], q_pe [B, N, R], kv_cache [blocks, bs, L + R]."""
    table = shuffled_block_tables(seq_lens, block_size, device)
    num_blocks = int(table.max()) + 1
    kv_shape = (num_blocks, block_size, latent_rank + rope_dim)
    kv_cache = torch.randn(kv_shape, device=device, dtype=dtype)
    batch = len(seq_lens)
    return dict(
        q_latent=(torch.randn(batch, num_heads, latent_rank, device=device) * 0.1).to(dtype),
        q_pe=torch.randn(batch, num_heads, rope_dim, device=device).to(dtype),
        kv_cache=kv_cache,
        block_tables=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def gather_paged(kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int):
    """All sequences' first seq_len tokens: [B, seq_len, *per_token] (the baseline's gather)."""
    num_blocks = -(-seq_len // kv_cache.shape[1])
    blocks = kv_cache[block_tables[:, :num_blocks].long()]  # [B, n, bs, ...]
    return blocks.flatten(1, 2)[:, :seq_len]


def as_float(case: dict) -> dict:
    """The same case with every floating tensor in float32 (the reference's precision)."""
    return {k: v.float() if v.is_floating_point() else v for k, v in case.items()}
