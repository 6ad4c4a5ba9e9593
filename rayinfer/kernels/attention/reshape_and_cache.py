"""Write the new tokens' K and V into the paged cache at their slots."""

from __future__ import annotations

import torch

from rayinfer.kernels.triton_compat import tl, triton


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


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, cache_ptr, slot_mapping_ptr,
    stride_kt, stride_vt, stride_slot,
    ROW: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One token: its K row [Hkv*D] to cache[slot, 0] and V row to cache[slot, 1]."""
    token = tl.program_id(0).to(tl.int64)  # token * stride: past 2**31 for wide strided rows
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    key = tl.load(key_ptr + token * stride_kt + offs, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + offs, mask=mask)
    row = cache_ptr + slot * stride_slot
    tl.store(row + offs, key.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(row + ROW + offs, value.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, Hkv, D]: updated in place
    slot_mapping: torch.Tensor,  # [T] int64; < 0 skips the token
) -> None:
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    if key.shape[1:] != (num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} must be "
                         f"[T, {num_kv_heads}, {head_dim}] like kv_cache")  # fmt: skip
    if not kv_cache.is_contiguous() or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError("kv_cache must be contiguous and slot_mapping hold one slot per token")
    for name, t in (("key", key), ("value", value)):
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name} rows must be dense [Hkv, D]; call .contiguous()")
    if key.shape[0] == 0:
        return
    row = num_kv_heads * head_dim
    _reshape_and_cache_kernel[(key.shape[0],)](
        key, value, kv_cache, slot_mapping, key.stride(0), value.stride(0), 2 * row,
        ROW=row, BLOCK=triton.next_power_of_2(row),
    )  # fmt: skip
