"""fp8_gemm: W8A8 GEMM with 128x128 weight-block and per-token-group activation scales."""

import pytest
import torch

from rayinfer.kernels import ops
from rayinfer.kernels.fp8 import fp8_gemm as fp8_gemm_module
from rayinfer.kernels.fp8.fp8_gemm import (
    fp8_gemm,
    fp8_gemm_auto,
    fp8_gemm_backend,
    fp8_gemm_reference,
)
from rayinfer.kernels.fp8.fp8_quant import fp8_quant_reference
from rayinfer.models.fp8 import quantize_block_fp8

SMALL_TILES = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2}
TMA_TILES = {**SMALL_TILES, "USE_TMA": True}
PAIRED_TILES = {**SMALL_TILES, "K_UNROLL": 2}  # two K blocks per loop iteration
PAIRED_TMA_TILES = {**TMA_TILES, "K_UNROLL": 2}
WIDE_TILES = {"BLOCK_M": 16, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 2, "K_UNROLL": 2}
SPLIT_TILES = {**SMALL_TILES, "SPLIT_K": 3}  # K over three programs per tile, partials summed
PAIRED_SPLIT_TILES = {**PAIRED_TILES, "SPLIT_K": 2}


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
        (40, 200, 320, SPLIT_TILES),  # 5 K blocks over 3 splits: 2, 2, 1
        (6, 42, 123, SPLIT_TILES),  # 2 K blocks: the split count shrinks to 2
        (1, 128, 64, SPLIT_TILES),  # one K block: one split
        (40, 200, 320, PAIRED_SPLIT_TILES),  # pairs per split; the last pair's second block past K
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


# ---------------------------------------------------------------- new Triton launch options

WS_TILES = {**TMA_TILES, "WARP_SPECIALIZE": True}  # the K loop as tl.range(warp_specialize=True)
PERSISTENT_TILES = {**TMA_TILES, "PERSISTENT": 1}  # 2 programs under the interpreter
PERSISTENT_FLAT_TILES = {**PERSISTENT_TILES, "FLATTEN": True, "GROUP_M": 1}
PERSISTENT_PAIRED_TILES = {**PERSISTENT_TILES, "K_UNROLL": 2}
PERSISTENT_WS_TILES = {**PERSISTENT_TILES, "WARP_SPECIALIZE": True}


@pytest.mark.parametrize(
    "config",
    [WS_TILES, PERSISTENT_TILES, PERSISTENT_FLAT_TILES, PERSISTENT_PAIRED_TILES,
     PERSISTENT_WS_TILES],
    ids=["ws", "persistent", "persistent_flat", "persistent_paired", "persistent_ws"],
)  # fmt: skip
@pytest.mark.parametrize("m,n,k", [(40, 200, 320), (3, 32, 64), (33, 96, 192)])
def test_fp8_gemm_tma_variants_match_reference(m, n, k, config):
    """Odd tile counts (a program of the persistent loop gets one tile more), edge tiles, one K
    block, and one tile in all."""
    a, a_scale, b, b_scale = _operands(m, n, k, seed=m * n + k)
    out = fp8_gemm(a, a_scale, b, b_scale, torch.float32, config=config)
    expected = fp8_gemm_reference(a, a_scale, b, b_scale, torch.float32)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max())


# ---------------------------------------------------------------- backend choice (ops.fp8_gemm)


@pytest.fixture
def fresh_probes(monkeypatch):
    """An empty probe cache, and probes allowed for CPU tensors."""
    monkeypatch.setattr(fp8_gemm_module, "_PROBED", {})
    monkeypatch.setattr(fp8_gemm_module, "_can_probe", lambda a: True)
    return fp8_gemm_module._PROBED


