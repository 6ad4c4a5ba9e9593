"""Triton's Gluon dialect (explicit layouts, mbarriers, TMA and wgmma, warp specialization) for
the Hopper kernels (`*_hopper.py`), when the installed Triton ships it; HAS_GLUON False otherwise
(no Triton, or an older one): those modules then define no kernels and their `supports` says no.

The TMA copies and the thread barrier were renamed between Triton 3.6 (the GPU machine's) and
3.9 (CI's); `tma_load` / `tma_store` / `thread_barrier` are whichever this Triton has.
`rows_descriptor` builds the host TMA descriptors the kernels take.
"""

from __future__ import annotations

import functools

import torch

try:
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
    HAS_GLUON = True
except ImportError:  # placeholders: the Hopper modules touch them only when HAS_GLUON
    HAS_GLUON = False
    gluon = gl = mbarrier = tma = TensorDescriptor = None
    fence_async_shared = warpgroup_mma = warpgroup_mma_wait = tma_load = tma_store = None
    thread_barrier = None

__all__ = [
    "HAS_GLUON", "TensorDescriptor", "fence_async_shared", "gl", "gluon", "mbarrier",
    "rows_descriptor", "thread_barrier", "tma", "tma_load", "tma_store", "warpgroup_mma",
    "warpgroup_mma_wait",
]  # fmt: skip


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
