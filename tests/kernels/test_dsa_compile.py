"""benchmarks/compile_dsa_kernels.py builds the DSA kernels (and DeepSeek-V4's) for Ampere
(sm_80), Ada (sm_89) and Hopper (sm_90; the FP8 index key kernels sm_89 and sm_90, bf16) on this
CPU machine with the tiles their launchers pick there, within each target's shared memory and
without spilled registers. (In a subprocess: the kernel tests run Triton's interpreter, which
cannot compile.)"""

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def parse(line: str) -> dict:
    row = {}
    for item in line.split():
        key, _, value = item.partition("=")
        try:
            row[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            row[key] = value
    return row


def test_dsa_kernels_compile_for_sm80_sm89_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = ["--arch", "80", "--arch", "89", "--arch", "90", "--dtype", "bf16", "--dtype", "fp32"]
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_dsa_kernels.py"), *argv],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [parse(line) for line in run.stdout.splitlines() if line.startswith("kernel=")]
    built = {(r["kernel"], r["arch"], r["dtype"]) for r in rows}
    kernels = ("sparse_mla", "sparse_mla_combine", "dsa_index_scores")
    v4_kernels = ("v4_index_scores", "v4_attention_listed", "v4_attention_every")  # bf16 only
    v4_kernels += ("dsa_topk_histogram", "dsa_topk_count", "dsa_topk_write")  # float32 scores
    fp8_kernels = ("dsa_index_scores_fp8", "dsa_write_cache_fp8")  # fp8e4nv: sm_89 and later
    expected = {(k, a, d) for k in kernels for a in (80, 89, 90) for d in ("bf16", "fp32")}
    expected |= {(k, a, "bf16") for k in v4_kernels for a in (80, 89, 90)}
    expected |= {(k, a, "bf16") for k in fp8_kernels for a in (89, 90)}  # a bf16/fp16 format
    assert built == expected
    for row in rows:
        assert row["fits"] and 0 < row["shared_memory_bytes"] <= row["shared_memory_limit"], row
        assert row["spill_instructions"] in (0, None), row  # None: no nvdisasm to count with
