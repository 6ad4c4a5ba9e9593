"""Build a model from a Hugging Face checkpoint folder: safetensors, single file or sharded.

The model is built with its parameters in the target dtype (a few, such as DeepSeek's expert
correction bias, stay float32). Tensors are read one at a time with `safetensors.safe_open` and
handed to the model's `load_weights`, whose weight loaders copy them into those parameters and so
cast them. Scaled weights (checkpoint_format.py: DeepSeek-V3's FP8 blocks, DeepSeek-V4's FP8
blocks with UE8M0 scales and MXFP4 experts) are dequantized to the target dtype on the way and
their scales never reach the model, except for the weights the model keeps as stored:
- `fp8_weights=True`: `model.fp8_checkpoint_names()` (see DeepseekForCausalLM) come as
  float8_e4m3fn with their block scales as float32, under the scale's checkpoint name
  (`<p>.weight_scale_inv`, or V4's `<p>.scale`);
- a model whose experts keep MXFP4 lists them in `model.mxfp4_checkpoint_names()`: they come
  packed as uint8 [N, K / 2] (low nibble first) with their scales as uint8 exponents [N, K / 32]
  under `<p>.scale`.
Both lists may use the model's own spelling of the names (`normalize_checkpoint_name`); the
scales then arrive under the checkpoint's. Before anything is read, every checkpoint tensor the
model needs is checked to be present.
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
from rayinfer.models.checkpoint_format import CheckpointFormat, scale_names
from rayinfer.models.fp8 import check_fp8_weights
from rayinfer.models.mxfp4 import check_mxfp4_shapes
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
    with CheckpointReader(Path(config.path), CheckpointFormat.from_hf(config.hf)) as reader:
        extra = {}
        if fp8_weights:
            check_fp8_weights(config, parallel.tp_size)
            check_has_fp8_weights(reader.file_of, config.path)
            extra = {"fp8_weights": True}
        with _default_dtype(dtype), torch.device(device):
            model = model_class(config)(config, parallel, **extra)
        if fp8_weights:
            reader.keep_as_stored(
                stored_names(model, model.fp8_checkpoint_names(), reader.file_of),
                "fp8_weights=true",
                "use fp8_weights=false for this checkpoint",
            )
        if hasattr(model, "mxfp4_checkpoint_names"):
            reader.keep_as_stored(
                stored_names(model, model.mxfp4_checkpoint_names(), reader.file_of),
                "the model keeps its experts in MXFP4",
                "is config.json's expert_dtype right for these weights?",
            )
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
    """Whether the checkpoint folder stores scaled weights (`*.weight_scale_inv`, `*.scale`)."""
    return bool(scale_names(checkpoint_files(Path(path))))


def check_has_fp8_weights(file_of: dict[str, str], path, key: str = "fp8_weights") -> None:
    if not scale_names(file_of):
        raise ConfigError(
            f"{key}=true, but the checkpoint {path} has no FP8 block-scaled weights (no "
            f"`*.weight_scale_inv` or `*.scale` tensors); use {key}=false for this checkpoint"
        )


def stored_names(model: nn.Module, names: set[str], file_of: dict[str, str]) -> set[str]:
    """The checkpoint's own spelling of `names`, for a model whose `normalize_checkpoint_name`
    maps several spellings (`model.layers...`, `layers...`) onto the names it gives."""
    normalize = getattr(model, "normalize_checkpoint_name", None)
    if normalize is None:
        return set(names)
    return {name for name in file_of if normalize(name) in names}


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

    def __init__(self, folder: Path, checkpoint_format: CheckpointFormat | None = None):
        self.folder = folder
        self.format = checkpoint_format or CheckpointFormat()
        self.file_of = checkpoint_files(folder)  # tensor name -> file
        self.scale_of = scale_names(self.file_of)  # scaled weight -> its scale
        self.current_name: str | None = None
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        self._kept: dict[str, str] = {}  # scale -> weight, of weights handed over as stored

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @property
    def names(self) -> set[str]:
        """Tensor names as the model sees them: scales folded into their weights, except the
        scales of the weights kept as stored (`keep_as_stored`)."""
        folded = set(self.scale_of.values()) - set(self._kept)
        return set(self.file_of) - folded

    def keep_as_stored(self, weight_names: set[str], reason: str, fix: str) -> None:
        """Hand these weights over as stored, their scales too (see the module docstring).
        Each must be a scaled weight in the checkpoint (a ConfigError with `reason` and `fix`
        names one that is not); the other scaled weights are still dequantized."""
        unscaled = sorted(n for n in weight_names if n in self.file_of and n not in self.scale_of)
        if unscaled:
            more = f" and {len(unscaled) - 1} more" if len(unscaled) > 1 else ""
            raise ConfigError(
                f"{reason}, but checkpoint tensor {unscaled[0]!r}{more} has no scale_inv or "
                "scale beside it (not stored quantized) although its layer keeps quantized "
                f"weights; {fix}"
            )
        self._kept.update({self.scale_of[n]: n for n in weight_names if n in self.scale_of})

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def _handle(self, name: str):
        file = self.file_of[name]
        if file not in self._handles:
            handle = safe_open(str(self.folder / file), framework="pt", device="cpu")
            self._handles[file] = self._stack.enter_context(handle)
        return self._handles[file]

    def weights(self, dtype: torch.dtype, device) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in file order on `device`; scaled weights dequantized to `dtype`."""
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
        if name in self._kept:  # the scale of a kept weight
            weight = self._handle(self._kept[name]).get_slice(self._kept[name])
            is_fp8 = weight.get_dtype() == "F8_E4M3"
            if not is_fp8:  # MXFP4: it must fit its packed weight (read later or earlier)
                packed = torch.empty(weight.get_shape(), dtype=torch.uint8, device="meta")
                check_mxfp4_shapes(packed, tensor, (self._kept[name], name))
            return self.format.scale_as_stored(tensor, is_fp8=is_fp8)
        scale_name = self.scale_of.get(name)
        if scale_name is None:
            return tensor
        if scale_name in self._kept:
            stored = self.format.as_stored(tensor, name)
            if stored.dtype == torch.uint8:  # packed MXFP4: its scale must fit it (not read yet)
                shape = self._handle(scale_name).get_slice(scale_name).get_shape()
                scale = torch.empty(shape, dtype=torch.uint8, device="meta")
                check_mxfp4_shapes(stored, scale, (name, scale_name))
            return stored
        scale = self.get(scale_name).to(device)
        return self.format.dequantize(tensor, scale, dtype, (name, scale_name))


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
