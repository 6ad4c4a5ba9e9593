"""Tuned Triton tile configs, read from `kernels/configs/<op>.json`.

Layout of a file: {"<GPU name as torch reports it>": {"<shape key>": {"<M bucket>": config}}}.
A shape key names the fixed dimensions (e.g. "N=7168,K=2048"); "default" serves any other shape.
The bucket picked is the smallest one >= M (the largest if M exceeds them all).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

CONFIG_DIR = Path(__file__).parent / "configs"


@functools.cache
def _load(op: str) -> dict:
    path = CONFIG_DIR / f"{op}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def pick_tile_config(op: str, device_name: str, shape_key: str, m: int) -> dict | None:
    """The tuned config for this GPU, shape and row count, or None when none was tuned."""
    by_shape = _load(op).get(device_name, {})
    buckets = by_shape.get(shape_key) or by_shape.get("default")
    if not buckets:
        return None
    sizes = sorted(int(size) for size in buckets)
    chosen = next((size for size in sizes if size >= m), sizes[-1])
    return dict(buckets[str(chosen)])
