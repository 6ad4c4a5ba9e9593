"""Resolve what the user named as a model into a checkpoint folder, a device and a dtype."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rayinfer.config import ConfigError

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")


def __getattr__(name: str):
    """DTYPES (dtype name -> torch.dtype) is made on first use: resolving a model path (a Serve
    ingress replica does, and needs no torch otherwise) does not import torch."""
    if name == "DTYPES":
        import torch

        return {dtype: getattr(torch, dtype) for dtype in DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    import torch

    if device not in DEVICES and not device.startswith("cuda:"):
        raise ConfigError(f"device={device!r} is not valid; use one of {', '.join(DEVICES)}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but no CUDA GPU is visible; use device=cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None picks float32 on the CPU and bfloat16 on GPUs."""
    import torch

    if dtype is None or dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"dtype={dtype!r} is not valid; use one of {', '.join(DTYPE_NAMES)}")
    return getattr(torch, dtype)
