"""What Triton makes of a kernel for an H100/H200 (sm_90), without a GPU: compiles it for that
target on this machine (Triton ships ptxas) and reports what its main loop became.

GPU time is scarce; this answers first whether a kernel variant can work at all: whether the
loop's loads are asynchronous copies (cp.async or TMA) that the pipeliner issues ahead, how many
copies stay in flight (`async_wait num`), whether a synchronous global load (`tt.load`) is left
inside the loop, which dots became wgmma (`warp_group_dot`) or mma.sync (`tt.dot`), and the
shared memory a program needs (two programs fit per SM up to ~113 KiB on an H200).

    python benchmarks/ttgir_probe.py mla --block-n 32 --warps 4 --stages 3
    python benchmarks/ttgir_probe.py mla --layout heads_major --table-in-loop
    python benchmarks/ttgir_probe.py prefill --block-n 64 --warps 8 --stages 3 --tma
    python benchmarks/ttgir_probe.py prefill --tma --store-lse --non-causal   # a context block
    python benchmarks/ttgir_probe.py prefill-ws   # prefill_attention_hopper's Gluon kernel
    python benchmarks/ttgir_probe.py prefill-ws-mla   # the same at MLA's 192/128 head dims
    python benchmarks/ttgir_probe.py fp8-ws   # fp8_gemm_hopper's Gluon GEMM
    python benchmarks/ttgir_probe.py mla-ws   # mla_decode_hopper's Gluon split kernel
    python benchmarks/ttgir_probe.py mla ... --dump /tmp/mla.ttgir   # the whole TTGIR

Besides the loop's ops it reports registers per thread (the cubin's EIATTR_REGCOUNT, what
ptxas -v prints) and the SASS's spill instructions (STL/LDL, through the nvdisasm Triton ships),
which together with the shared memory say how many programs fit per SM.

Integer arguments are compiled as multiples of 16, as Triton specializes them at launch when
they are (strides of bf16 rows of 576 or 128 elements are). Without that hint the loads cannot
be vectorized to 16 bytes and none become asynchronous.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import struct
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayinfer.kernels.triton_compat import triton  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
except ImportError:  # no Triton: nothing here can run
    GPUTarget = None

INDEX_POINTERS = {"block_tables_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr", "kv_lens_ptr"}
FLOAT_POINTERS = {"mid_out_ptr", "mid_lse_ptr", "lse_ptr"}


def compile_for_sm90(kernel, constants: dict, warps: int, stages: int, capability: int = 90):
    """The compiled kernel: pointers bf16 (int32 index tensors, float32 partials), other
    non-constant arguments int32 multiples of 16, `scale` float32; for sm_90, or the given
    compute capability (80: an A100, no TMA)."""
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {}
    for name in names:
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = (
                "*i32" if name in INDEX_POINTERS else "*fp32" if name in FLOAT_POINTERS else "*bf16"
            )
        else:
            signature[name] = "fp32" if name == "scale" else "i32"
    hinted = {
        (index,): [["tt.divisibility", 16]]
        for index, name in enumerate(names)
        if signature[name] not in ("constexpr", "fp32")
    }
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(name),): value for name, value in constants.items()},
        attrs=hinted,
    )
    target = GPUTarget("cuda", capability, 32)
    return triton.compile(source, target=target, options=dict(num_warps=warps, num_stages=stages))


def loop_report(ttgir: str) -> dict:
    """Counts over the whole module and over its loops (from the first scf.for on)."""
    loops = ttgir[ttgir.find("scf.for") :] if "scf.for" in ttgir else ""
    waits = [int(n) for n in re.findall(r"async_wait[^{]*\{num = (\d+)", loops)]
    return dict(
        wgmma=len(re.findall(r"ttng\.warp_group_dot ", ttgir)),
        mma_sync_dots=len(re.findall(r"tt\.dot ", ttgir)),
        cp_async=len(re.findall(r"async_copy_global_to_local", ttgir)),
        tma_copies=len(re.findall(r"async_tma_copy_global_to_local", ttgir)),
        sync_loads_in_loops=len(re.findall(r"tt\.load ", loops)),
        async_wait_num=waits,
        layout_conversions=len(re.findall(r"ttg\.convert_layout", ttgir)),
    )


def mla_constants(args) -> tuple:
    from rayinfer.kernels.mla.mla_decode_kernels import _mla_decode_split_kernel

    constants = dict(
        LATENT_RANK=512, ROPE_DIM=64, BLOCK_L=512, BLOCK_R=64, BLOCK_H=args.block_h,
        BLOCK_N=args.block_n, BLOCK_SIZE=16, TOKENS_MAJOR=args.layout == "tokens_major",
        DOT_PRECISION="tf32", IS_ONLY_SPLIT=False, USE_TMA=args.tma, WARP_SPECIALIZE=False,
        EVICT_FIRST=False, TABLE_IN_LOOP=args.table_in_loop,
    )  # fmt: skip
    return _mla_decode_split_kernel, constants


def prefill_constants(args) -> tuple:
    from rayinfer.kernels.attention.prefill_attention_kernel import _prefill_attention_kernel

    constants = dict(
        HEAD_DIM0=128, HEAD_DIM1=0, HEAD_DIM_V=128, BLOCK_D0=128, BLOCK_D1=16, BLOCK_DV=128,
        BLOCK_M=args.block_m, BLOCK_N=args.block_n, BLOCK_SIZE=16, IS_PAGED=False,
        IS_CAUSAL=not args.non_causal, DOT_PRECISION="tf32", USE_TMA=args.tma,
        PIPELINE_QK=False, HEADS_FASTEST=True, WARP_SPECIALIZE=False, CONDITIONAL_RESCALE=False,
        STORE_LSE=args.store_lse,
    )  # fmt: skip
    return _prefill_attention_kernel, constants


def _descriptor_type(rows: int, cols: int, dtype: str = "bf16") -> str:
    """The signature type of a Gluon TMA descriptor of [rows, cols] boxes (default layout)."""
    from triton.experimental.gluon import language as gl

    element = {"bf16": gl.bfloat16, "fp8e4nv": gl.float8e4nv}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for([rows, cols], element)
    return f"tensordesc<{dtype}[{rows},{cols}],{layout!r}>"


def _compile_gluon_for_sm90(kernel, types: dict, constants: dict, aligned, launch_registers):
    """A Gluon kernel compiled for sm_90a as its launcher runs it: `types` the signature of its
    non-integer arguments (the rest are i32), `aligned` those hinted multiples of 16, 4 warps
    by default and the module's launch register budget."""
    from triton.experimental.gluon._runtime import GluonASTSource

    names = kernel.arg_names
    signature = {name: types.get(name, "constexpr" if name in constants else "i32")
                 for name in names}  # fmt: skip
    hinted = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    fixed = {(names.index(name),): value for name, value in constants.items()}
    source = GluonASTSource(kernel, signature, fixed, hinted)
    options = dict(num_warps=4, maxnreg=launch_registers)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_prefill_ws_for_sm90(rope: bool = False):
    """prefill_attention_hopper's warp-specialized Gluon kernel, as `prefill_attention_ws`
    launches it (bf16 TMA descriptors, its register budget); rope: MLA's 192/128 head dims."""
    from rayinfer.kernels.attention import prefill_attention_hopper as ws

    extra = ws.ROPE_DIM if rope else ws.HEAD_DIM
    types = dict(
        q_desc=_descriptor_type(ws.HALF_M, ws.HEAD_DIM),
        q1_desc=_descriptor_type(ws.HALF_M, extra),
        k_desc=_descriptor_type(ws.BLOCK_N, ws.HEAD_DIM),
        k1_desc=_descriptor_type(ws.BLOCK_N, extra),
        v_desc=_descriptor_type(ws.BLOCK_N, ws.HEAD_DIM), out_ptr="*bf16",
        cu_seqlens_q_ptr="*i32", cu_seqlens_k_ptr="*i32", qk_scale="fp32",
    )  # fmt: skip
    aligned = ("out_ptr", "cu_seqlens_q_ptr", "cu_seqlens_k_ptr", "q_head_stride",
               "k_head_stride", "v_head_stride", "stride_ot", "stride_oh")  # fmt: skip
    return _compile_gluon_for_sm90(ws._prefill_attention_ws_kernel, types, dict(HAS_ROPE=rope),
                                   aligned, ws.LAUNCH_REGISTERS)  # fmt: skip


