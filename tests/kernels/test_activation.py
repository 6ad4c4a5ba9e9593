"""SiLU-and-multiply (Triton, interpreter on CPU) against the reference."""

import pytest
import torch

from rayinfer.kernels.elementwise.activation import silu_and_mul, silu_and_mul_reference

TOLERANCES = {torch.float32: 1e-6, torch.float16: 1e-3}


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize(
    "shape", [(1, 2), (6, 246), (3, 2, 2 * 1500)], ids=["one-token", "odd", "3d-two-blocks"]
)
def test_matches_reference(shape, dtype):
    x = (3 * torch.randn(shape, generator=torch.Generator().manual_seed(0))).to(dtype)
    ours = silu_and_mul(x)
    assert ours.shape == (*shape[:-1], shape[-1] // 2) and ours.dtype == dtype
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(ours, silu_and_mul_reference(x), atol=tol, rtol=tol)


def test_odd_width_is_rejected():
    with pytest.raises(ValueError, match="must be even"):
        silu_and_mul(torch.randn(2, 7))
