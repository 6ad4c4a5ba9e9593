"""FP8 block-scaled weights: float8_e4m3fn values with one scale per 128x128 block.

A DeepSeek-V3 checkpoint stores `<name>.weight` [out, in] in float8_e4m3fn and
`<name>.weight_scale_inv` [ceil(out / 128), ceil(in / 128)] float32; the real weight is
`weight * scale` block by block (a partial block at the bottom or right edge has a scale too).
DeepSeek-V4 stores the same blocks with UE8M0 scales (`scale_fmt="ue8m0"`): powers of two kept as
their 8-bit biased exponent, `float8_e8m0fnu` (or those bytes as uint8), scale = 2^(e - 127);
rayinfer/models/checkpoint_format.py says where each format names them.
"""

from __future__ import annotations

import torch

from rayinfer.config import MLA_ARCHITECTURES, ConfigError

FP8_BLOCK_SIZE = 128
SCALE_SUFFIX = "_scale_inv"


def decode_scales(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as float32: float scales as they are; UE8M0 (float8_e8m0fnu, or its bytes as
    uint8) as the power of two 2^(e - 127) each byte holds (0xFF, UE8M0's NaN, stays NaN)."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    return scale.float()


def ue8m0_scales(scale: torch.Tensor) -> torch.Tensor:
    """Float scales rounded up to powers of two, as float8_e8m0fnu (DeepSeek's `scale_fmt="ue8m0"`:
    2^ceil(log2(s)), so that `x / s` stays within the format's range)."""
    exponent = torch.ceil(torch.log2(scale.float().clamp(min=torch.finfo(torch.float32).tiny)))
    return torch.exp2(exponent).to(torch.float8_e8m0fnu)


def dequantize_block_fp8(
    weight: torch.Tensor,  # [out, in] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(out / block), ceil(in / block)] float32 or UE8M0
    dtype: torch.dtype,
    block_size: int = FP8_BLOCK_SIZE,
    names: tuple[str, str] = ("weight", "weight_scale_inv"),  # how errors name the two tensors
) -> torch.Tensor:  # [out, in] dtype
    rows, cols = weight.shape
    expected = (-(-rows // block_size), -(-cols // block_size))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"{names[1]} shape {tuple(scale_inv.shape)} does not match {names[0]} "
            f"{tuple(weight.shape)} in {block_size}x{block_size} blocks; expected {expected}"
        )
    scale = decode_scales(scale_inv)
    scale = scale.repeat_interleave(block_size, 0)[:rows]  # [out, ceil(in / block)]
    scale = scale.repeat_interleave(block_size, 1)[:, :cols]  # [out, in]
    return (weight.float() * scale).to(dtype)


def quantize_block_fp8(
    weight: torch.Tensor,  # [out, in] float
    block_size: int = FP8_BLOCK_SIZE,
    scale_fmt: str = "float",
) -> tuple[torch.Tensor, torch.Tensor]:  # ([out, in] float8_e4m3fn, [blocks_out, blocks_in])
    """The inverse, as DeepSeek made its checkpoints: each block's max magnitude maps to 448;
    scale_fmt="ue8m0" (V4) rounds each scale up to a power of two first and returns the scales
    as float8_e8m0fnu (float32 otherwise)."""
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
    if scale_fmt == "ue8m0":
        scale_inv = ue8m0_scales(scale_inv)
    elif scale_fmt != "float":
        raise ValueError(f"scale_fmt={scale_fmt!r}; use 'float' or 'ue8m0'")
    quantized = (blocks / scale_inv.float()[:, None, :, None]).view_as(padded)
    return quantized[:rows, :cols].to(torch.float8_e4m3fn), scale_inv


def check_fp8_weights(config, tp_size: int = 1, key: str = "fp8_weights", tp_key: str = "tp"):
    """Fail (ConfigError naming the key and the sizes) unless `config`'s model can keep FP8
    block-scaled weights when split `tp_size` ways: no 128x128 block may be cut between
    tensor-parallel ranks, nor between the gate and up halves of a stacked gate/up weight."""
    if config.architecture not in MLA_ARCHITECTURES:
        raise ConfigError(
            f"{key}=true is implemented for DeepSeek V2/V3 checkpoints only, not "
            f"{config.architecture}; use {key}=false (FP8 weights are dequantized at load)"
        )
    heads = config.num_attention_heads
    # (key as the config names it, its value, whether TP splits it, whether gate/up stack it)
    sizes = [
        (
            "num_attention_heads*(qk_nope_head_dim+qk_rope_head_dim)",
            heads * (config.qk_nope_head_dim + config.qk_rope_head_dim),
            True,
            False,
        ),
        ("num_attention_heads*v_head_dim", heads * config.v_head_dim, True, False),
    ]
    layers = range(config.num_layers)
    if any(not config.is_moe_layer(i) for i in layers):
        sizes.append(("intermediate_size", config.intermediate_size, True, True))
    if any(config.is_moe_layer(i) for i in layers):
        sizes.append(("moe_intermediate_size", config.moe_intermediate_size, False, True))
        if config.num_shared_experts:
            shared = config.moe_intermediate_size * config.num_shared_experts
            sizes.append(("moe_intermediate_size*n_shared_experts", shared, True, True))

    def problem(tp: int) -> str | None:
        for name, value, split, stacked in sizes:
            local = value // tp if split else value
            if (split and tp > 1 or stacked) and local % FP8_BLOCK_SIZE:
                if stacked and not (split and tp > 1):
                    return (
                        f"{name}={value} is not a multiple of {FP8_BLOCK_SIZE}, so the gate and "
                        f"up halves of the stacked weight would share a {FP8_BLOCK_SIZE}x"
                        f"{FP8_BLOCK_SIZE} FP8 block"
                    )
                return (
                    f"{tp_key}={tp} splits {name}={value} into {local} per rank, which is not a "
                    f"multiple of {FP8_BLOCK_SIZE}: a {FP8_BLOCK_SIZE}x{FP8_BLOCK_SIZE} FP8 "
                    "weight block would be cut between ranks"
                )
        return None

    found = problem(tp_size)
    if found is None:
        return
    valid = [tp for tp in range(1, heads + 1) if heads % tp == 0 and problem(tp) is None]
    hint = f"use {tp_key} in {valid} or {key}=false" if valid else f"use {key}=false"
    raise ConfigError(f"{key}=true: {found}; {hint}")
