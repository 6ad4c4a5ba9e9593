"""Whether the MoE kernels of DeepSeek-V4 build for Ampere (sm_80), Ada (sm_89) and Hopper
(sm_90), without a GPU: compiles each with Triton's compiler for that target on this machine and
reports the shared memory a program needs against the target's per-block limit, the registers
per thread, the spilled ones and what the main loop became (asynchronous copies, tensor-core
dots, synchronous loads left in the loop).

    python benchmarks/compile_moe_kernels.py                 # every kernel, every target
    python benchmarks/compile_moe_kernels.py --arch 90 --kernel mxfp4_gate_up --dump /tmp/k.ttgir

Kernels: the MXFP4 fused MoE's two GEMMs (gate+up with swiglu_limit, down) with the launcher's
plain tl.dot_scaled kernel (16 x 64 x 128 tiles) and as the split kernel with the inline-asm
dequantization (which the interpreter cannot run) and the launcher's default tile (a GPU without an
entry in configs/fused_moe_mxfp4.json gets it), the four-lane word kernel with its lookup table in
a register, also over swapped bit pairs, the bf16 grouped GEMM with swiglu_limit, and the
one-launch routing kernel with sqrtsoftplus scores (256 experts, top-6). Integer arguments are
compiled as multiples of 16, as Triton specializes them at launch."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compile_dsa_kernels import SHARED_MEMORY_LIMITS, compile_for  # noqa: E402
from ttgir_probe import (  # noqa: E402
    default_jobs,
    disassemble,
    longest_loop_opcodes,
    loop_report,
    registers_per_thread,
    reports_in_order,
    spill_instructions,
)

from rayinfer.kernels.fp8.fp8_gemm import DEFAULT_CONFIG as FP8_GEMM_CONFIG  # noqa: E402
from rayinfer.kernels.fp8.fp8_gemm_kernels import _fp8_block_gemm_kernel  # noqa: E402
from rayinfer.kernels.fp8.fp8_quant import _fp8_quant_kernel  # noqa: E402
from rayinfer.kernels.moe import fused_moe_mxfp4  # noqa: E402
from rayinfer.kernels.moe.fused_moe import DEFAULT_CONFIG  # noqa: E402
from rayinfer.kernels.moe.fused_moe_kernels import _moe_gemm_kernel  # noqa: E402
from rayinfer.kernels.moe.fused_moe_mxfp4_kernel import (  # noqa: E402
    _moe_mxfp4_gemm_kernel,
    _moe_mxfp4_split_kernel,
)
from rayinfer.kernels.moe.fused_moe_mxfp4_quad import moe_mxfp4_quad_kernel  # noqa: E402
from rayinfer.kernels.moe.moe_routing_kernel import _moe_routing_kernel  # noqa: E402

GEMM_POINTERS = dict(topk_weights_ptr="*fp32", sorted_slot_ids_ptr="*i32",
                     block_expert_ids_ptr="*i32", num_padded_ptr="*i32")  # fmt: skip


DOT_SCALED_TILE = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
                   "num_stages": 4}  # fmt: skip


def mxfp4_gemm(arch: int, is_w13: bool, tile: dict | None = None):
    """The tl.dot_scaled kernel (the one the interpreter tests run)."""
    tile = dict(tile or DOT_SCALED_TILE)
    warps, stages = tile.pop("num_warps"), tile.pop("num_stages")
    types = dict(a_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", c_ptr="*bf16", **GEMM_POINTERS)
    constants = dict(SLOTS_PER_A_ROW=6 if is_w13 else 1, FUSE_SILU=is_w13, MUL_WEIGHT=not is_w13,
                     FORMAT="bf16", EVEN_K=True, USE_LIMIT=is_w13, LIMIT=10.0, **tile)  # fmt: skip
    return compile_for(_moe_mxfp4_gemm_kernel, types, constants, arch, warps, stages)


def mxfp4_split_asm(arch: int, is_w13: bool):
    """The split kernel with its inline-asm bf16 dequantization (GPU-only: the interpreter
    runs no PTX), with the launcher's default tile."""
    tile = {k: v for k, v in fused_moe_mxfp4.DEFAULT_TILE.items() if k not in ("SPLIT", "ASM")}
    warps, stages = tile.pop("num_warps"), tile.pop("num_stages")
    types = dict(a_ptr="*bf16", w_ptr="*u8", s_ptr="*u8", c_ptr="*bf16", **GEMM_POINTERS)
    constants = dict(SLOTS_PER_A_ROW=6 if is_w13 else 1, FUSE_SILU=is_w13, MUL_WEIGHT=not is_w13,
                     USE_ASM=True, EVEN_K=True, USE_LIMIT=is_w13, LIMIT=10.0, **tile)  # fmt: skip
    return compile_for(_moe_mxfp4_split_kernel, types, constants, arch, warps, stages)


