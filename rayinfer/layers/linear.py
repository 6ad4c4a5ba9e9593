"""Linear layers that know their tensor-parallel shard.

Weights are `[out_features, in_features]` as in checkpoints. Each parameter carries a
`weight_loader(param, loaded, shard_id=None)` that copies this rank's slice of a checkpoint tensor;
`shard_id` picks the part of a merged parameter (gate/up, q/k/v) the tensor fills.

`fp8=True` keeps a DeepSeek-V3 FP8 block-scaled weight as it is stored: `weight` [out, in]
float8_e4m3fn plus `weight_scale_inv` [ceil(out / 128), ceil(in / 128)] float32 (one scale per
128x128 block); forward quantizes the activations per token and 128 channels (`ops.fp8_quant`)
and multiplies with `ops.fp8_gemm`. A tensor-parallel shard must not cut a 128x128 block, nor may
one part of a merged weight end inside one (ConfigError, naming the sizes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rayinfer.config import ConfigError
from rayinfer.kernels import ops
from rayinfer.kernels.backends import DEFAULT_BACKENDS, KernelBackends
from rayinfer.layers.layer_options import UsesKernelBackends
from rayinfer.layers.parallel import SINGLE, ParallelContext, divide

FP8_BLOCK = 128  # DeepSeek-V3 weight blocks are 128 x 128


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


def _fp8_params(module: nn.Module, rows: int, cols: int, scale_loader) -> None:
    """Give `module` an FP8 `weight` [rows, cols] and its `weight_scale_inv` block scales."""
    weight = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    module.weight = nn.Parameter(weight, requires_grad=False)
    scale = torch.empty(_blocks(rows), _blocks(cols), dtype=torch.float32)
    module.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
    module.weight_scale_inv.weight_loader = scale_loader


def _check_fp8(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """An FP8 parameter takes only FP8 checkpoint tensors (copy_ would cast without a scale)."""
    if param.dtype == torch.float8_e4m3fn and loaded.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"checkpoint tensor is {loaded.dtype}, but this layer keeps FP8 block-scaled weights "
            "(fp8_weights=True); the checkpoint must store it as float8_e4m3fn + weight_scale_inv"
        )


def _check_block_aligned(what: str, size: int, tp_size: int) -> None:
    if size % FP8_BLOCK:
        raise ConfigError(
            f"fp8_weights: {what} of {size} rows per tensor-parallel rank (tp={tp_size}) would "
            f"cut a {FP8_BLOCK}x{FP8_BLOCK} FP8 weight block; use fp8_weights=False or another tp"
        )


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    backends: KernelBackends = DEFAULT_BACKENDS,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype: W8A8 with per-token x 128-channel activation scales."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], weight.shape[0])
    q, q_scale = ops.fp8_quant(x2)
    out = ops.fp8_gemm(q, q_scale, weight, scale_inv, out_dtype=x.dtype, backends=backends)
    return out.view(*x.shape[:-1], weight.shape[0])


def _matmul(x: torch.Tensor, layer: nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ layer.weight [N, K]^T (+ bias): W8A8 where the layer keeps FP8 weights."""
    if layer.weight_scale_inv is None:
        return F.linear(x, layer.weight, bias)
    out = fp8_linear(x, layer.weight, layer.weight_scale_inv, layer.kernels)
    return out if bias is None else out + bias


def _check_shape(param: torch.Tensor, loaded: torch.Tensor, name: str = "weight") -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"{name}: checkpoint shape {tuple(loaded.shape)}, expected {tuple(param.shape)}"
        )


def _check_full_size(loaded: torch.Tensor, dim: int, size: int) -> None:
    """Before taking this rank's slice: the whole checkpoint tensor has the unsplit size."""
    if loaded.dim() <= dim or loaded.shape[dim] != size:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)}: expected {size} along dim {dim}")


class ReplicatedLinear(UsesKernelBackends, nn.Module):
    """Every rank holds the whole weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, fp8: bool = False):
        super().__init__()
        self.weight_scale_inv = None
        if fp8:
            _fp8_params(self, out_features, in_features, self.scale_loader)
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _check_shape(param, loaded)
        _check_fp8(param, loaded)
        param.data.copy_(loaded)

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _check_shape(param, loaded, "weight_scale_inv")
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _matmul(x, self, self.bias)


class ColumnParallelLinear(UsesKernelBackends, nn.Module):
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
        fp8: bool = False,
    ):
        super().__init__()
        self.parallel = parallel
        self.output_sizes = [divide(n, parallel.tp_size, "output features") for n in output_sizes]
        out_local = sum(self.output_sizes)
        self.weight_scale_inv = None
        if fp8:
            # every part starts on a block row: parts but the last, and TP shards, whole blocks
            for index, size in enumerate(self.output_sizes):
                if parallel.tp_size > 1 or index < len(self.output_sizes) - 1:
                    _check_block_aligned(f"output part {index}", size, parallel.tp_size)
            _fp8_params(self, out_local, in_features, self.scale_loader)
        else:
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
        _check_fp8(target, local)
        target.copy_(local)

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None):
        """The block scales of one part (or of all parts, split like the weight)."""
        if shard_id is None and len(self.output_sizes) > 1:
            full_blocks = [_blocks(n * self.parallel.tp_size) for n in self.output_sizes]
            for index, piece in enumerate(loaded.split(full_blocks)):
                self.scale_loader(param, piece, index)
            return
        part = 0 if shard_id is None else shard_id
        size = self.output_sizes[part]
        start = sum(self.output_sizes[:part]) // FP8_BLOCK  # earlier parts are whole blocks
        _check_full_size(loaded, 0, _blocks(size * self.parallel.tp_size))
        local = loaded.narrow(0, self.parallel.tp_rank * size // FP8_BLOCK, _blocks(size))
        target = param.data.narrow(0, start, _blocks(size))
        _check_shape(target, local, "weight_scale_inv")
        target.copy_(local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _matmul(x, self, self.bias)


class RowParallelLinear(UsesKernelBackends, nn.Module):
    """Input features split across ranks; the partial outputs are summed with an all-reduce."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        parallel: ParallelContext = SINGLE,
        fp8: bool = False,
    ):
        super().__init__()
        self.parallel = parallel
        self.in_local = divide(in_features, parallel.tp_size, "input features")
        self.weight_scale_inv = None
        if fp8:
            if parallel.tp_size > 1:
                _check_block_aligned("input features", self.in_local, parallel.tp_size)
            _fp8_params(self, out_features, self.in_local, self.scale_loader)
        else:
            self.weight = nn.Parameter(
                torch.empty(out_features, self.in_local), requires_grad=False
            )
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.bias_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _check_full_size(loaded, 1, self.in_local * self.parallel.tp_size)
        local = loaded.narrow(1, self.parallel.tp_rank * self.in_local, self.in_local)
        _check_shape(param, local)
        _check_fp8(param, local)
        param.data.copy_(local)

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _check_full_size(loaded, 1, _blocks(self.in_local * self.parallel.tp_size))
        first = self.parallel.tp_rank * self.in_local // FP8_BLOCK
        local = loaded.narrow(1, first, _blocks(self.in_local))
        _check_shape(param, local, "weight_scale_inv")
        param.data.copy_(local)

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _check_shape(param, loaded, "bias")
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _matmul(x, self, None)
        if self.parallel.tp_size > 1:
            self.parallel.tp_group.all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out
