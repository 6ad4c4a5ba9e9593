"""Triton's Gluon dialect (explicit layouts, mbarriers, TMA and wgmma, warp specialization) for
the Hopper kernels (`*_hopper.py`), when the installed Triton ships it; HAS_GLUON False otherwise
(no Triton, or an older one): those modules then define no kernels and their `supports` says no.

The TMA copies, cp.async's copy and the thread barrier were renamed between Triton 3.6 (the GPU
machine's) and 3.9 (CI's); `tma_load` / `tma_store` / `async_load` / `thread_barrier` are
whichever this Triton has.
`rows_descriptor` builds the host TMA descriptors the kernels take.

Gluon is experimental and its API moves between Triton releases, so a kernel that builds with
the Triton the GPU machine has may not build with a user's. The callers run a Gluon kernel only
while `gluon_enabled(name)`, and report a build failure (`GLUON_BUILD_ERRORS`) with
`gluon_failed(name, error)`: a warning, once, and the Triton kernel from then on.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    thread_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # 3.6 | 3.9 name
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _async_copy

    # cp.async into shared memory (pointer gathers): async_load | 3.6's name
    async_load = getattr(_async_copy, "async_load", None)
    async_load = async_load or _async_copy.async_copy_global_to_shared
    async_commit_group, async_wait_group = _async_copy.commit_group, _async_copy.wait_group
    HAS_GLUON = True
except (ImportError, AttributeError):  # placeholders: the Hopper modules use them only when
    HAS_GLUON = False  # HAS_GLUON
    gluon = gl = mbarrier = tma = TensorDescriptor = None
    fence_async_shared = warpgroup_mma = warpgroup_mma_wait = tma_load = tma_store = None
    async_load = async_commit_group = async_wait_group = None
    thread_barrier = None

try:  # what a kernel that does not build (or fit) with this Triton raises
    from triton.errors import TritonError

    GLUON_BUILD_ERRORS: tuple = (TritonError,)
except ImportError:
    GLUON_BUILD_ERRORS = ()

__all__ = [
    "GLUON_BUILD_ERRORS", "HAS_GLUON", "TensorDescriptor", "async_commit_group", "async_load",
    "async_wait_group", "fence_async_shared", "gl",
    "gluon", "gluon_enabled", "gluon_failed", "mbarrier", "rows_descriptor", "thread_barrier",
    "tma", "tma_load", "tma_store", "warpgroup_mma", "warpgroup_mma_wait",
]  # fmt: skip

_FAILED: set[str] = set()  # kernels whose Gluon form failed to build in this process


def gluon_enabled(kernel: str) -> bool:
    """Whether `kernel`'s Gluon form may run: this Triton has Gluon and it has not failed here."""
    return HAS_GLUON and kernel not in _FAILED


def gluon_failed(kernel: str, error: Exception) -> None:
    """`kernel`'s Gluon form failed to build: a warning naming the error, and its Triton form
    from now on (in this process)."""
    _FAILED.add(kernel)
    logger.warning("%s: the Gluon kernel did not build with Triton %s (%s: %s); the Triton "
                   "kernel runs instead", kernel, triton.__version__, type(error).__name__,
                   str(error).splitlines()[0] if str(error) else "")  # fmt: skip


@functools.cache
def _shared_layout(block_rows: int, block_cols: int, dtype: torch.dtype):
    element = {torch.bfloat16: gl.bfloat16, torch.float8_e4m3fn: gl.float8e4nv}[dtype]
    return gl.NVMMASharedLayout.get_default_for([block_rows, block_cols], element)


def rows_descriptor(t: torch.Tensor, num_rows: int, row_len: int, row_stride: int,
                    block_rows: int, block_cols: int):  # fmt: skip
    """A 2-D TMA descriptor over num_rows rows of row_len elements, row_stride apart, from t's
    first element (a [tokens, heads, dim] view read at column head * head stride, a flat cache,
    a matrix), in [block_rows, block_cols] boxes with the default swizzled layout."""
    layout = _shared_layout(block_rows, block_cols, t.dtype)
    return TensorDescriptor(t, [num_rows, row_len], [row_stride, 1], [block_rows, block_cols],
                            layout)  # fmt: skip
