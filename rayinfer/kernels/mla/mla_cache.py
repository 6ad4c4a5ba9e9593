"""Writing new tokens into the MLA latent cache `[num_blocks, block_size, L + R]`: per token its
normed latent c_kv (L) then its roped shared key k_pe (R), at its slot. Triton kernel, launcher
`mla_write_cache`, and torch reference `mla_write_cache_reference`.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.triton_compat import tl, triton


def mla_write_cache_reference(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]: updated in place
    slot_mapping: torch.Tensor,  # [T] int64: block_id * block_size + offset; < 0 skips the token
    kv_c: torch.Tensor,  # [T, L]: normed latent
    k_pe: torch.Tensor,  # [T, R]: roped shared key
) -> None:
    flat_cache = kv_cache.view(-1, kv_cache.shape[-1])  # [num_slots, L + R]
    is_real = slot_mapping >= 0  # [T]
    latent_rank = kv_c.shape[-1]
    slots = slot_mapping[is_real]
    flat_cache[slots, :latent_rank] = kv_c[is_real].to(kv_cache.dtype)
    flat_cache[slots, latent_rank:] = k_pe[is_real].to(kv_cache.dtype)


@triton.jit
def _mla_write_cache_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_mapping_ptr,
    stride_kv_c, stride_k_pe, stride_slot,
    LATENT_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)  # token * stride: past 2**31 for wide strided rows
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    kv_c = tl.load(kv_c_ptr + token * stride_kv_c + offs_l, mask=offs_l < LATENT_RANK)
    k_pe = tl.load(k_pe_ptr + token * stride_k_pe + offs_r, mask=offs_r < ROPE_DIM)
    row = cache_ptr + slot * stride_slot
    tl.store(row + offs_l, kv_c.to(cache_ptr.dtype.element_ty), mask=offs_l < LATENT_RANK)
    tl.store(row + LATENT_RANK + offs_r, k_pe.to(cache_ptr.dtype.element_ty),
             mask=offs_r < ROPE_DIM)  # fmt: skip


def mla_write_cache(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]: updated in place
    slot_mapping: torch.Tensor,  # [T] int64; < 0 skips the token
    kv_c: torch.Tensor,  # [T, L]
    k_pe: torch.Tensor,  # [T, R]
) -> None:
    latent_rank, rope_dim = kv_c.shape[-1], k_pe.shape[-1]
    if kv_cache.shape[-1] != latent_rank + rope_dim or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be contiguous [blocks, bs, "
                         f"{latent_rank + rope_dim}]")  # fmt: skip
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1 or slot_mapping.shape[0] != kv_c.shape[0]:
        raise ValueError("kv_c/k_pe must be contiguous in the last dim, one slot per token")
    if kv_c.shape[0] == 0:
        return
    _mla_write_cache_kernel[(kv_c.shape[0],)](
        kv_c, k_pe, kv_cache, slot_mapping, kv_c.stride(0), k_pe.stride(0), kv_cache.shape[-1],
        LATENT_RANK=latent_rank, ROPE_DIM=rope_dim,
        BLOCK_L=triton.next_power_of_2(latent_rank), BLOCK_R=triton.next_power_of_2(rope_dim),
    )  # fmt: skip
