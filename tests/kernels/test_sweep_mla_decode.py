"""The MLA decode GPU sweep's logic, run end to end in its --smoke mode (interpreter, tiny fp32)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_times_configs_stages_and_writes_a_config_entry(tmp_path):
    out = tmp_path / "mla_sweep.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = ROOT / "benchmarks" / "sweep_mla_decode.py"
    run = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(out)], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert all(r["ok"] and r["timings"] for r in result["results"])
    assert any(r["params"].get("USE_TMA") for r in result["results"])
    buckets = result["config_entry"]["cpu"]["default"]
    assert set(buckets) == {"4", "20"}
    for rows in result["stages"].values():  # split kernel and combine timed apart
        assert all(row["split_ms"] > 0 and row["splits"] >= 1 for row in rows.values())
    assert "| heads | B x ctx |" in run.stdout
