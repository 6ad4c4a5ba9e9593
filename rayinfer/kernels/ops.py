"""The engine's only door to kernels: Triton on CUDA where a kernel exists, the torch reference
elsewhere. Layers call `ops.<name>`; nothing else picks an implementation."""

from __future__ import annotations

import torch

from rayinfer.kernels.activation import silu_and_mul_reference
from rayinfer.kernels.fused_moe import fused_moe_reference
from rayinfer.kernels.rms_norm import rms_norm_reference


def _on_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda


def rms_norm(x, weight, eps, residual=None):
    return rms_norm_reference(x, weight, eps, residual)


def silu_and_mul(x):
    return silu_and_mul_reference(x)


def fused_moe(x, w13, w2, topk_weights, topk_ids):
    return fused_moe_reference(x, w13, w2, topk_weights, topk_ids)
