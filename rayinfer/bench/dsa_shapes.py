"""GLM-5's DeepSeek Sparse Attention shapes per rank, and random inputs of them, for the DSA
kernel benchmarks (kernels_dsa.py) and their tile sweep (dsa_sweep.py)."""

from __future__ import annotations

import torch

HEADS, LATENT_RANK, ROPE_DIM, TOPK = 64, 512, 64, 2048
INDEX_HEADS, INDEX_DIM, BLOCK_SIZE = 32, 128, 64
ROW_WIDTH = LATENT_RANK + ROPE_DIM + INDEX_DIM
ELEMENT_BYTES = 2  # bf16
SCALE = (LATENT_RANK // 4 + ROPE_DIM) ** -0.5  # GLM-5's qk head dim 192 + 64


def random_bf16(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", generator=generator, dtype=torch.bfloat16)


def own_contexts(batch: int, context: int, width: int, generator: torch.Generator):
    """(kv_cache [batch x context / 64, 64, width] bf16, block_tables [batch, context / 64]
    int32): each decode its own context, in shuffled blocks."""
    blocks_per_seq = context // BLOCK_SIZE
    kv_cache = random_bf16(batch * blocks_per_seq, BLOCK_SIZE, width, generator=generator)
    order = torch.randperm(batch * blocks_per_seq, device="cuda", generator=generator)
    return kv_cache, order.view(batch, blocks_per_seq).to(torch.int32)
