"""The GPU-only scripts of the Gluon kernels import and keep their cases consistent with the
kernels' contracts (they run on an H100/H200 only, so CI cannot execute them)."""

import pytest

from benchmarks import fp8_gemm_hopper
from rayinfer.kernels.mla import mla_decode_hopper
from tests.benchmark_scripts import load_benchmark


@pytest.mark.parametrize("name", ["gluon_prefill_attention", "gluon_fp8_gemm", "gluon_mla_decode"])
def test_the_gpu_scripts_import(name):
    assert callable(load_benchmark(name).main)


def test_the_mla_script_times_whole_tiles_and_checks_the_padding_row():
    script = load_benchmark("gluon_mla_decode")
    tile = mla_decode_hopper.BLOCK_SIZE * mla_decode_hopper.TILE_BLOCKS
    assert script.GLUON["BLOCK_N"] == tile and script.SPLITS["min_tokens_per_split"] % tile == 0
    assert any(0 in seq_lens for _, seq_lens, _ in script.CHECKS)


def test_the_fp8_script_checks_shapes_the_kernel_claims():
    script = load_benchmark("gluon_fp8_gemm")
    assert all(k % fp8_gemm_hopper.SCALE_BLOCK == 0 and n % 8 == 0 for _, n, k in script.CHECKS)
