"""FP8 e4m3 per-token payload: the round-trip error stays inside the bound fp8.py documents."""

import pytest
import torch

from rayinfer.comm.fp8 import dequantize, error_bound, quantize_per_token

CASES = {
    "normal": lambda g: torch.randn(64, 7168, generator=g),
    "five-decades": lambda g: torch.randn(16, 640, generator=g) * torch.logspace(-3, 2, 640),
    "single-token": lambda g: torch.randn(1, 128, generator=g),
    "odd-width": lambda g: torch.randn(6, 123, generator=g) * 1e3,
    "zero-row": lambda g: torch.cat([torch.zeros(1, 32), torch.randn(3, 32, generator=g)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_error_within_bound(case, dtype):
    x = CASES[case](torch.Generator().manual_seed(0)).to(dtype)
    q = quantize_per_token(x)
    assert q.values.dtype == torch.float8_e4m3fn and q.scales.shape == (x.shape[0],)
    y = dequantize(q, dtype)
    assert y.dtype == dtype and y.shape == x.shape
    assert bool(((y.float() - x.float()).abs() <= error_bound(x)).all())


def test_measured_error_matches_the_docstring():
    """fp8.py quotes the mean and max relative error on normal rows; keep the quote honest."""
    x = torch.randn(256, 7168, generator=torch.Generator().manual_seed(1))
    y = dequantize(quantize_per_token(x), torch.float32)
    scale = x.abs().amax(1, keepdim=True)
    big = x.abs() > 0.1 * scale
    rel = ((y - x).abs() / x.abs())[big]
    assert 0.015 < rel.mean().item() < 0.035
    assert rel.max().item() <= 2**-4 + 1e-6