def compile_fp8_ws_for_sm90():
    """fp8_gemm_hopper's warp-specialized Gluon GEMM, as `fp8_gemm_ws` launches it."""
    from benchmarks import fp8_gemm_hopper as ws

    types = dict(
        a_desc=_descriptor_type(ws.HALF_M, ws.SCALE_BLOCK, "fp8e4nv"),
        b_desc=_descriptor_type(ws.BLOCK_N, ws.SCALE_BLOCK, "fp8e4nv"),
        c_desc=_descriptor_type(ws.HALF_M, ws.BLOCK_N), a_scale_ptr="*fp32", b_scale_ptr="*fp32",
    )  # fmt: skip
    aligned = ("a_scale_ptr", "b_scale_ptr", "n", "k", "stride_ak")
    return _compile_gluon_for_sm90(ws._fp8_gemm_ws_kernel, types, dict(GROUP=ws.GROUP_M),
                                   aligned, ws.LAUNCH_REGISTERS)  # fmt: skip


def compile_mla_ws_for_sm90(tokens_major: bool = False, block_h: int = 16):
    """mla_decode_hopper's warp-specialized Gluon split kernel, as `mla_decode_ws_launch`
    launches it (partial outputs in float32); tokens_major: its one-consumer form over block_h
    heads, else the heads-major form over 64-row query tiles."""
    from rayinfer.kernels.mla import mla_decode_hopper as ws

    head_rows = block_h if tokens_major else ws.HEAD_ROWS
    types = dict(
        ql_desc=_descriptor_type(head_rows, ws.HALF_L),
        qp_desc=_descriptor_type(head_rows, ws.ROPE_DIM),
        kc_desc=_descriptor_type(ws.BLOCK_SIZE, ws.HALF_L),
        kp_desc=_descriptor_type(ws.BLOCK_SIZE, ws.ROPE_DIM),
        out_ptr="*fp32", lse_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32",
        qk_scale="fp32",
    )  # fmt: skip
    aligned = ("out_ptr", "lse_ptr", "block_tables_ptr", "seq_lens_ptr", "stride_table",
               "stride_ob", "stride_oh", "stride_os")  # fmt: skip
    constants = dict(IS_ONLY_SPLIT=False, TOKENS_MAJOR=tokens_major)
    return _compile_gluon_for_sm90(ws._mla_decode_ws_kernel, types, constants, aligned,
                                   ws.LAUNCH_REGISTERS)  # fmt: skip


