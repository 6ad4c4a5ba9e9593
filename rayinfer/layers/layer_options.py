"""Options a built model's layers read at run time: the kernel backends they hand to `ops`
(KernelBackends) and the overlap settings of the MoE layers (OverlapConfig). A layer that reads
one inherits its holder class, whose class attribute is the default; `configure_layers` sets the
runner's values on every such layer of a built model, once, before its first forward (as tensor
parallelism is applied after construction)."""

from __future__ import annotations

from torch import nn

from rayinfer.kernels.backends import DEFAULT_BACKENDS, KernelBackends
from rayinfer.overlap_config import DEFAULT_OVERLAP, OverlapConfig


class UsesKernelBackends:
    """A layer that calls an op several kernels serve: it passes `self.kernels` to it."""

    kernels: KernelBackends = DEFAULT_BACKENDS


class UsesOverlap:
    """A layer whose work beside the token exchange follows `self.overlap`."""

    overlap: OverlapConfig = DEFAULT_OVERLAP


def configure_layers(model: nn.Module, kernels: KernelBackends, overlap: OverlapConfig) -> None:
    for module in model.modules():
        if isinstance(module, UsesKernelBackends):
            module.kernels = kernels
        if isinstance(module, UsesOverlap):
            module.overlap = overlap
