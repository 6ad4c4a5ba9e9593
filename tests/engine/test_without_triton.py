"""Triton is an extra (`gpu`, `test`), not a base dependency: without it rayinfer imports, runs
on the CPU references and builds the Serve app."""

import subprocess
import sys

BLOCK_TRITON = """
import sys

class BlockTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton is not installed (blocked by the test)")

sys.meta_path.insert(0, BlockTriton())
import rayinfer
import rayinfer.app
from rayinfer.kernels import triton_compat
assert not triton_compat.HAS_TRITON
llm = rayinfer.LLM("tiny", device="cpu")
print(len(llm.generate([[5, 6, 7]], rayinfer.SamplingParams(max_tokens=3))[0].token_ids))
"""


def test_rayinfer_runs_without_triton():
    result = subprocess.run(
        [sys.executable, "-c", BLOCK_TRITON], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "3"
