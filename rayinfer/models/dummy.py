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
) -> nn.Module:
    """The model of `config.architecture` with normal(0, std) weights (norm weights 1), made on
    `device` directly; each rank draws only its own shard."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config)(config, parallel)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name:
                param.fill_(1.0)
            elif param.dtype.is_floating_point:
                param.normal_(0.0, std, generator=generator)
    return model.eval()
