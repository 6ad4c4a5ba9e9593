"""RMSNorm with the fused residual add (Triton, interpreter on CPU) against the reference."""

import pytest
import torch

from rayinfer.kernels.elementwise.rms_norm import rms_norm, rms_norm_reference

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("shape", [(1, 64), (6, 123), (3, 4, 24)], ids=["one-token", "odd", "3d"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_reference(shape, dtype, with_residual):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=generator)).to(dtype)
    residual = torch.randn(shape, generator=generator).to(dtype) if with_residual else None
    ours = rms_norm(x, weight, 1e-6, residual)
    expected = rms_norm_reference(x, weight, 1e-6, residual)
    if not with_residual:
        ours, expected = (ours,), (expected,)
    tol = TOLERANCES[dtype]
    for mine, theirs in zip(ours, expected, strict=True):
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
        torch.testing.assert_close(mine, theirs, atol=tol, rtol=tol)


@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.float16])
def test_mixed_dtypes_sum_in_the_promoted_dtype(residual_dtype):
    """An fp16 x with an fp32 residual returns what the reference does:
    the residual stream keeps fp32, the normed row takes the promoted dtype."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 48, generator=generator).half()
    residual = 100 * torch.randn(4, 48, generator=generator).to(residual_dtype)
    weight = torch.randn(48, generator=generator)
    ours = rms_norm(x, weight, 1e-6, residual)
    expected = rms_norm_reference(x, weight, 1e-6, residual)
    for mine, theirs in zip(ours, expected, strict=True):
        assert mine.dtype == theirs.dtype
        torch.testing.assert_close(mine, theirs, atol=2e-3, rtol=2e-3)


def test_strided_input_is_normed_row_by_row():
    x = torch.randn(5, 2, 32)[:, 1]  # rows 64 elements apart
    weight = torch.randn(32)
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))


def test_wrong_weight_names_the_shape():
    with pytest.raises(ValueError, match=r"weight \(16,\) must be \[32\]"):
        rms_norm(torch.randn(2, 32), torch.ones(16), 1e-6)