def mxfp4_quad(arch: int, is_w13: bool, fold: bool = False, lut_reg: bool = False,
               swapped: bool = False):  # fmt: skip
    """The quad-lane kernel (16-bit words) with its inline-asm lookup, the default tile; lut_reg:
    the lookup's table in a register (the lanemask form); swapped: over bytes whose bit pairs
    come swapped (`swap_bit_pairs`)."""
    tile = {k: v for k, v in fused_moe_mxfp4.DEFAULT_TILE.items() if k not in ("SPLIT", "ASM")}
    warps, stages = tile.pop("num_warps"), tile.pop("num_stages")
    types = dict(a_ptr="*bf16", w_ptr="*i16", s_ptr="*u8", c_ptr="*bf16", **GEMM_POINTERS)
    constants = dict(SLOTS_PER_A_ROW=6 if is_w13 else 1, FUSE_SILU=is_w13, MUL_WEIGHT=not is_w13,
                     USE_ASM=True, FOLD=fold, LUT_REG=lut_reg, SWAPPED=swapped, EVEN_K=True,
                     USE_LIMIT=is_w13,
                     LIMIT=10.0, **tile)  # fmt: skip
    return compile_for(moe_mxfp4_quad_kernel, types, constants, arch, warps, stages)


def moe_gate_up(arch: int, fp8: bool, quant_out: bool = False):
    """The fused MoE's gate+up GEMM: over FP8 block-scaled experts and activations (W8A8,
    DeepSeek-V3's top-8), or bf16 with DeepSeek-V4's swiglu_limit (top-6); quant_out: FP8,
    writing the down GEMM's FP8 activations and scales itself (128-column tiles; 8 warps, as
    4 spilled 36 instructions on sm_90)."""
    tile = dict(DEFAULT_CONFIG["w13"]) | (dict(BLOCK_N=128, num_warps=8) if quant_out else {})
    warps, stages = tile.pop("num_warps"), tile.pop("num_stages")
    data, scale = ("*fp8e4nv", "*fp32") if fp8 else ("*bf16", "*bf16")
    types = dict(a_ptr=data, b_ptr=data, c_ptr="*fp8e4nv" if quant_out else "*bf16",
                 c_scale_ptr="*fp32", a_scale_ptr=scale, b_scale_ptr=scale,
                 **GEMM_POINTERS)  # fmt: skip
    constants = dict(SLOTS_PER_A_ROW=8 if fp8 else 6, FUSE_SILU=True, MUL_WEIGHT=False,
                     USE_FP8=fp8, SCALE_BLOCK=128, EVEN_K=True, USE_TMA=False,
                     DOT_PRECISION="tf32", USE_LIMIT=not fp8, LIMIT=0.0 if fp8 else 10.0,
                     ONE_B_SCALE=fp8, QUANT_OUT=quant_out, ACT_DTYPE="bf16", **tile)  # fmt: skip
    return compile_for(_moe_gemm_kernel, types, constants, arch, warps, stages)


def fp8_block_gemm(arch: int):
    """The dense layers' Triton FP8 GEMM with 128-block scales (ops.fp8_gemm's own kernel)."""
    tile = dict(FP8_GEMM_CONFIG)
    warps, stages = tile.pop("num_warps"), tile.pop("num_stages")
    types = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr="*bf16", a_scale_ptr="*fp32",
                 b_scale_ptr="*fp32")  # fmt: skip
    constants = dict(SCALE_BLOCK=128, EVEN_K=True, K_UNROLL=1, **tile)
    return compile_for(_fp8_block_gemm_kernel, types, constants, arch, warps, stages)


def fp8_activation_quant(arch: int):
    """fp8_quant's kernel (16 rows x 128 channels a program): every FP8 GEMM's
    activations."""
    types = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", scale_ptr="*fp32")
    constants = dict(GROUP_SIZE=128, BLOCK_ROWS=16, FP8_MAX=448.0, MIN_SCALE=1e-10)
    return compile_for(_fp8_quant_kernel, types, constants, arch, 4, 1)


def sqrtsoftplus_routing(arch: int):
    types = dict(logits_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i64",
                 scaling="fp32")  # fmt: skip
    constants = dict(TOP_K=6, SCORING="sqrtsoftplus", HAS_BIAS=True, RENORMALIZE=True,
                     NUM_GROUPS=1, TOPK_GROUPS=1, GROUP_SIZE=256, BLOCK_E=256, BLOCK_G=1,
                     BLOCK_K=8)  # fmt: skip
    return compile_for(_moe_routing_kernel, types, constants, arch, 4, 1)


