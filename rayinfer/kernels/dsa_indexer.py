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
"""

from __future__ import annotations

import torch


def dsa_write_cache_reference(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R + D]
    slot_mapping: torch.Tensor,  # [T] int64
    kv_c: torch.Tensor,  # [T, L] normed latent
    k_pe: torch.Tensor,  # [T, R] roped shared key
    index_key: torch.Tensor | None,  # [T, D] roped indexer key; None: a layer without indexer
) -> None:
    """One indexed write of the rows (L + R + D columns, or the first L + R without an index
    key); one launch on CUDA too, which a CUDA graph captures."""
    parts = [kv_c, k_pe] if index_key is None else [kv_c, k_pe, index_key]
    rows = torch.cat(parts, dim=-1).to(kv_cache.dtype)  # [T, L + R (+ D)]
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    if index_key is None:
        flat[slot_mapping, : rows.shape[1]] = rows
    else:
        flat.index_copy_(0, slot_mapping, rows)


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
) -> torch.Tensor:  # [T, topk] int32: cache slots of the selected tokens, -1 padded
    """Scores in float32 over every query's context, highest `topk` kept, in no set order."""
    num_queries, head_dim = q_index.shape[0], q_index.shape[-1]
    block_size = kv_cache.shape[1]
    slots = context_slots(block_tables, query_seq, block_size, max_context)  # [T, S]
    flat = kv_cache.view(-1, kv_cache.shape[-1])[:, key_offset : key_offset + head_dim]
    keys = flat[slots.clamp(min=0)].float()  # [T, S, D]
    scores = torch.einsum("thd,tsd->ths", q_index.float(), keys).relu()  # [T, Hi, S]
    scores = torch.einsum("th,ths->ts", weights.float(), scores)  # [T, S]
    visible = torch.arange(max_context, device=q_index.device) <= positions[:, None]  # [T, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    k = min(topk, max_context)
    chosen = scores.topk(k, dim=-1).indices  # [T, k]
    chosen_slots = slots.gather(1, chosen)
    chosen_slots = chosen_slots.masked_fill(~visible.gather(1, chosen), -1)
    out = torch.full((num_queries, topk), -1, dtype=torch.int32, device=q_index.device)
    out[:, :k] = chosen_slots.to(torch.int32)
    return out
