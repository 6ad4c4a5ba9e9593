"""FP8 e4m3 indexer keys with one float32 scale per token (DeepSeek's production DSA format).

With `index_cache_dtype="fp8_e4m3"` a DSA cache row keeps its dtype (bf16, fp16 or fp32) and
its latent columns, but the index key region holds bytes, read through a byte view of the row:

    row bytes: [c_kv, k_pe (key_offset elements) | D fp8 e4m3 bytes | float32 scale]

so GLM-5's bf16 row is 576 + 72 = 648 columns (padded to 16-byte rows) instead of 704 (ModelConfig.
index_key_columns). Each key is quantized on its own: scale = amax(|k|) / 448 (1 for an all-zero
key), k_fp8 = clamp(k / scale, -448, 448) rounded to nearest even; the indexer reads
k_fp8 * scale. These are the torch references; the Triton kernels are dsa_cache's write and
dsa_indexer's score kernel (KEY_FP8).
"""

from __future__ import annotations

import torch

from rayinfer.kernels.fp8.fp8_support import require_fp8_device

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BYTES = 4


def check_fp8_index_device(device: torch.device) -> None:
    """FP8 index keys run where the Triton kernels can (CPU: the torch references)."""
    require_fp8_device(device, "index_cache_dtype='fp8_e4m3'", "use 'auto'")


def quantize_index_keys(
    keys: torch.Tensor,  # [T, D] any float dtype
) -> tuple[torch.Tensor, torch.Tensor]:  # ([T, D] float8_e4m3fn, [T] float32 scales)
    keys = keys.float()
    amax = keys.abs().amax(dim=-1)  # [T]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    fp8 = (keys / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return fp8, scale


def key_bytes(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, W] any dtype, rows dense
    key_offset: int,  # the key region's first column (elements of kv_cache)
    head_dim: int,
) -> torch.Tensor:  # [num_slots, D + 4] uint8: a view of every slot's key bytes and scale
    start = key_offset * kv_cache.element_size()
    flat = kv_cache.view(-1, kv_cache.shape[-1]).view(torch.uint8)  # [num_slots, W x bytes]
    return flat[:, start : start + head_dim + SCALE_BYTES]


def check_key_region(kv_cache: torch.Tensor, key_offset: int, head_dim: int) -> None:
    """A row holds D bytes + the scale from the key offset, the scale at a 4-byte offset."""
    element = kv_cache.element_size()
    row_bytes, start = kv_cache.shape[-1] * element, key_offset * element
    if row_bytes < start + head_dim + SCALE_BYTES or (start + head_dim) % 4 or row_bytes % 4:
        raise ValueError(
            f"kv_cache rows of {row_bytes} bytes must hold FP8 keys at byte {start}: "
            f"{head_dim} + {SCALE_BYTES} bytes, the float32 scale and the rows 4-byte aligned"
        )


def write_index_keys_reference(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, W]: updated in place
    slots: torch.Tensor,  # [T'] int64 real slots (no padding)
    key_offset: int,
    keys: torch.Tensor,  # [T', D]
) -> None:
    check_key_region(kv_cache, key_offset, keys.shape[-1])
    fp8, scale = quantize_index_keys(keys)
    region = key_bytes(kv_cache, key_offset, keys.shape[-1])  # [num_slots, D + 4] uint8
    packed = torch.cat([fp8.view(torch.uint8), scale[:, None].view(torch.uint8)], dim=-1)
    region[slots] = packed


def gather_index_keys(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, W]
    key_offset: int,
    head_dim: int,
    slots: torch.Tensor,  # [...] int64 slots (>= 0)
) -> torch.Tensor:  # [..., D] float32: the dequantized keys k_fp8 * scale
    region = key_bytes(kv_cache, key_offset, head_dim)[slots]  # [..., D + 4] uint8
    fp8 = region[..., :head_dim].contiguous().view(torch.float8_e4m3fn).float()
    scale = region[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return fp8 * scale