def _tensor_core_opcodes(cubin: bytes) -> str:
    """The kernel's tensor-core instructions in SASS (HMMA: bf16/fp16 mma; QMMA: Ada's FP8 mma;
    HGMMA / QGMMA: Hopper's wgmma), comma-joined; "" without nvdisasm."""
    sass = disassemble(cubin) or ""
    return ",".join(sorted(set(re.findall(r"\b([HQ]G?MMA)\.", sass))))


def _sass_loop(kernel: str, cubin: bytes) -> dict:
    """For the split GEMMs: the SASS instructions each thread issues per K step, and per
    packed weight byte (two values) it dequantizes there; the dequantization's share."""
    split = kernel.startswith(("mxfp4_split", "mxfp4_quad"))
    opcodes = longest_loop_opcodes(cubin) if split else None
    if not opcodes:
        return {}
    tile = fused_moe_mxfp4.DEFAULT_TILE
    parts = 2 if kernel.endswith("gate_up") else 1  # gate and up rows
    threads = 32 * tile["num_warps"]
    bytes_per_thread = parts * tile["BLOCK_N"] * tile["BLOCK_K"] // 2 // threads
    total = sum(opcodes.values())
    return dict(loop_instructions=total,
                instructions_per_byte=round(total / bytes_per_thread, 2),
                loop_top=",".join(f"{op}:{n}" for op, n in opcodes.most_common(6)))  # fmt: skip


KERNELS = {
    "mxfp4_gate_up": lambda arch: mxfp4_gemm(arch, True),
    "mxfp4_down": lambda arch: mxfp4_gemm(arch, False),
    "mxfp4_split_asm_gate_up": lambda arch: mxfp4_split_asm(arch, True),
    "mxfp4_split_asm_down": lambda arch: mxfp4_split_asm(arch, False),
    "mxfp4_quad_reg_gate_up": lambda arch: mxfp4_quad(arch, True, lut_reg=True),
    "mxfp4_quad_reg_fold_gate_up": lambda arch: mxfp4_quad(arch, True, True, True),
    "mxfp4_quad_reg_fold_down": lambda arch: mxfp4_quad(arch, False, True, True),
    "mxfp4_quad_swapped_fold_gate_up": lambda arch: mxfp4_quad(arch, True, True, True, True),
    "mxfp4_quad_swapped_fold_down": lambda arch: mxfp4_quad(arch, False, True, True, True),
    "fp8_gate_up": lambda arch: moe_gate_up(arch, fp8=True),
    "fp8_gate_up_quant_out": lambda arch: moe_gate_up(arch, fp8=True, quant_out=True),
    "fp8_block_gemm": fp8_block_gemm,
    "fp8_activation_quant": fp8_activation_quant,
    "bf16_gate_up_limit": lambda arch: moe_gate_up(arch, fp8=False),
    "routing_sqrtsoftplus": sqrtsoftplus_routing,
}


def report(kernel: str, arch: int, dump: str | None = None) -> dict:
    try:
        compiled = KERNELS[kernel](arch)
    except Exception as refused:  # noqa: BLE001 - FP8 e4m3 below sm_89: Triton refuses it
        if "not supported in this architecture" not in str(refused):
            raise
        return dict(kernel=kernel, arch=arch, builds=False, reason=type(refused).__name__)
    if dump:
        Path(dump).write_text(compiled.asm["ttgir"])
    cubin, shared = compiled.asm["cubin"], compiled.metadata.shared
    loop = loop_report(compiled.asm["ttgir"])
    return dict(
        kernel=kernel, arch=arch, builds=True, mma=_tensor_core_opcodes(cubin),
        shared_memory_bytes=shared,
        shared_memory_limit=SHARED_MEMORY_LIMITS[arch], fits=shared <= SHARED_MEMORY_LIMITS[arch],
        registers=registers_per_thread(cubin), spill_instructions=spill_instructions(cubin),
        tensor_core_dots=loop["wgmma"] + loop["mma_sync_dots"], cp_async=loop["cp_async"],
        sync_loads_in_loops=loop["sync_loads_in_loops"], **_sass_loop(kernel, cubin),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=list(KERNELS), action="append")
    parser.add_argument("--arch", type=int, choices=[80, 89, 90], action="append")
    parser.add_argument("--dump", help="write the (last) kernel's TTGIR here")
    parser.add_argument("--jobs", type=int, default=default_jobs(), help="compiles at once")
    args = parser.parse_args(argv)
    cases = [
        (kernel, arch, args.dump)
        for kernel in args.kernel or list(KERNELS)
        for arch in args.arch or [80, 89, 90]
    ]
    rows = []
    for row in reports_in_order(report, cases, args.jobs):
        rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


if __name__ == "__main__":
    main()
