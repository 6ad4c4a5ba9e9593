"""RMSNorm with the residual add fused in (through `kernels.ops`)."""

from __future__ import annotations

import torch
from torch import nn

from rayinfer.kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [T, H] -> normed [T, H]; with a residual, returns (normed, x + residual)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)
