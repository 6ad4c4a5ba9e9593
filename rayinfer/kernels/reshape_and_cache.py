"""Write the new tokens' K and V into the paged cache at their slots."""

from __future__ import annotations

import torch


def reshape_and_cache_reference(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, Hkv, D]: updated in place
    slot_mapping: torch.Tensor,  # [T] int64: block_id * block_size + offset; < 0 skips the token
) -> None:
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    flat_cache = kv_cache.view(-1, 2, num_kv_heads, head_dim)  # [num_slots, 2, Hkv, D]
    is_real = slot_mapping >= 0  # [T]
    slots = slot_mapping[is_real]
    flat_cache[slots, 0] = key[is_real].to(kv_cache.dtype)
    flat_cache[slots, 1] = value[is_real].to(kv_cache.dtype)
