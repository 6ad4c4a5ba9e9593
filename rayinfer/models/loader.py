"""Build a model from a Hugging Face checkpoint folder: safetensors, single file or sharded.

The model is built with its parameters in the target dtype (a few, such as DeepSeek's expert
correction bias, stay float32). Tensors are read one at a time with `safetensors.safe_open` and
handed to the model's `load_weights`, whose weight loaders copy them into those parameters and so
cast them; FP8 block-scaled weights (DeepSeek-V3) are dequantized to the target dtype on the way.
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

from rayinfer.config import ModelConfig
from rayinfer.layers.parallel import SINGLE, ParallelContext
from rayinfer.models.fp8 import SCALE_SUFFIX, dequantize_block_fp8
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
) -> nn.Module:
    """The model of `config.architecture` filled from the checkpoint at `config.path`; eval mode."""
    with _default_dtype(dtype), torch.device(device):
        model = model_class(config)(config, parallel)
    with CheckpointReader(Path(config.path)) as reader:
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


def check_all_present(model: nn.Module, names: set[str]) -> None:
    expected_names = getattr(model, "expected_checkpoint_names", None)
    expected = expected_names() if expected_names else {n for n, _ in model.named_parameters()}
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

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @property
    def names(self) -> set[str]:
        """Tensor names as the model sees them (FP8 scales folded into their weights)."""
        return {n for n in self.file_of if not n.endswith(SCALE_SUFFIX)}

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
