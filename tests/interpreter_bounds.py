"""Bounds checks for Triton kernels run by the interpreter: every load, store and atomic a kernel
issues (its mask's lanes) must fall inside the storage of one of the launch's tensor arguments.

On a GPU an access past its tensor reads another allocation's bytes or faults as an illegal
memory access, often far from the faulting kernel; in the interpreter it reads host memory, which
now and then is unmapped and kills the whole test session with a segmentation fault. Here it
fails the test that launched the kernel, naming the kernel, the operation and how far out of
bounds the first stray lane was.

`install()` patches triton.runtime.interpreter; tests/conftest.py calls it when the interpreter
is on.
"""

from __future__ import annotations

import inspect
import traceback

import numpy as np

_launches: list[tuple[str, np.ndarray, np.ndarray]] = []  # (kernel, starts, ends), innermost last
# Kernels that reach memory through addresses computed from a table rather than through their
# tensor arguments, which this check cannot bound: the reason for each.
ADDRESS_TABLE_KERNELS = {
    "_cache_rows_kernel": "every layer's cache at an int64 offset from layer 0's address",
}


class OutOfBounds(IndexError):
    pass


def _storage_ranges(args) -> list[tuple[int, int]]:
    from triton.runtime.interpreter import _unwrap_tensor
    from triton.tools.tensor_descriptor import TensorDescriptor

    ranges = []
    for arg in args:
        if isinstance(arg, tuple):
            ranges += _storage_ranges(arg)
        elif isinstance(arg, TensorDescriptor):
            ranges += _storage_ranges([arg.base])
        elif hasattr(arg, "data_ptr") and hasattr(arg, "untyped_storage"):
            storage = _unwrap_tensor(arg).untyped_storage()
            if storage.device.type != "cpu":  # the interpreter runs on a host copy: unbounded
                return [(0, 2**64 - 1)]
            ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return ranges


def _check(ptrs, mask, what: str) -> None:
    if not _launches:
        return
    kernel, starts, ends = _launches[-1]
    addresses = np.asarray(ptrs.data, dtype=np.uint64)
    if mask is not None:
        addresses = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)]
    else:
        addresses = addresses.reshape(-1)
    if addresses.size == 0:
        return
    width = max(ptrs.get_element_ty().primitive_bitwidth // 8, 1)
    owner = np.searchsorted(starts, addresses, side="right") - 1
    inside = (owner >= 0) & (addresses + np.uint64(width) <= ends[np.maximum(owner, 0)])
    if not inside.all():
        stray = int(addresses[~inside][0])
        nearest = min(
            (max(int(s) - stray, stray + width - int(e), 0), stray - int(s), int(e) - int(s))
            for s, e in zip(starts, ends)
        )  # (bytes outside, offset from the start, size) of the argument it misses least
        raise OutOfBounds(
            f"{kernel} ({_kernel_line()}): {what} of {int((~inside).sum())} lane(s) outside "
            f"every tensor argument; the first at byte {nearest[1]} of the nearest argument, "
            f"whose storage holds {nearest[2]} bytes"
        )


def _kernel_line() -> str:
    """file:line of the innermost frame outside Triton and this module: the kernel's line."""
    for frame in reversed(traceback.extract_stack()):
        if "/triton/" not in frame.filename and not frame.filename.endswith(__name__ + ".py"):
            return f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
    return "?"


def install() -> None:
    """Patch the interpreter's launches and memory operations (once per process)."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_rayinfer_bounds", False):
        return
    interpreter._rayinfer_bounds = True
    builder = type(interpreter.interpreter_builder)
    launch = interpreter.GridExecutor.__call__

    def checked_launch(self, *args, **kwargs):
        ranges = sorted(_storage_ranges([*args, *kwargs.values()]))
        starts = np.array([s for s, _ in ranges], dtype=np.uint64)
        ends = np.array([e for _, e in ranges], dtype=np.uint64)
        name = getattr(self.fn, "__name__", "kernel")
        if name in ADDRESS_TABLE_KERNELS:
            starts, ends = np.zeros(1, dtype=np.uint64), np.full(1, 2**64 - 1, dtype=np.uint64)
        _launches.append((name, starts, ends))
        try:
            return launch(self, *args, **kwargs)
        finally:
            _launches.pop()

    def wrap(name, pointers, mask, what):
        original = getattr(builder, name)
        signature = inspect.signature(original)

        def checked(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs).arguments
            _check(bound[pointers], bound[mask] if mask else None, what)
            return original(self, *args, **kwargs)

        setattr(builder, name, checked)

    interpreter.GridExecutor.__call__ = checked_launch
    wrap("create_masked_load", "ptrs", "mask", "a load")
    wrap("create_masked_store", "ptrs", "mask", "a store")
    wrap("create_atomic_rmw", "ptr", "mask", "an atomic")
    wrap("create_atomic_cas", "ptr", None, "an atomic compare-and-swap")