def _fake_scaled_mm(calls, fail=False):
    """A stand-in for torch._scaled_mm that checks the blockwise layouts and multiplies."""

    def scaled_mm(a, b_t, scale_a, scale_b, out_dtype):
        calls.append((tuple(scale_a.stride()), tuple(scale_b.stride())))
        if fail:
            raise RuntimeError("Invalid scaling configuration.")
        m, k_blocks = scale_a.shape
        assert scale_a.stride() == (1, m) or m == 1, "scale_a must be outer-dim major"
        assert scale_b.shape == (k_blocks, -(-b_t.shape[1] // 128))
        assert scale_b.stride(1) % 4 == 0 and scale_b.stride(0) == 1, "16-byte weight rows"
        return fp8_gemm_reference(a, scale_a, b_t.t(), scale_b.t(), out_dtype)

    return scaled_mm


def test_the_backend_forces_either_side(monkeypatch, fresh_probes):
    from rayinfer.kernels.backends import KernelBackends

    a, _, b, _ = _operands(8, 128, 256, seed=1)
    probe = []
    monkeypatch.setattr(fp8_gemm_module, "probe_blockwise_scaled_mm", lambda *a: probe.append(a))
    assert fp8_gemm_backend(a, b, backend="triton") == "triton"
    assert fp8_gemm_backend(a, b, backend="cublas") == "cublas-blockwise"
    assert not probe and not fresh_probes  # forcing never probes
    expected = r"kernels\.fp8_gemm='cutlass'; use one of auto, triton, cublas"
    with pytest.raises(ValueError, match=expected):
        fp8_gemm_backend(a, b, backend="cutlass")
    with pytest.raises(ValueError, match=expected):
        KernelBackends(fp8_gemm="cutlass")


@pytest.mark.parametrize("supported", [True, False])
def test_auto_probes_once_per_shape_class(monkeypatch, fresh_probes, supported):
    probes = []

    def probe(device, out_dtype, m, n, k):
        probes.append((m, n, k))
        return supported

    monkeypatch.setattr(fp8_gemm_module, "probe_blockwise_scaled_mm", probe)
    want = "cublas-blockwise" if supported else "triton"
    a = torch.empty(4096, 7168, dtype=torch.float8_e4m3fn)
    b = torch.empty(7168, 7168, dtype=torch.float8_e4m3fn)
    assert fp8_gemm_backend(a, b) == want
    assert fp8_gemm_backend(a[:2048], b) == want  # same residues: the cached answer
    assert probes == [(16, 256, 512)]  # tiny: M=16, N=256, K=512 stand for the class
    assert fp8_gemm_backend(a[:4095], b) == want  # another M residue: its own probe
    assert fp8_gemm_backend(a, b, torch.float16) == want  # another out dtype too
    assert len(probes) == 3 and len(fresh_probes) == 3


def test_auto_without_a_probe_picks_triton_and_caches_nothing(monkeypatch):
    """CPU tensors (and CUDA graph capture): no probe, Triton, nothing cached."""
    monkeypatch.setattr(fp8_gemm_module, "_PROBED", {})
    a, _, b, _ = _operands(8, 128, 256, seed=3)
    assert fp8_gemm_backend(a, b) == "triton" and not fp8_gemm_module._PROBED


@pytest.mark.parametrize("m,n,k", [(24, 256, 512), (5, 200, 384), (1, 128, 256)])
def test_auto_runs_scaled_mm_in_its_layouts(monkeypatch, fresh_probes, m, n, k):
    """Row-major activation scales are made outer-dim major; K/128 = 3 weight rows are padded."""
    monkeypatch.setattr(fp8_gemm_module, "probe_blockwise_scaled_mm", lambda *args: True)
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm(calls), raising=False)
    a, a_scale, b, b_scale = _operands(m, n, k, seed=m + k)
    assert a_scale.is_contiguous()  # row-major from the reference quantizer
    out = fp8_gemm_auto(a, a_scale, b, b_scale, torch.float32)
    expected = fp8_gemm_reference(a, a_scale, b, b_scale, torch.float32)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6 * expected.abs().max())
    assert len(calls) == 1


def test_auto_falls_back_to_triton_on_error_and_remembers(monkeypatch, fresh_probes):
    monkeypatch.setattr(fp8_gemm_module, "probe_blockwise_scaled_mm", lambda *args: True)
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm(calls, fail=True), raising=False)
    a, a_scale, b, b_scale = _operands(40, 200, 320, seed=4)
    out = fp8_gemm_auto(a, a_scale, b, b_scale, torch.float32)  # Triton, interpreted
    expected = fp8_gemm_reference(a, a_scale, b, b_scale, torch.float32)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max())
    assert len(calls) == 1 and fp8_gemm_backend(a, b, torch.float32) == "triton"
    fp8_gemm_auto(a, a_scale, b, b_scale, torch.float32)
    assert len(calls) == 1  # not tried again


def test_forced_cublas_raises_its_errors(monkeypatch, fresh_probes):
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm([], fail=True), raising=False)
    a, a_scale, b, b_scale = _operands(8, 128, 256, seed=5)
    with pytest.raises(RuntimeError, match="Invalid scaling"):
        fp8_gemm_auto(a, a_scale, b, b_scale, backend="cublas")


@pytest.mark.parametrize("behaviour", ["right", "wrong", "raises"])
def test_probe_checks_the_product(monkeypatch, behaviour):
    """The probe says yes only when the call runs and matches the float32 reference."""
    fake = _fake_scaled_mm([], fail=behaviour == "raises")
    if behaviour == "wrong":  # e.g. a torch that reads the scales in another layout
        monkeypatch.setattr(torch, "_scaled_mm", lambda *args, **kw: fake(*args, **kw) * 1.5,
                            raising=False)  # fmt: skip
    else:
        monkeypatch.setattr(torch, "_scaled_mm", fake, raising=False)
    ok = fp8_gemm_module.probe_blockwise_scaled_mm(torch.device("cpu"), torch.float32, 17, 272, 640)
    assert ok == (behaviour == "right")


def test_ops_fp8_quant_gives_column_major_scales_and_gemm_takes_them():
    x = torch.randn(6, 384, generator=torch.Generator().manual_seed(6))
    q, scale = ops.fp8_quant(x)
    assert scale.stride() == (1, 6)
    q_row, scale_row = ops.fp8_quant(x, column_major_scales=False)
    assert scale_row.is_contiguous() and torch.equal(scale, scale_row)
    _, _, b, b_scale = _operands(6, 128, 384, seed=6)
    out = ops.fp8_gemm(q, scale, b, b_scale, torch.float32)
    torch.testing.assert_close(out, fp8_gemm_reference(q, scale_row, b, b_scale, torch.float32))


def test_the_gluon_gemm_claims_no_operands_off_hopper():
    """fp8_gemm_hopper (measured, not routed) serves only sm_90 GPUs with K a multiple of 128:
    CPU tensors here."""
    from benchmarks import fp8_gemm_hopper

    a = torch.zeros(4, 256, dtype=torch.float8_e4m3fn)
    b = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    assert not fp8_gemm_hopper.supports(a, b)
