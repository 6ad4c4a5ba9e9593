"""`triton` and `triton.language` when Triton is installed; otherwise placeholders that let the
kernel modules import (their `@triton.jit` functions are never launched without Triton: ops.py
uses the torch references then). Triton is in the `gpu` and `test` extras, not a base dependency.
"""

from __future__ import annotations

import types

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    HAS_TRITON = True
except ImportError:  # a CPU-only install: kernels are defined but never launched
    HAS_TRITON = False

    def _unavailable(*args, **kwargs):
        raise RuntimeError("Triton is not installed: pip install 'rayinfer[gpu]'")

    def _identity_decorator(fn=None, **kwargs):
        if fn is None:
            return lambda inner: inner
        return fn

    triton = types.SimpleNamespace(
        jit=_identity_decorator,
        autotune=lambda *args, **kwargs: _identity_decorator,
        heuristics=lambda *args, **kwargs: _identity_decorator,
        Config=lambda *args, **kwargs: None,
        cdiv=lambda a, b: -(-a // b),
        next_power_of_2=lambda n: 1 << max(0, int(n) - 1).bit_length(),
        testing=types.SimpleNamespace(do_bench=_unavailable),
    )

    class _Constexpr:
        """Stands for tl.constexpr both as an annotation and as a module constant."""

        def __init__(self, value=None):
            self.value = value

    tl = types.SimpleNamespace(constexpr=_Constexpr, dtype=object, tensor=object)
    TensorDescriptor = types.SimpleNamespace(from_tensor=_unavailable)

# A TMA copy names its box by int32 coordinates, and cuTensorMapEncodeTiled takes byte strides
# below 2**40: a descriptor over more rows than that cannot reach the last ones.
TMA_MAX_ROWS = 2**31 - 1
TMA_MAX_STRIDE_BYTES = 2**40 - 1


def tma_rows_fit(num_rows: int, row_stride_bytes: int) -> bool:
    """Whether a 2-D TMA descriptor over num_rows rows, row_stride_bytes apart, addresses all of
    them (row coordinates in int32, the stride within the descriptor's 40 bits); where not,
    the callers take pointer loads, whose offsets are int64."""
    return num_rows <= TMA_MAX_ROWS and row_stride_bytes <= TMA_MAX_STRIDE_BYTES
