"""benchmarks/sweep_fp8_gemm.py end to end in its --smoke mode (CPU, interpreter, tiny shapes)."""

import json

from tests.benchmark_scripts import load_benchmark


def test_smoke_run_checks_rows_and_writes_a_config_snippet(tmp_path):
    out = tmp_path / "fp8_sweep.json"
    # A budget this small runs the shipped tiles of each problem and skips the other variants.
    sweep = load_benchmark("sweep_fp8_gemm")
    assert sweep.main(["--smoke", "--budget-s", "0.01", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(row["M"], row["N"], row["K"]) for row in result["rows"]] == [
        (40, 256, 384),
        (8, 256, 384),
    ]
    for row in result["rows"]:
        assert row["triton"]["shipped"]["ok"] and row["triton"]["shipped"]["ms"] > 0
        assert row["torch"]["ops.fp8_gemm"]["ok"]
        assert "error" in row["torch"]["blockwise"]  # CPU torch has no blockwise _scaled_mm
        assert row["skipped"] and row["best_triton"] == "shipped"
    snippet = result["configs"]["fp8_gemm.json"]["cpu"]["N=256,K=384"]
    assert set(snippet) == {"40", "8"} and snippet["40"]["BLOCK_K"] == 64
