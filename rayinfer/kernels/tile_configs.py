"""Tuned Triton tile configs, read from `kernels/configs/<op>.json`.

Layout of a file: {"<GPU name as torch reports it>": {"<shape key>": {"<M bucket>": config}}}.
A shape key names the fixed dimensions (e.g. "N=7168,K=2048"); "default" serves any other shape.
The bucket picked is the smallest one >= M (the largest if M exceeds them all).

A GPU without an entry of its own takes the entry of the GPU tuned for its architecture
(`TUNED_FOR_ARCHITECTURE`): the same SM (registers, shared memory, instructions) with fewer or
slower SMs keeps the tiles that fit and feed it: every Hopper card (H100 SXM and PCIe, H800,
H20, GH200) takes the H200's, 1.3-2.1x the untuned defaults on an H100 for the fused MoE and
sparse MLA decode (benchmarks/RESULTS.md, kernels, `benchmarks/tiles_by_architecture.py`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"

# (major, minor) compute capability -> the GPU whose tuned entries that architecture takes
TUNED_FOR_ARCHITECTURE = {(9, 0): "NVIDIA H200"}


@functools.cache
def _load(op: str) -> dict:
    path = CONFIG_DIR / f"{op}.json"
    return json.loads(path.read_text()) if path.exists() else {}


@functools.cache
def _cuda_entry_names(index: int) -> tuple[str, ...]:
    name = torch.cuda.get_device_name(index)
    tuned = TUNED_FOR_ARCHITECTURE.get(torch.cuda.get_device_capability(index))
    return (name, tuned) if tuned and tuned != name else (name,)


def tile_entry_names(device: torch.device) -> tuple[str, ...]:
    """The entries a device's tiles are looked up under, most specific first: the GPU's own name
    (as torch reports it), then the GPU tuned for its architecture; ("cpu",) off the GPU
    (the interpreter's entries). Cached: no driver query per launch."""
    if device.type != "cuda":
        return ("cpu",)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_entry_names(index)


def pick_tile_config(op: str, device_names: str | tuple[str, ...], shape_key: str,
                     m: int) -> dict | None:  # fmt: skip
    """The tuned config for this GPU (the first of device_names with an entry), shape and row
    count, or None when none was tuned."""
    names = (device_names,) if isinstance(device_names, str) else device_names
    entries = _load(op)
    by_shape = next((entries[name] for name in names if name in entries), {})
    buckets = by_shape.get(shape_key) or by_shape.get("default")
    if not buckets:
        return None
    sizes = sorted(int(size) for size in buckets)
    chosen = next((size for size in sizes if size >= m), sizes[-1])
    return dict(buckets[str(chosen)])
