"""Which kernel runs where several serve one op: `KernelBackends`, handed to `ops` by the layers
that call it (set on a built model by layers/kernel_backends.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PREFILL_ATTENTION_BACKENDS = ("auto", "triton")
MLA_DECODE_BACKENDS = ("auto", "triton")
FP8_GEMM_BACKENDS = ("auto", "triton", "cublas")


@dataclass(frozen=True)
class KernelBackends:
    """prefill_attention: "auto" (the tuned config's backend, a Gluon kernel where one is
    tuned) or "triton" (pins the Triton kernel; kernels/attention/prefill_attention.py).
    mla_decode: "auto" or "triton" (the tuned entries' Triton fallback tiles instead of the
    Gluon kernel; kernels/mla/mla_decode.py).
    fp8_gemm: "auto" (cuBLAS's blockwise _scaled_mm where a probe of the shape class passed,
    else Triton), "triton" or "cublas" (kernels/fp8/fp8_gemm.py).
    fused_routing: MoE routing in one launch on CUDA (kernels/moe/moe_routing_kernel.py; the same
    experts as torch, weights within 1e-7 on an H200); False: the torch reference.
    small_batch_moe: the fused MoE of a few slots in two launches (kernels/moe/fused_moe_small.py;
    correct on an H200, not yet faster there than the general path, hence off)."""

    # The Serve app's config (pydantic) validates this dataclass field by field and forbids
    # unknown keys; __post_init__ checks it either way.
    __pydantic_config__ = {"extra": "forbid"}

    prefill_attention: Literal[PREFILL_ATTENTION_BACKENDS] = "auto"
    mla_decode: Literal[MLA_DECODE_BACKENDS] = "auto"
    fp8_gemm: Literal[FP8_GEMM_BACKENDS] = "auto"
    fused_routing: bool = True
    small_batch_moe: bool = False

    def __post_init__(self):
        for key, allowed in (
            ("prefill_attention", PREFILL_ATTENTION_BACKENDS),
            ("mla_decode", MLA_DECODE_BACKENDS),
            ("fp8_gemm", FP8_GEMM_BACKENDS),
            ("fused_routing", (True, False)),
            ("small_batch_moe", (False, True)),
        ):
            value = getattr(self, key)
            if not any(value is c or (type(value) is str and value == c) for c in allowed):
                raise ValueError(
                    f"kernels.{key}={value!r}; use one of {', '.join(map(str, allowed))}"
                )


DEFAULT_BACKENDS = KernelBackends()