def compile_sparse_mla_ws_for_sm90(tokens_major: bool = False, block_h: int = 16):
    """sparse_mla_hopper's warp-specialized Gluon split kernel (cp.async gathering producer
    warpgroup), as `sparse_mla_ws_launch` launches it; tokens_major as for the dense one."""
    from rayinfer.kernels.dsa import sparse_mla_hopper as ws

    head_rows = block_h if tokens_major else ws.HEAD_ROWS
    types = dict(q_latent_ptr="*bf16", q_pe_ptr="*bf16", cache_ptr="*bf16", slots_ptr="*i32",
                 out_ptr="*fp32", lse_ptr="*fp32", qk_scale="fp32")  # fmt: skip
    aligned = ("q_latent_ptr", "q_pe_ptr", "cache_ptr", "slots_ptr", "out_ptr", "lse_ptr",
               "stride_ql", "stride_qp", "stride_row", "stride_ot", "stride_oh",
               "stride_os")  # fmt: skip
    constants = dict(HEAD_ROWS_C=head_rows, IS_ONLY_SPLIT=False, TOKENS_MAJOR=tokens_major)
    return _compile_gluon_for_sm90(ws._sparse_mla_ws_kernel, types, constants, aligned,
                                   ws.LAUNCH_REGISTERS)  # fmt: skip


GLUON_KERNELS = {
    "prefill-ws": compile_prefill_ws_for_sm90,
    "prefill-ws-mla": lambda: compile_prefill_ws_for_sm90(rope=True),
    "fp8-ws": compile_fp8_ws_for_sm90,
    "mla-ws": compile_mla_ws_for_sm90,
    "mla-ws-tokens": lambda: compile_mla_ws_for_sm90(tokens_major=True),
    "sparse-mla-ws": compile_sparse_mla_ws_for_sm90,
    "sparse-mla-ws-tokens": lambda: compile_sparse_mla_ws_for_sm90(tokens_major=True),
}


