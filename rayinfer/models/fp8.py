"""DeepSeek-V3 FP8 block-scaled weights: float8_e4m3fn values with one float32 scale per block.

A checkpoint stores `<name>.weight` [out, in] in float8_e4m3fn and `<name>.weight_scale_inv`
[ceil(out / 128), ceil(in / 128)] float32; the real weight is `weight * scale` block by block.
"""

from __future__ import annotations

import torch

FP8_BLOCK_SIZE = 128
SCALE_SUFFIX = "_scale_inv"


def dequantize_block_fp8(
    weight: torch.Tensor,  # [out, in] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(out / block), ceil(in / block)] float32
    dtype: torch.dtype,
    block_size: int = FP8_BLOCK_SIZE,
) -> torch.Tensor:  # [out, in] dtype
    rows, cols = weight.shape
    expected = (-(-rows // block_size), -(-cols // block_size))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight "
            f"{tuple(weight.shape)} in {block_size}x{block_size} blocks; expected {expected}"
        )
    scale = scale_inv.float().repeat_interleave(block_size, 0)[:rows]  # [out, ceil(in / block)]
    scale = scale.repeat_interleave(block_size, 1)[:, :cols]  # [out, in]
    return (weight.float() * scale).to(dtype)


def quantize_block_fp8(
    weight: torch.Tensor,  # [out, in] float
    block_size: int = FP8_BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([out, in] float8_e4m3fn, [blocks_out, blocks_in])
    """The inverse, as DeepSeek made its checkpoints: each block's max magnitude maps to 448."""
    rows, cols = weight.shape
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    padded_rows, padded_cols = (
        -(-rows // block_size) * block_size,
        -(-cols // block_size) * block_size,
    )
    padded = torch.zeros(padded_rows, padded_cols, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(
        padded_rows // block_size, block_size, padded_cols // block_size, block_size
    )
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [blocks_out, blocks_in]
    scale_inv = amax / fp8_max
    quantized = (blocks / scale_inv[:, None, :, None]).view_as(padded)
    return quantized[:rows, :cols].to(torch.float8_e4m3fn), scale_inv
