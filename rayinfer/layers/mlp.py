"""The gated (SwiGLU) MLP of dense layers and shared experts, and the default weight loader."""

from __future__ import annotations

import torch
from torch import nn

from rayinfer.kernels import ops
from rayinfer.layers.linear import ColumnParallelLinear, RowParallelLinear
from rayinfer.layers.parallel import SINGLE, ParallelContext


def copy_checked(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Default weight loader: the whole tensor, with a shape check that names both shapes."""
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


class GatedMLP(nn.Module):
    """SwiGLU MLP (dense layers and shared experts): down(silu(gate(x)) * up(x)); with
    swiglu_limit (DeepSeek-V4's DeepseekV4MLP), gate clamped above and up both ways first."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelContext = SINGLE,
        fp8: bool = False,
        swiglu_limit: float | None = None,
    ):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], parallel=parallel, fp8=fp8
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, parallel=parallel, fp8=fp8
        )

    def load_weight(self, projection: str, loaded: torch.Tensor, is_scale: bool = False) -> None:
        """Checkpoint `gate_proj` / `up_proj` / `down_proj` weight (or, is_scale, its FP8
        `weight_scale_inv`) -> this rank's slice."""
        module = self.down_proj if projection == "down_proj" else self.gate_up_proj
        param = module.weight_scale_inv if is_scale else module.weight
        if param is None:
            raise ValueError(f"{projection} keeps no FP8 scales here (fp8_weights is off)")
        load = module.scale_loader if is_scale else module.weight_loader
        if projection == "down_proj":
            load(param, loaded)
            return
        load(param, loaded, {"gate_proj": 0, "up_proj": 1}[projection])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x), self.swiglu_limit))
