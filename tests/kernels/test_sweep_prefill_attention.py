"""The GPU sweep script's logic, run end to end in its --smoke mode (interpreter, tiny fp32)."""

import json

from tests.benchmark_scripts import load_benchmark


def test_smoke_run_writes_checked_rows_and_a_config_snippet(tmp_path):
    out = tmp_path / "sweep.json"
    # A budget this small runs each stage's first variant and skips the rest.
    sweep = load_benchmark("sweep_prefill_attention")
    assert sweep.main(["--smoke", "--budget-s", "0.5", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    first = result["sweep_128"][0]
    assert first["check"]["ok"] and len(first["timings"]) == 2
    assert all("skipped" in row for row in result["sweep_128"][1:])
    assert result["sweep_192"][0]["check"]["ok"]
    buckets = result["config_snippet"]["cpu"]["default"]
    assert set(buckets) == {"128", "192"} and buckets["128"]["BLOCK_N"] == 16
    assert result["table"] and all(row["tflops"] > 0 for row in result["table"])


def test_best_ignores_wrong_failed_and_skipped_variants():
    sweep = load_benchmark("sweep_prefill_attention")
    timed = [dict(ms=ms, tokens=n) for ms, n in ((2.0, 8), (4.0, 16))]
    rows = [
        dict(name="wrong", check=dict(ok=False), timings=[dict(ms=0.1, tokens=8)] * 2),
        dict(name="failed", error="OutOfResources", out_of_resources=True),
        dict(name="skipped", skipped="time budget"),
        dict(name="slow", check=dict(ok=True), timings=[{**t, "ms": 2 * t["ms"]} for t in timed]),
        dict(name="fast", check=dict(ok=True), timings=timed),
    ]
    assert sweep.best_of(rows, [8, 16])["name"] == "fast"
    assert sweep.best_of(rows[:3], [8, 16]) is None
