"""Triton's Gluon dialect (explicit layouts, mbarriers, TMA and wgmma, warp specialization) for
the Hopper kernels (`*_hopper.py`), when the installed Triton ships it; HAS_GLUON False otherwise
(no Triton, or an older one): those modules then define no kernels and their `supports` says no.

The TMA copies were renamed between Triton 3.6 (the GPU machine's) and 3.9 (CI's);
`tma_load` / `tma_store` are whichever this Triton has.
"""

from __future__ import annotations

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
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    HAS_GLUON = True
except ImportError:  # placeholders: the Hopper modules touch them only when HAS_GLUON
    HAS_GLUON = False
    gluon = gl = mbarrier = tma = TensorDescriptor = None
    fence_async_shared = warpgroup_mma = warpgroup_mma_wait = tma_load = tma_store = None

__all__ = [
    "HAS_GLUON", "TensorDescriptor", "fence_async_shared", "gl", "gluon", "mbarrier", "tma",
    "tma_load", "tma_store", "warpgroup_mma", "warpgroup_mma_wait",
]  # fmt: skip
