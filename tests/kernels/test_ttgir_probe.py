"""benchmarks/ttgir_probe.py compiles the attention kernels for sm_90 on this CPU machine and
reports their loops: the loads asynchronous, the dots tensor-core ones, the shared memory used.
(In a subprocess: the kernel tests run Triton's interpreter, which cannot compile.)"""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def probe(argv: list[str], dump: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ttgir_probe.py"), *argv, "--dump", str(dump)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    report = {}
    for line in run.stdout.splitlines():
        key, _, value = line.partition(" ")
        report[key] = ast.literal_eval(value.strip())
    return report


@pytest.mark.parametrize(
    "argv",
    [
        ["mla", "--block-n", "32", "--warps", "4", "--stages", "3"],
        ["mla", "--layout", "heads_major", "--table-in-loop", "--stages", "5"],
        ["prefill", "--block-n", "64", "--warps", "8", "--tma"],
    ],
    ids=["mla-tokens-major", "mla-heads-major-table-in-loop", "prefill-tma"],
)
def test_the_kernels_compile_for_sm90_with_asynchronous_loads(argv, tmp_path):
    dump = tmp_path / "kernel.ttgir"
    report = probe(argv, dump)
    assert 0 < report["shared_memory_bytes"] <= 227 * 1024  # fits an H100/H200 SM
    assert report["cp_async"] + report["tma_copies"] > 0
    assert report["wgmma"] + report["mma_sync_dots"] >= 2  # scores and output
    assert "scf.for" in dump.read_text()


@pytest.mark.parametrize(
    "argv",
    [
        ["prefill", "--tma", "--store-lse", "--non-causal"],
        ["prefill", "--store-lse", "--non-causal", "--sm", "80"],
        ["prefill", "--store-lse", "--sm", "80"],
        ["mla", "--layout", "heads_major", "--sm", "80"],
    ],
    ids=["context-block-sm90-tma", "context-block-sm80", "causal-lse-sm80", "mla-decode-sm80"],
)
def test_the_long_context_kernels_compile_for_sm80_and_sm90(argv, tmp_path):
    """The prefill kernel with its log-sum-exp output, over a context block (every key visible)
    or causal, and the MLA decode with int64 row bases, for an H100/H200 and an A100."""
    report = probe(argv, tmp_path / "kernel.ttgir")
    assert 0 < report["shared_memory_bytes"] <= 227 * 1024
    assert report["wgmma"] + report["mma_sync_dots"] >= 2


def test_the_warp_specialized_prefill_compiles_for_sm90_without_spills(tmp_path):
    """prefill_attention_hopper's Gluon kernel (the H200's 128 bucket): its partitions, TMA
    loads and wgmma products survive this Triton's compiler, within an SM's shared memory and
    with no spilled registers (the consumers' budget is 240 per thread)."""
    dump = tmp_path / "kernel.ttgir"
    report = probe(["prefill-ws"], dump)
    assert 0 < report["shared_memory_bytes"] <= 227 * 1024
    assert report["spill_instructions"] in (0, None)  # None: no nvdisasm to count with
    assert report["tma_copies"] >= 4  # Q halves, K, V
    assert report["wgmma"] >= 4  # QK^T and PV, in the first tile and the loop
    assert "ttg.warp_specialize" in dump.read_text()


@pytest.mark.parametrize(
    "kernel,spills",
    [("prefill-ws-mla", 0), ("fp8-ws", 0), ("mla-ws", 40), ("mla-ws-tokens", 0)],
)
def test_the_other_gluon_kernels_compile_for_sm90(kernel, spills, tmp_path):
    """MLA's 192/128 prefill, the FP8 block-scaled GEMM (measured, not routed: see
    fp8_gemm_hopper) and both forms of the MLA decode split kernel stay compilable by this
    Triton, within an SM; the heads-major decode kernel's producer warp spills a few scalars (14
    spill instructions with Triton 3.6, outside the consumers' loop)."""
    dump = tmp_path / "kernel.ttgir"
    report = probe([kernel], dump)
    assert 0 < report["shared_memory_bytes"] <= 227 * 1024
    assert report["spill_instructions"] is None or report["spill_instructions"] <= spills
    assert report["wgmma"] >= 1 and report["tma_copies"] >= 2
    assert "ttg.warp_specialize" in dump.read_text()


@pytest.mark.parametrize("kernel", ["sparse-mla-ws", "sparse-mla-ws-tokens"])
def test_the_gluon_sparse_mla_kernel_compiles_for_sm90(kernel, tmp_path):
    """Both forms of the sparse MLA split kernel (the dense one's consumers, a cp.async gathering
    producer warpgroup): within an SM's shared memory, no spills, the gathers as cp.async."""
    dump = tmp_path / "kernel.ttgir"
    report = probe([kernel], dump)
    assert 0 < report["shared_memory_bytes"] <= 227 * 1024
    assert report["spill_instructions"] in (0, None)
    assert report["wgmma"] >= 3 and report["cp_async"] >= 6 and report["tma_copies"] == 0
    assert "ttg.warp_specialize" in dump.read_text()
