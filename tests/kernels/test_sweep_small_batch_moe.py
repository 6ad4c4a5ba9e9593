"""The small-batch MoE GPU sweep's logic, run end to end in its --smoke mode (interpreter, fp32)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_checks_times_and_writes_a_config_entry(tmp_path):
    out = tmp_path / "small_moe.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = ROOT / "benchmarks" / "sweep_small_batch_moe.py"
    run = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [row["tokens"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert row["best_error"] < 1e-5 and row["general_error"] < 1e-5
        assert len(row["gate_up"]) == len(row["down"]) == 2  # every tile of the grid ran
    entry = result["config_entry"]["cpu"]["H=64,I=48"]["1"]
    assert set(entry) == {"gate_up", "down"}
    assert "| shape | tokens |" in run.stdout
