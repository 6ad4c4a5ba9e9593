"""MoE router logits from 16-bit activations (kernels/moe/router_logits), in the interpreter."""

import pytest
import torch

from rayinfer.kernels import ops
from rayinfer.kernels.moe.router_logits import (
    MIN_TOKENS,
    router_logits,
    router_logits_reference,
    uses_kernel,
)


@pytest.mark.parametrize("tokens,hidden,experts", [(300, 96, 10), (70, 128, 64), (5, 40, 3)])
def test_logits_match_float64(tokens, hidden, experts):
    """fp16 activations (the interpreter's 16-bit type) against a float64 product: the three
    weight pieces keep the float32 weight to ~1e-6 of its magnitude (bf16 exactly, on a GPU)."""
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=generator).half()
    weight = torch.randn(experts, hidden, generator=generator) * 0.02
    out = router_logits(x, weight)
    exact = x.double() @ weight.double().t()
    assert out.dtype == torch.float32 and out.shape == (tokens, experts)
    assert ((out.double() - exact).abs().max() / exact.abs().max()).item() < 3e-6


def test_ops_routes_by_device_dtype_and_size():
    """On the CPU ops takes torch's float32 GEMM; the kernel serves 16-bit prefill batches."""
    x = torch.randn(8, 16).bfloat16()
    weight = torch.randn(4, 16)
    torch.testing.assert_close(ops.router_logits(x, weight), x.float() @ weight.t())
    assert not uses_kernel(x)  # a decode-sized batch: the torch path's copy is small
    assert uses_kernel(torch.empty(MIN_TOKENS, 16, dtype=torch.bfloat16))
    assert not uses_kernel(torch.empty(MIN_TOKENS, 16))  # float32 needs no conversion


def test_bad_operands_are_named():
    weight = torch.randn(4, 16)
    with pytest.raises(ValueError, match="bf16/fp16"):
        router_logits(torch.randn(3, 16), weight)
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        router_logits(torch.randn(3, 8).half(), weight)
    torch.testing.assert_close(
        router_logits_reference(torch.ones(1, 16), weight), weight.sum(1)[None]
    )
