"""benchmarks/compile_moe_kernels.py builds the MoE kernels (the MXFP4 fused MoE's two GEMMs:
tl.dot_scaled, the split kernel with its shift dequantization, the four-lane word kernel with its
table lookup in a register (LUT_REG), also over swapped bit pairs; the FP8 fused MoE's gate+up, the
FP8 block GEMM and the activations' FP8 quantization, on sm_89 and sm_90 only; the bf16 gate+up
GEMM with swiglu_limit; sqrtsoftplus routing) for sm_80, sm_89 and sm_90 on this CPU machine,
within each target's shared memory and without spilled registers; the MXFP4 GEMMs' weight loads are
asynchronous copies feeding tensor-core dots. (In a subprocess: the kernel tests run Triton's
interpreter, which cannot compile.)"""

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


def test_moe_kernels_compile_for_sm80_sm89_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_moe_kernels.py")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [parse(line) for line in run.stdout.splitlines() if line.startswith("kernel=")]
    fp8_kernels = ("fp8_gate_up", "fp8_gate_up_quant_out", "fp8_block_gemm")
    kernels = ("mxfp4_gate_up", "mxfp4_down", "mxfp4_split_asm_gate_up", "mxfp4_split_asm_down",
               "mxfp4_quad_reg_gate_up", "mxfp4_quad_reg_fold_gate_up",
               "mxfp4_quad_reg_fold_down", "mxfp4_quad_swapped_fold_gate_up",
               "mxfp4_quad_swapped_fold_down", *fp8_kernels, "fp8_activation_quant",
               "bf16_gate_up_limit", "routing_sqrtsoftplus")  # fmt: skip
    by_target = {(r["kernel"], r["arch"]): r for r in rows}
    assert set(by_target) == {(k, a) for k in kernels for a in (80, 89, 90)}
    # FP8 e4m3 (W8A8 experts and dense layers) runs on Ada's FP8 mma and Hopper's wgmma; Triton
    # refuses sm_80, which has no FP8 tensor cores (kernels/fp8/fp8_support.py refuses
    # fp8_weights=true there at start). Everything else builds for every target.
    assert sorted((r["kernel"], r["arch"]) for r in rows if not r["builds"]) == sorted(
        (kernel, 80) for kernel in (*fp8_kernels, "fp8_activation_quant")
    )
    for kernel in fp8_kernels:  # "": no nvdisasm to read the SASS with
        assert by_target[(kernel, 89)]["mma"] in ("QMMA", ""), by_target[(kernel, 89)]
        assert by_target[(kernel, 90)]["mma"] in ("QGMMA", ""), by_target[(kernel, 90)]
    rows = [r for r in rows if r["builds"]]
    for row in rows:
        assert row["fits"] and 0 < row["shared_memory_bytes"] <= row["shared_memory_limit"], row
        assert row["spill_instructions"] in (0, None), row  # None: no nvdisasm to count with
        if row["kernel"].startswith("mxfp4"):
            assert row["cp_async"] > 0 and row["tensor_core_dots"] > 0, row
    # The four-lane word kernel issues fewer instructions a weight byte than the byte kernel
    # it replaced, on every target (nvdisasm counts each main loop's SASS), and fewer again
    # over swapped bit pairs (four of its lookup's eighteen instructions a word pair go)
    per_byte = {(r["kernel"], r["arch"]): r.get("instructions_per_byte") for r in rows}
    for arch in (80, 89, 90):
        if per_byte[("mxfp4_split_asm_gate_up", arch)] is not None:
            quad = per_byte[("mxfp4_quad_reg_gate_up", arch)]
            assert quad < per_byte[("mxfp4_split_asm_gate_up", arch)], (arch, per_byte)
            for stage in ("gate_up", "down"):
                swapped = per_byte[(f"mxfp4_quad_swapped_fold_{stage}", arch)]
                assert swapped < per_byte[(f"mxfp4_quad_reg_fold_{stage}", arch)], per_byte
