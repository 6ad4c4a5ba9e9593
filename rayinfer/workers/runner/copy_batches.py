"""Row copies between page-locked host memory and a device's paged cache as one driver call
(`cuMemcpyBatchAsync`, drivers of CUDA 12.8 on), which the copy engines carry out: a request's KV
moves without a gather or scatter kernel, so it takes no SM time from the steps beside it and,
where two processes share a GPU (time-sliced contexts), does not wait for the other's kernels.
`python benchmarks/handoff_copy_engines.py` times it against the staged copy and index kernels.

A request's rows lie in runs of consecutive cache slots (its blocks, merged where the block
manager handed out neighbours); each layer's run is one contiguous copy, as are its rows in the
hand-off's chunk (kv_transfer.layer_rows).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import NamedTuple

import numpy as np
import torch

_SUCCESS = 0
_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
_MIN_DRIVER_VERSION = 12080  # cuMemcpyBatchAsync's first driver


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_loc_hint", _Location),
        ("dst_loc_hint", _Location),
        ("flags", ctypes.c_uint),
    ]


@functools.cache
def _driver(holding_gil: bool = False):
    """The CUDA driver library (loaded once), or None where this process has none.

    holding_gil: its functions keep the GIL while they run (ctypes.PyDLL). For calls that
    return at once, as the batched copy does (it only queues the copies): one that let the GIL
    go would have to take it back, waiting up to the interpreter's switch interval where
    another thread runs Python (workers/gil_switch.py)."""
    try:
        return (ctypes.PyDLL if holding_gil else ctypes.CDLL)("libcuda.so.1")
    except OSError:
        return None


@functools.cache
def _driver_batch_copy():
    """(the driver's cuMemcpyBatchAsync, whether it takes a failure-index argument), or None
    where this process has no driver new enough."""
    driver = _driver()
    if driver is None:
        return None
    try:
        version = ctypes.c_int(0)
        if driver.cuDriverGetVersion(ctypes.byref(version)) != _SUCCESS:
            return None
    except AttributeError:
        return None
    if version.value < _MIN_DRIVER_VERSION:
        return None
    # CUDA 13 dropped the failure index (the `_v2` symbol); 12.8-12.9 drivers have only the first.
    queueing = _driver(holding_gil=True)
    for name, takes_fail_index in (("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)):
        function = getattr(queueing, name, None)
        if function is not None:
            function.restype = ctypes.c_int
            return function, takes_fail_index
    return None


def batch_copies_available(device: torch.device) -> bool:
    """Whether copies to and from `device` can go as one batched driver call."""
    return device.type == "cuda" and _driver_batch_copy() is not None


class SlotRuns(NamedTuple):
    """Runs of consecutive cache slots, each [num_runs] int64."""

    tokens: np.ndarray  # each run's first token index
    first_slots: np.ndarray  # each run's first slot
    lengths: np.ndarray  # each run's length in tokens


def slot_runs(slots: np.ndarray) -> SlotRuns:
    """A request's cache slots (in token order) as runs of consecutive slots."""
    slots = np.asarray(slots, dtype=np.int64)
    if slots.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return SlotRuns(empty, empty, empty)
    starts = np.flatnonzero(np.diff(slots) != 1) + 1
    tokens = np.concatenate(([0], starts))
    lengths = np.diff(np.append(tokens, slots.size))
    return SlotRuns(tokens, slots[tokens], lengths)


def mean_copy_bytes(slots: np.ndarray, token_bytes: int, num_layers: int) -> float:
    """The mean size of the copies moving the rows at `slots` (one per layer and run)."""
    runs = len(slot_runs(slots)[0])
    return len(slots) * token_bytes / max(runs * num_layers, 1)


class RowCopies:
    """The copies that move a request's rows between each layer's cache rows and a chunk's
    per-layer host rows (page-locked), issued as one batch on a stream."""

    def __init__(self, cache_rows: list[torch.Tensor]):
        """cache_rows: per layer [num_slots, row_bytes] uint8 (device)."""
        self.row_bytes = _column([rows.shape[1] for rows in cache_rows])
        self.cache_base = _column([rows.data_ptr() for rows in cache_rows])
        self.device_index = cache_rows[0].device.index or 0

    def issue(
        self, host_rows: list[torch.Tensor], slots: np.ndarray | SlotRuns, to_cache: bool, stream
    ) -> None:
        """host_rows (per layer [len(slots), row_bytes] uint8) -> the cache at `slots`
        (to_cache), or the reverse, in `stream`'s order. `slots` may come as their runs
        (slot_runs), for a caller that issues the same slots layer by layer."""
        tokens, first_slots, lengths = slots if isinstance(slots, SlotRuns) else slot_runs(slots)
        host_base = _column([rows.data_ptr() for rows in host_rows])
        cache = self.cache_base + first_slots[None, :] * self.row_bytes
        host = host_base + tokens[None, :] * self.row_bytes
        sizes = lengths[None, :] * self.row_bytes
        cache, host, sizes = (np.ascontiguousarray(a.reshape(-1), dtype=np.uint64)
                              for a in (cache, host, sizes))  # fmt: skip
        _make_context_current(self.device_index)
        if to_cache:
            _batch_copy(dsts=cache, srcs=host, sizes=sizes, stream=stream)
        else:
            _batch_copy(dsts=host, srcs=cache, sizes=sizes, stream=stream)


def _column(values: list[int]) -> np.ndarray:
    """[len(values), 1] int64: one row per layer, broadcast over runs."""
    return np.array(values, dtype=np.int64)[:, None]


_current = threading.local()  # per thread: whether the device's context is current there


def _make_context_current(device_index: int) -> None:
    """The driver call needs the device's context current in the calling thread (a thread
    whose first CUDA call this is has none); once per thread."""
    if getattr(_current, "device", None) == device_index:
        return
    driver = _driver()
    context = ctypes.c_void_p()
    if driver.cuCtxGetCurrent(ctypes.byref(context)) != _SUCCESS or not context.value:
        device = ctypes.c_int()
        driver.cuDeviceGet(ctypes.byref(device), device_index)
        driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)
        driver.cuCtxSetCurrent(context)
    _current.device = device_index


def _batch_copy(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream) -> None:
    """Issue the copies dsts[i] <- srcs[i] (sizes[i] bytes each) as one batch on `stream`; the
    batch runs in stream order, its copies in any order (they must not overlap)."""
    count = dsts.size
    if count == 0:
        return
    found = _driver_batch_copy()
    if found is None:
        raise RuntimeError("this driver has no cuMemcpyBatchAsync (CUDA 12.8 or later)")
    function, takes_fail_index = found
    attributes = _Attributes(src_access_order=_SRC_ACCESS_ORDER_STREAM)
    first_of_attributes = ctypes.c_size_t(0)  # the one set of attributes covers every copy
    pointer = ctypes.c_void_p
    args = [
        pointer(dsts.ctypes.data),
        pointer(srcs.ctypes.data),
        pointer(sizes.ctypes.data),
        ctypes.c_size_t(count),
        ctypes.byref(attributes),
        ctypes.byref(first_of_attributes),
        ctypes.c_size_t(1),
    ]
    failed_at = ctypes.c_size_t(0)
    if takes_fail_index:
        args.append(ctypes.byref(failed_at))
    args.append(pointer(stream.cuda_stream))
    result = function(*args)
    if result != _SUCCESS:
        raise RuntimeError(f"cuMemcpyBatchAsync failed (CUresult {result}) on {count} copies")
