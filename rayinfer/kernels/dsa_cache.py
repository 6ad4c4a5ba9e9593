"""Writing new tokens into a DSA layer's cache `[num_blocks, block_size, L + R + D]`: per token its
normed latent c_kv (L), its roped shared key k_pe (R) and, in layers that run the indexer, its
roped indexer key (D), at its slot. One program per token skips negative slots (padding rows of a
CUDA graph's bucket), so the write has no data-dependent shape and a graph captures it. The
torch reference is `dsa_indexer.dsa_write_cache_reference`.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.triton_compat import tl, triton


@triton.jit
def _dsa_write_cache_kernel(
    kv_c_ptr, k_pe_ptr, index_key_ptr, cache_ptr, slot_mapping_ptr,
    stride_kv_c, stride_k_pe, stride_index_key, stride_slot,
    LATENT_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, INDEX_DIM: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)  # token * stride: past 2**31 for long prompts
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    row = cache_ptr + slot * stride_slot
    offs_l = tl.arange(0, BLOCK_L)
    kv_c = tl.load(kv_c_ptr + token * stride_kv_c + offs_l, mask=offs_l < LATENT_RANK)
    tl.store(row + offs_l, kv_c.to(cache_ptr.dtype.element_ty), mask=offs_l < LATENT_RANK)
    offs_r = tl.arange(0, BLOCK_R)
    k_pe = tl.load(k_pe_ptr + token * stride_k_pe + offs_r, mask=offs_r < ROPE_DIM)
    tl.store(row + LATENT_RANK + offs_r, k_pe.to(cache_ptr.dtype.element_ty),
             mask=offs_r < ROPE_DIM)  # fmt: skip
    if INDEX_DIM > 0:
        offs_d = tl.arange(0, BLOCK_D)
        key = tl.load(index_key_ptr + token * stride_index_key + offs_d, mask=offs_d < INDEX_DIM)
        tl.store(row + LATENT_RANK + ROPE_DIM + offs_d, key.to(cache_ptr.dtype.element_ty),
                 mask=offs_d < INDEX_DIM)  # fmt: skip


def dsa_write_cache(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, W >= L + R (+ D)]: updated in place
    slot_mapping: torch.Tensor,  # [T] int64; < 0 skips the token
    kv_c: torch.Tensor,  # [T, L]
    k_pe: torch.Tensor,  # [T, R]
    index_key: torch.Tensor | None,  # [T, D], or None: a layer without indexer (cols untouched)
) -> None:
    latent_rank, rope_dim = kv_c.shape[-1], k_pe.shape[-1]
    index_dim = 0 if index_key is None else index_key.shape[-1]
    if kv_cache.shape[-1] < latent_rank + rope_dim + index_dim or not kv_cache.is_contiguous():
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} must be contiguous with rows of at least "
            f"{latent_rank} + {rope_dim} + {index_dim}"
        )
    rows = [kv_c, k_pe] if index_key is None else [kv_c, k_pe, index_key]
    if any(x.stride(-1) != 1 or x.shape[0] != slot_mapping.shape[0] for x in rows):
        raise ValueError("kv_c, k_pe and index_key must be contiguous in the last dim, one slot "
                         "per token")  # fmt: skip
    if kv_c.shape[0] == 0:
        return
    key = kv_c if index_key is None else index_key  # any pointer: INDEX_DIM=0 reads none
    _dsa_write_cache_kernel[(kv_c.shape[0],)](
        kv_c, k_pe, key, kv_cache, slot_mapping,
        kv_c.stride(0), k_pe.stride(0), key.stride(0), kv_cache.shape[-1],
        LATENT_RANK=latent_rank, ROPE_DIM=rope_dim, INDEX_DIM=index_dim,
        BLOCK_L=triton.next_power_of_2(latent_rank), BLOCK_R=triton.next_power_of_2(rope_dim),
        BLOCK_D=triton.next_power_of_2(max(index_dim, 1)),
    )  # fmt: skip
