"""How a GPU keeps MXFP4 experts' packed bytes, per kernel: still 4 bits a value and the UE8M0
scales as shipped, only the bits within a byte or a 4-byte word rearranged.

    "shipped"  as checkpoints store them (value 2j in byte j's low nibble): the float32
               reference and the W4A16 kernels that read them so
    "swapped"  each byte's bit pairs 2-3 and 4-5 swapped (`swap_bit_pairs`): the four-lane
               W4A16 kernel's shorter lookup (fused_moe_mxfp4_quad.py)
"""

from __future__ import annotations

import torch

from rayinfer.kernels.moe.fused_moe_mxfp4 import swap_bit_pairs

MXFP4_LAYOUTS = ("shipped", "swapped")


def from_shipped(packed: torch.Tensor, layout: str) -> torch.Tensor:
    """Bytes as shipped -> the layout's (a new tensor; the same one for "shipped")."""
    if layout == "swapped":
        return swap_bit_pairs(packed)
    _check(layout)
    return packed


def to_shipped(packed: torch.Tensor, layout: str) -> torch.Tensor:
    """The layout's bytes -> as shipped (a new tensor; the same one for "shipped")."""
    if layout == "swapped":
        return swap_bit_pairs(packed)  # its own inverse
    _check(layout)
    return packed


def relayout_(packed: torch.Tensor, old: str, new: str) -> None:
    """Rewrite packed [E, N, K/2] from layout old to new in place, an expert at a time (the
    conversions' temporaries stay at one expert's size)."""
    if old == new:
        return
    for expert in range(packed.shape[0]):
        packed[expert] = from_shipped(to_shipped(packed[expert], old), new)


def _check(layout: str) -> None:
    if layout not in MXFP4_LAYOUTS:
        raise ValueError(f"MXFP4 layout {layout!r}; use one of {MXFP4_LAYOUTS}")
