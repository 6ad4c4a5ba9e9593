"""Sparse MLA attention in absorbed form: every query attends to its own list of cached tokens.

With q_nope absorbed through W_UK (q_latent [N, L]) the score of a cached token with latent c_kv
[L] and rope key k_pe [R] is (q_latent . c_kv + q_pe . k_pe) * scale, and the output is the
softmax-weighted sum of the c_kv rows ([N, L]), which the caller maps through W_UV. Each query
(a prefill row or a decode) reads only the rows its slot list names; -1 entries are skipped.
The same op serves prefill and decode: a query's cost is its list's length, not its context's.
"""

from __future__ import annotations

import torch


def sparse_mla_attention_reference(
    q_latent: torch.Tensor,  # [T, N, L]: q_nope absorbed through W_UK
    q_pe: torch.Tensor,  # [T, N, R]: roped query rope part
    kv_cache: torch.Tensor,  # [num_blocks, block_size, W]: c_kv at [0, L), k_pe at [L, L + R)
    slots: torch.Tensor,  # [T, K] int32: cache slots each query attends to, -1 padded
    scale: float,
) -> torch.Tensor:  # [T, N, L]: attention output in latent space (before W_UV)
    latent_rank, rope_dim = q_latent.shape[-1], q_pe.shape[-1]
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    rows = flat[slots.long().clamp(min=0)][..., : latent_rank + rope_dim]  # [T, K, L + R]
    rows = rows.to(q_latent.dtype)
    kv_c, k_pe = rows[..., :latent_rank], rows[..., latent_rank:]  # [T, K, L], [T, K, R]
    scores = q_latent @ kv_c.transpose(1, 2) + q_pe @ k_pe.transpose(1, 2)  # [T, N, K]
    scores = (scores.float() * scale).masked_fill((slots < 0)[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(kv_c.dtype)  # [T, N, K]
    return probs @ kv_c  # [T, N, L]