def registers_per_thread(cubin: bytes) -> int | None:
    """EIATTR_REGCOUNT (0x2f) of the cubin's .nv.info sections: what ptxas -v reports."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [
        struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entry_size) for i in range(count)
    ]
    names_offset = headers[names_index][4]
    for name_at, _, _, _, offset, size, *_ in headers:
        name = cubin[names_offset + name_at : cubin.index(b"\0", names_offset + name_at)]
        if not name.startswith(b".nv.info"):
            continue
        at = offset
        while at + 4 <= offset + size:
            fmt, attribute = cubin[at], cubin[at + 1]
            if fmt == 4:  # a sized value
                length = struct.unpack_from("<H", cubin, at + 2)[0]
                if attribute == 0x2F:
                    return struct.unpack_from("<II", cubin, at + 4)[1]
                at += 4 + length
            else:
                at += 2 if fmt == 1 else 4
    return None


def disassemble(cubin: bytes) -> str | None:
    """The SASS text, from the nvdisasm Triton ships (None without it)."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not nvdisasm.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as file:
        file.write(cubin)
    try:
        run = subprocess.run([str(nvdisasm), "-c", file.name], capture_output=True, text=True)
        return run.stdout
    finally:
        os.unlink(file.name)


def spill_instructions(cubin: bytes) -> int | None:
    """Local-memory loads and stores (STL/LDL) in the SASS."""
    sass = disassemble(cubin)
    return None if sass is None else len(re.findall(r"\b(?:STL|LDL)\b", sass))


_SASS_LINE = re.compile(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*;")
_LABEL = re.compile(r"^\.(L_x_\d+):")


def longest_loop_opcodes(cubin: bytes) -> Counter | None:
    """Opcodes (without modifiers) of the SASS's longest backward branch's body, once each: a
    GEMM's main loop, what each thread issues per K step."""
    sass = disassemble(cubin)
    if sass is None:
        return None
    lines, labels, pending = [], {}, []
    for text in sass.splitlines():
        if label := _LABEL.match(text.strip()):
            pending.append(label.group(1))
        elif line := _SASS_LINE.search(text):
            address = int(line.group(1), 16)
            labels.update({name: address for name in pending})
            pending = []
            lines.append((address, line.group(2), text))
    best: list = []
    for address, opcode, text in lines:
        target = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", text)
        if opcode == "BRA" and target and labels.get(target.group(1), address) < address:
            body = [op for at, op, _ in lines if labels[target.group(1)] <= at <= address]
            best = max(best, body, key=len)
    return Counter(best)


KERNELS = {"mla": mla_constants, "prefill": prefill_constants}


def default_jobs() -> int:
    """Compiles run at once by default: one per core, at most 4 (Triton's compiler is single-
    threaded, and each holds a few hundred MB)."""
    return max(1, min(4, os.cpu_count() or 1))


def _report(call: tuple):
    report, case = call
    return report(*case)


def reports_in_order(report, cases: list[tuple], jobs: int):
    """report(*case) for each case, in the cases' order, over `jobs` forked processes (one: in
    this process). Forked, so the children see the parent's module state (e.g. overrides)."""
    if jobs <= 1:
        yield from (report(*case) for case in cases)
        return
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        yield from pool.map(_report, [(report, case) for case in cases])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=[*KERNELS, *GLUON_KERNELS])
    parser.add_argument("--block-n", type=int, default=32)
    parser.add_argument("--block-h", type=int, default=16, help="mla: heads per program")
    parser.add_argument("--block-m", type=int, default=128, help="prefill: query rows")
    parser.add_argument("--layout", default="tokens_major", choices=["tokens_major", "heads_major"])
    parser.add_argument("--table-in-loop", action="store_true", help="mla: TABLE_IN_LOOP")
    parser.add_argument("--tma", action="store_true")
    parser.add_argument("--store-lse", action="store_true", help="prefill: STORE_LSE")
    parser.add_argument("--non-causal", action="store_true", help="prefill: IS_CAUSAL False")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--sm", type=int, default=90, help="compute capability (Triton kernels)")
    parser.add_argument("--dump", help="write the whole TTGIR here")
    args = parser.parse_args(argv)
    if args.kernel in GLUON_KERNELS:  # Gluon: tiles, warps and registers are its module's
        compiled = GLUON_KERNELS[args.kernel]()
    else:
        kernel, constants = KERNELS[args.kernel](args)
        compiled = compile_for_sm90(kernel, constants, args.warps, args.stages, args.sm)
    ttgir = compiled.asm["ttgir"]
    if args.dump:
        Path(args.dump).write_text(ttgir)
    cubin = compiled.asm["cubin"]
    report = dict(
        shared_memory_bytes=compiled.metadata.shared,
        registers=registers_per_thread(cubin),
        spill_instructions=spill_instructions(cubin),
        **loop_report(ttgir),
    )
    for key, value in report.items():
        print(f"{key:22s} {value}")
    return report


if __name__ == "__main__":
    main()
