"""Linear layers that know their tensor-parallel shard.

Weights are `[out_features, in_features]` as in checkpoints. Each parameter carries a
`weight_loader(param, loaded, shard_id=None)` that copies this rank's slice of a checkpoint tensor;
`shard_id` picks the part of a merged parameter (gate/up, q/k/v) the tensor fills.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rayinfer.layers.parallel import SINGLE, ParallelContext, divide


def _check_shape(param: torch.Tensor, loaded: torch.Tensor, name: str = "weight") -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"{name}: checkpoint shape {tuple(loaded.shape)}, expected {tuple(param.shape)}"
        )


def _check_full_size(loaded: torch.Tensor, dim: int, size: int) -> None:
    """Before taking this rank's slice: the whole checkpoint tensor has the unsplit size."""
    if loaded.dim() <= dim or loaded.shape[dim] != size:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)}: expected {size} along dim {dim}")


class ReplicatedLinear(nn.Module):
    """Every rank holds the whole weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _check_shape(param, loaded)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """Output features split across tensor-parallel ranks; no communication in forward.

    `output_sizes` lists the parts of a merged weight (e.g. [I, I] for gate and up); each part is
    split separately so that rank r holds the r-th slice of every part.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool = False,
        parallel: ParallelContext = SINGLE,
    ):
        super().__init__()
        self.parallel = parallel
        self.output_sizes = [divide(n, parallel.tp_size, "output features") for n in output_sizes]
        out_local = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(out_local, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None):
        part = 0 if shard_id is None else shard_id
        if shard_id is None and len(self.output_sizes) > 1:
            loaded_parts = loaded.split([n * self.parallel.tp_size for n in self.output_sizes])
            for index, piece in enumerate(loaded_parts):
                self.weight_loader(param, piece, index)
            return
        size = self.output_sizes[part]
        start = sum(self.output_sizes[:part])
        _check_full_size(loaded, 0, size * self.parallel.tp_size)
        local = loaded.narrow(0, self.parallel.tp_rank * size, size)
        target = param.data.narrow(0, start, size)
        _check_shape(target, local)
        target.copy_(local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features split across ranks; the partial outputs are summed with an all-reduce."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        parallel: ParallelContext = SINGLE,
    ):
        super().__init__()
        self.parallel = parallel
        self.in_local = divide(in_features, parallel.tp_size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.bias_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _check_full_size(loaded, 1, self.in_local * self.parallel.tp_size)
        local = loaded.narrow(1, self.parallel.tp_rank * self.in_local, self.in_local)
        _check_shape(param, local)
        param.data.copy_(local)

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _check_shape(param, loaded, "bias")
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.parallel.tp_size > 1:
            self.parallel.tp_group.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out
