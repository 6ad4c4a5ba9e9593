"""Resolve what the user named as a model into a checkpoint folder, a device and a dtype."""

from __future__ import annotations

from pathlib import Path

import torch

from rayinfer.config import ConfigError

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DEVICES = ("auto", "cpu", "cuda")


def resolve_model_path(model: str) -> Path:
    if model == "tiny":
        from rayinfer.models.tiny import ensure_tiny_model

        return Path(ensure_tiny_model())
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model={model!r} is neither 'tiny' nor a folder with config.json "
            "(a Hugging Face checkpoint: config.json, *.safetensors, tokenizer.json)"
        )
    return path


def resolve_device(device: str) -> torch.device:
    if device not in DEVICES and not device.startswith("cuda:"):
        raise ConfigError(f"device={device!r} is not valid; use one of {', '.join(DEVICES)}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but no CUDA GPU is visible; use device=cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None picks float32 on the CPU and bfloat16 on GPUs."""
    if dtype is None or dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not valid; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]
