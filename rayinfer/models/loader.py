"""Build a model from a Hugging Face checkpoint folder: safetensors, single file or sharded.

The model is built with its parameters in the target dtype (a few, such as DeepSeek's expert
correction bias, stay float32). Tensors are read one at a time with `safetensors.safe_open` and
handed to the model's `load_weights`, whose weight loaders copy them into those parameters and so
cast them; FP8 block-scaled weights (DeepSeek-V3) are dequantized to the target dtype on the way,
unless `fp8_weights=True`: then the layers that can keep them (see DeepseekForCausalLM) receive
the float8_e4m3fn weights as stored plus their `weight_scale_inv` block scales.
Before anything is read, every checkpoint tensor the model needs is checked to be present.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from rayinfer.config import ConfigError, ModelConfig
from rayinfer.layers.parallel import SINGLE, ParallelContext
from rayinfer.models.fp8 import SCALE_SUFFIX, check_fp8_weights, dequantize_block_fp8
from rayinfer.models.registry import model_class

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class WeightLoadError(ValueError):
    """A checkpoint tensor is missing or does not fit its parameter; the message names it."""


def load_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    parallel: ParallelContext = SINGLE,
    fp8_weights: bool = False,
) -> nn.Module:
    """The model of `config.architecture` filled from the checkpoint at `config.path`; eval mode.

    fp8_weights: keep FP8 block-scaled weights in FP8 (DeepSeek V2/V3; ConfigError when the
    checkpoint has none or the tensor-parallel split would cut a 128x128 block)."""
    with CheckpointReader(Path(config.path)) as reader:
        extra = {}
        if fp8_weights:
            check_fp8_weights(config, parallel.tp_size)
            check_has_fp8_weights(reader.file_of, config.path)
            extra = {"fp8_weights": True}
        with _default_dtype(dtype), torch.device(device):
            model = model_class(config)(config, parallel, **extra)
        if fp8_weights:
            reader.keep_fp8(model.fp8_checkpoint_names())
        check_all_present(model, reader.names)
        weights = reader.weights(dtype, device)
        try:
            model.load_weights(weights)
        except (ValueError, KeyError, RuntimeError) as error:
            raise WeightLoadError(
                f"checkpoint tensor {reader.current_name!r} in {config.path}: {error}"
            ) from error
        finally:
            weights.close()  # ends the progress bar's line even when loading failed
    return model.eval()


def checkpoint_has_fp8_weights(path: str | Path) -> bool:
    """Whether the checkpoint folder stores block-scaled FP8 weights (`*.weight_scale_inv`)."""
    return any(name.endswith(SCALE_SUFFIX) for name in checkpoint_files(Path(path)))


def check_has_fp8_weights(file_of: dict[str, str], path, key: str = "fp8_weights") -> None:
    if not any(name.endswith(SCALE_SUFFIX) for name in file_of):
        raise ConfigError(
            f"{key}=true, but the checkpoint {path} has no FP8 block-scaled weights (no "
            f"`*.weight{SCALE_SUFFIX}` tensors); use {key}=false for this checkpoint"
        )


def check_all_present(model: nn.Module, names: set[str]) -> None:
    expected_names = getattr(model, "expected_checkpoint_names", None)
    expected = expected_names() if expected_names else {n for n, _ in model.named_parameters()}
    normalize = getattr(model, "normalize_checkpoint_name", None)  # names that vary by writer
    if normalize is not None:
        names = {normalize(n) for n in names}
    missing = sorted(expected - names)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise WeightLoadError(
            f"checkpoint is missing tensor(s) {shown} needed by {type(model).__name__}; "
            "is the checkpoint complete (all shards listed in the index present)?"
        )


@contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class CheckpointReader:
    """Lazy access to the tensors of one checkpoint folder, by name, across shards."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.file_of = checkpoint_files(folder)  # tensor name -> file
        self.current_name: str | None = None
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        self._fp8_kept: set[str] = set()  # FP8 weights handed over as stored, with their scales

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @property
    def names(self) -> set[str]:
        """Tensor names as the model sees them: FP8 scales folded into their weights, except the
        scales of the weights kept in FP8 (`keep_fp8`)."""
        kept_scales = {n + SCALE_SUFFIX for n in self._fp8_kept}
        return {n for n in self.file_of if not n.endswith(SCALE_SUFFIX) or n in kept_scales}

    def keep_fp8(self, weight_names: set[str]) -> None:
        """Hand these weights over as stored (float8_e4m3fn) and their `weight_scale_inv` too.
        Each must be an FP8 weight with scales in the checkpoint (ConfigError names one that is
        not); the other FP8 weights are still dequantized."""
        unscaled = sorted(
            n for n in weight_names if n in self.file_of and n + SCALE_SUFFIX not in self.file_of
        )
        if unscaled:
            more = f" and {len(unscaled) - 1} more" if len(unscaled) > 1 else ""
            raise ConfigError(
                f"fp8_weights=true, but checkpoint tensor {unscaled[0]!r}{more} has no "
                f"{SCALE_SUFFIX.lstrip('_')} (not FP8 block-scaled) although its layer keeps FP8 "
                "weights; use fp8_weights=false for this checkpoint"
            )
        self._fp8_kept = set(weight_names)

    def get(self, name: str) -> torch.Tensor:
        file = self.file_of[name]
        if file not in self._handles:
            handle = safe_open(str(self.folder / file), framework="pt", device="cpu")
            self._handles[file] = self._stack.enter_context(handle)
        return self._handles[file].get_tensor(name)

    def weights(self, dtype: torch.dtype, device) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in file order on `device`; FP8 weights dequantized to `dtype`."""
        names = sorted(self.names, key=lambda n: (self.file_of[n], n))
        with tqdm(names, desc=f"Loading {self.folder.name}", unit="tensor") as progress:
            for name in progress:
                self.current_name = name
                yield name, self.read(name, dtype, device)

    def read(self, name: str, dtype: torch.dtype, device) -> torch.Tensor:
        """Moved to `device` before dequantizing, which runs faster on a GPU.

        Other tensors keep the checkpoint's dtype: casting here to `dtype` would round a float32
        parameter (the noaux_tc correction bias) through bfloat16 and change expert choices.
        """
        tensor = self.get(name).to(device)
        scale_name = name + SCALE_SUFFIX
        if name in self._fp8_kept:  # as stored; the layer checks that it is float8_e4m3fn
            return tensor
        if tensor.dtype == torch.float8_e4m3fn and scale_name in self.file_of:
            return dequantize_block_fp8(tensor, self.get(scale_name).to(device), dtype)
        return tensor


def checkpoint_files(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name, from the index of a sharded checkpoint or one file."""
    index = folder / INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = folder / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt", device="cpu") as handle:
            return dict.fromkeys(handle.keys(), SINGLE_FILE)
    raise WeightLoadError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
