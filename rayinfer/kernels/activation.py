"""SiLU-and-multiply: the gated activation of SwiGLU MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate then up) -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
