"""MXFP4 weights (DeepSeek-V4's routed experts): FP4 e2m1 values, two per byte, and one UE8M0
power-of-two scale per 32 values along the input dimension K.

    packed [N, K / 2] uint8 (stored as int8, uint8 or float4_e2m1fn_x2): byte j of a row holds
        value 2j in its low nibble and value 2j + 1 in its high nibble
    scale  [N, K / 32] UE8M0 (float8_e8m0fnu, or its bytes as uint8): 2^(e - 127)
    weight[n, k] = E2M1[nibble(n, k)] * scale[n, k // 32]

An e2m1 nibble is sign (bit 3), exponent (bits 2-1, bias 1) and mantissa (bit 0):
0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. The sources are in checkpoint_format.py.
"""

from __future__ import annotations

import torch

from rayinfer.models.fp8 import decode_scales, ue8m0_scales

MXFP4_GROUP = 32  # values per scale along K
E2M1_MAX = 6.0
# the value of each nibble 0..15 (0b1000 is -0.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES += tuple(-v for v in E2M1_VALUES)
_PACKED_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
# |x| at which rounding moves to the next magnitude code (midpoints of E2M1_VALUES[:8])
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def is_packed_fp4(tensor: torch.Tensor) -> bool:
    return tensor.dtype in _PACKED_DTYPES


def as_packed_bytes(packed: torch.Tensor) -> torch.Tensor:
    """The stored bytes as uint8 (a view: int8 or float4_e2m1fn_x2 reinterpreted, not converted)."""
    if not is_packed_fp4(packed):
        raise ValueError(
            f"packed FP4 values are int8, uint8 or float4_e2m1fn_x2, not {packed.dtype}"
        )
    return packed if packed.dtype == torch.uint8 else packed.view(torch.uint8)


def check_mxfp4_shapes(
    packed: torch.Tensor, scale: torch.Tensor, names: tuple[str, str] = ("weight", "scale")
) -> None:
    """ValueError naming both tensors unless `scale` [N, S] has one scale per 32 values of
    `packed` [N, 16 * S] (K = 32 * S; the format has no partial groups)."""
    if packed.dim() != 2 or scale.dim() != 2:
        raise ValueError(
            f"{names[0]} {tuple(packed.shape)} and {names[1]} {tuple(scale.shape)} must both be "
            "2-D ([N, K / 2] packed e2m1 and [N, K / 32] scales)"
        )
    rows, packed_cols = packed.shape
    group_bytes = MXFP4_GROUP // 2
    if scale.shape[0] != rows or scale.shape[1] * group_bytes != packed_cols:
        raise ValueError(
            f"{names[0]} {tuple(packed.shape)} packs {2 * packed_cols} e2m1 values per row, "
            f"which needs {names[1]} of shape ({rows}, {packed_cols / group_bytes:g}) (one per "
            f"{MXFP4_GROUP}); it has {tuple(scale.shape)}, which fits {names[0]} "
            f"({scale.shape[0]}, {scale.shape[1] * group_bytes})"
        )


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:  # [N, P] -> [N, 2P] float32
    """The e2m1 values of packed bytes, low nibble first."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = as_packed_bytes(packed).long()
    values = torch.stack([table[codes & 0xF], table[codes >> 4]], dim=-1)  # [N, P, 2]
    return values.flatten(-2)


def dequantize_mxfp4(
    packed: torch.Tensor,  # [N, K / 2] int8 / uint8 / float4_e2m1fn_x2
    scale: torch.Tensor,  # [N, K / 32] float8_e8m0fnu or uint8 exponents
    dtype: torch.dtype,
    names: tuple[str, str] = ("weight", "scale"),  # how errors name the two tensors
) -> torch.Tensor:  # [N, K] dtype
    check_mxfp4_shapes(packed, scale, names)
    values = unpack_e2m1(packed)  # [N, K] float32
    groups = values.view(values.shape[0], -1, MXFP4_GROUP)  # [N, K / 32, 32]
    return (groups * decode_scales(scale)[..., None]).flatten(1).to(dtype)


def quantize_mxfp4(
    weight: torch.Tensor,  # [N, K] float, K a multiple of 32
) -> tuple[torch.Tensor, torch.Tensor]:  # ([N, K / 2] int8, [N, K / 32] float8_e8m0fnu)
    """The inverse, as DeepSeek's fp4 quantization does it: each group's scale is
    2^ceil(log2(amax / 6)), values round to the nearest e2m1 (ties to the even code); stored as
    V4-Flash stores them (int8 bytes, float8_e8m0fnu scales)."""
    rows, cols = weight.shape
    if cols % MXFP4_GROUP:
        raise ValueError(f"K={cols} is not a multiple of {MXFP4_GROUP}")
    groups = weight.float().view(rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    amax = groups.abs().amax(dim=-1).clamp(min=E2M1_MAX * 2.0**-126)  # [N, K / 32]
    scale = ue8m0_scales(amax / E2M1_MAX)
    magnitude = (groups.abs() / scale.float()[..., None]).clamp(max=E2M1_MAX).flatten(1)
    midpoints = torch.tensor(_MIDPOINTS, device=weight.device)
    code = torch.bucketize(magnitude, midpoints, right=True)  # 0..7
    is_tie = magnitude == midpoints[(code - 1).clamp(min=0)]
    code = torch.where(is_tie & (code % 2 == 1), code - 1, code)
    code = code | torch.where(weight.float() < 0, 8, 0)  # [N, K] the sign bit
    pairs = code.view(rows, cols // 2, 2).to(torch.uint8)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.view(torch.int8), scale
