"""Random weights instead of a checkpoint (vLLM's `load_format="dummy"`): a folder with only
config.json is enough, so benchmarks can run full-size model shapes without tens of GB of files."""

from __future__ import annotations

import torch
from torch import nn

from rayinfer.config import ModelConfig
from rayinfer.layers.parallel import SINGLE, ParallelContext
from rayinfer.models.registry import model_class

LOAD_FORMATS = ("safetensors", "dummy")


def build_dummy_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    parallel: ParallelContext = SINGLE,
    seed: int = 0,
    std: float = 0.02,
    fp8_weights: bool = False,
) -> nn.Module:
    """The model of `config.architecture` with normal(0, std) weights (norm weights 1), made on
    `device` directly; each rank draws only its own shard. fp8_weights: the layers that can keep
    FP8 block-scaled weights do (DeepSeek), with the normal draws rounded to FP8 and scales 1."""
    extra = {}
    if fp8_weights:
        from rayinfer.models.fp8 import check_fp8_weights

        check_fp8_weights(config, parallel.tp_size)
        extra = {"fp8_weights": True}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config)(config, parallel, **extra)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name:
                param.fill_(1.0)
            elif param.dtype == torch.float8_e4m3fn:
                rows = param.view(-1, param.shape[-1])
                step = max(1, (1 << 26) // rows.shape[1])  # ~64M values: a bounded temporary
                for chunk in rows.split(step):
                    draw = torch.empty(chunk.shape, dtype=torch.float32, device=chunk.device)
                    chunk.copy_(draw.normal_(0.0, std, generator=generator))
            elif name.endswith("_scale_inv") or name.endswith("_scale"):
                param.fill_(1.0)
            elif param.dtype.is_floating_point:
                param.normal_(0.0, std, generator=generator)
    return model.eval()
