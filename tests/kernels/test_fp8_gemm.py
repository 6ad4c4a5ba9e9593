"""fp8_gemm: W8A8 GEMM with 128x128 weight-block and per-token-group activation scales."""

import pytest
import torch

from rayinfer.kernels.fp8_gemm import fp8_gemm, fp8_gemm_reference
from rayinfer.kernels.fp8_quant import fp8_quant_reference
from rayinfer.models.fp8 import quantize_block_fp8

SMALL_TILES = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2}
TMA_TILES = {**SMALL_TILES, "USE_TMA": True}
PAIRED_TILES = {**SMALL_TILES, "K_UNROLL": 2}  # two K blocks per loop iteration
PAIRED_TMA_TILES = {**TMA_TILES, "K_UNROLL": 2}
WIDE_TILES = {"BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 2, "K_UNROLL": 2}


def _operands(m, n, k, seed):
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=generator)
    b = torch.randn(n, k, generator=generator) * 0.05
    return (*fp8_quant_reference(a), *quantize_block_fp8(b))


@pytest.mark.parametrize("out_dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize(
    "m,n,k,config",
    [
        (32, 256, 256, None),  # the default tiles
        (6, 42, 123, SMALL_TILES),  # odd sizes, K not a multiple of the tile
        (1, 128, 384, SMALL_TILES),  # one token
        (40, 200, 300, SMALL_TILES),  # partial scale blocks in N and K
        (40, 200, 320, TMA_TILES),  # TMA tiles, zero-padded at the M and N edges
        (6, 42, 123, TMA_TILES),  # K rows not 16-byte aligned: falls back to pointer loads
        (40, 200, 320, PAIRED_TILES),  # 5 K blocks: the last pair's second block is past K
        (40, 200, 256, PAIRED_TILES),  # 4 K blocks: pairs without masks
        (6, 42, 123, PAIRED_TILES),  # odd sizes, paired
        (40, 200, 320, PAIRED_TMA_TILES),  # TMA reads zeros past K for the odd block
        (9, 300, 384, WIDE_TILES),  # a tile spans several 128-column weight blocks
    ],
)
def test_fp8_gemm_matches_reference(m, n, k, config, out_dtype, tol):
    a, a_scale, b, b_scale = _operands(m, n, k, seed=m + n + k)
    out = fp8_gemm(a, a_scale, b, b_scale, out_dtype, config=config)
    expected = fp8_gemm_reference(a, a_scale, b, b_scale, torch.float32)
    assert out.dtype == out_dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max())


def test_fp8_gemm_names_the_bad_scale():
    a, a_scale, b, b_scale = _operands(4, 128, 256, seed=0)
    with pytest.raises(ValueError, match="b_scale"):
        fp8_gemm(a, a_scale, b, b_scale.t().contiguous().repeat(1, 2))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm(a.float(), a_scale, b, b_scale)


def test_fp8_gemm_reads_column_major_activation_scales():
    a, a_scale, b, b_scale = _operands(24, 256, 384, seed=5)
    transposed = a_scale.t().contiguous().t()  # same values, strides (1, M)
    expected = fp8_gemm_reference(a, a_scale, b, b_scale, torch.float32)
    for config in (SMALL_TILES, TMA_TILES, PAIRED_TILES):
        out = fp8_gemm(a, transposed, b, b_scale, torch.float32, config=config)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max())
