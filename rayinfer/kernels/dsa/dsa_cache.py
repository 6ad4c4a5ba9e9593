"""Writing new tokens into a DSA layer's cache `[num_blocks, block_size, L + R + D]`: per token its
normed latent c_kv (L), its roped shared key k_pe (R) and, in layers that run the indexer, its
roped indexer key (D; or its FP8 bytes and scale, kernels/dsa/dsa_index_fp8.py), at its slot. One
program per token skips negative slots (padding rows of a CUDA graph's bucket), so the write has
no data-dependent shape and a graph captures it. The torch reference is
`dsa_indexer.dsa_write_cache_reference`.
"""

from __future__ import annotations

import torch

from rayinfer.kernels.dsa.dsa_index_fp8 import FP8_MAX as _FP8_MAX
from rayinfer.kernels.dsa.dsa_index_fp8 import SCALE_BYTES, check_key_region
from rayinfer.kernels.triton_compat import tl, triton

FP8_MAX = tl.constexpr(_FP8_MAX)


@triton.jit
def _round_to_e4m3(x):
    """x (float32, |x| <= 448) rounded to nearest even on the e4m3 grid, still float32, so that
    its cast to fp8 is exact wherever it runs (Triton's interpreter rounds fp32 -> fp8 half up
    and can drop the carry into the exponent)."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 |x|)
    exponent = tl.maximum(exponent, -6)  # subnormals share 2^-6's step
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3): 3 mantissa bits
    inverse = ((3 - exponent + 127) << 23).to(tl.float32, bitcast=True)  # exact: powers of two
    rounder = 12582912.0  # 1.5 x 2^23: adding it rounds |y| < 2^22 to an integer, ties to even
    return ((x * inverse + rounder) - rounder) * step


@triton.jit
def _dsa_write_cache_kernel(
    kv_c_ptr, k_pe_ptr, index_key_ptr, cache_ptr, cache_bytes_ptr, slot_mapping_ptr,
    stride_kv_c, stride_k_pe, stride_index_key, stride_slot,
    LATENT_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, INDEX_DIM: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    KEY_FP8: tl.constexpr, ELEMENT_BYTES: tl.constexpr,
):  # fmt: skip
    """One token's row. KEY_FP8: its index key quantized into the row's bytes
    (cache_bytes_ptr, the cache's fp8 view) as D fp8 e4m3 and a float32 scale (dsa_index_fp8)."""
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
        key_mask = offs_d < INDEX_DIM
        key = tl.load(index_key_ptr + token * stride_index_key + offs_d, mask=key_mask)
        if KEY_FP8:
            key = key.to(tl.float32)
            amax = tl.max(tl.where(key_mask, tl.abs(key), 0.0), 0)
            # IEEE divisions (div_rn), as torch's: the bytes equal the reference's
            scale = tl.where(amax > 0, tl.math.div_rn(amax, FP8_MAX), 1.0)
            quantized = tl.clamp(tl.math.div_rn(key, scale), -FP8_MAX, FP8_MAX)
            key_start = (slot * stride_slot + LATENT_RANK + ROPE_DIM) * ELEMENT_BYTES
            key_row = cache_bytes_ptr + key_start  # the row's key bytes
            quantized = _round_to_e4m3(quantized).to(tl.float8e4nv)
            tl.store(key_row + offs_d, quantized, mask=key_mask)
            scale_ptr = (key_row + INDEX_DIM).to(tl.pointer_type(tl.float32), bitcast=True)
            tl.store(scale_ptr, scale)
        else:
            tl.store(row + LATENT_RANK + ROPE_DIM + offs_d, key.to(cache_ptr.dtype.element_ty),
                     mask=key_mask)  # fmt: skip


def dsa_write_cache(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, W >= L + R (+ key columns)]: in place
    slot_mapping: torch.Tensor,  # [T] int64; < 0 skips the token
    kv_c: torch.Tensor,  # [T, L]
    k_pe: torch.Tensor,  # [T, R]
    index_key: torch.Tensor | None,  # [T, D], or None: a layer without indexer (cols untouched)
    index_fp8: bool = False,  # the key as D fp8 bytes + float32 scale (kernels/dsa/dsa_index_fp8)
) -> None:
    latent_rank, rope_dim = kv_c.shape[-1], k_pe.shape[-1]
    index_dim = 0 if index_key is None else index_key.shape[-1]
    key_columns = index_dim
    if index_fp8 and index_dim:  # D bytes + the scale, in whole cache elements
        key_columns = -(-(index_dim + SCALE_BYTES) // kv_cache.element_size())
    if kv_cache.shape[-1] < latent_rank + rope_dim + key_columns or not kv_cache.is_contiguous():
        raise ValueError(
            f"kv_cache {tuple(kv_cache.shape)} must be contiguous with rows of at least "
            f"{latent_rank} + {rope_dim} + {key_columns}"
        )
    if index_fp8 and index_dim:
        check_key_region(kv_cache, latent_rank + rope_dim, index_dim)
    rows = [kv_c, k_pe] if index_key is None else [kv_c, k_pe, index_key]
    if any(x.shape[0] != slot_mapping.shape[0] for x in rows):
        raise ValueError("kv_c, k_pe and index_key must have one slot per token")
    if kv_c.shape[0] == 0:
        return
    if any(x.stride(-1) != 1 for x in rows):
        raise ValueError("kv_c, k_pe and index_key must be contiguous in the last dim")
    slot_mapping = slot_mapping.contiguous()  # read one element a token, without its stride
    key = kv_c if index_key is None else index_key  # any pointer: INDEX_DIM=0 reads none
    _dsa_write_cache_kernel[(kv_c.shape[0],)](
        kv_c, k_pe, key, kv_cache, kv_cache.view(torch.float8_e4m3fn), slot_mapping,
        kv_c.stride(0), k_pe.stride(0), key.stride(0), kv_cache.shape[-1],
        LATENT_RANK=latent_rank, ROPE_DIM=rope_dim, INDEX_DIM=index_dim,
        BLOCK_L=triton.next_power_of_2(latent_rank), BLOCK_R=triton.next_power_of_2(rope_dim),
        BLOCK_D=triton.next_power_of_2(max(index_dim, 1)),
        KEY_FP8=index_fp8, ELEMENT_BYTES=kv_cache.element_size(),
    )  # fmt: skip
