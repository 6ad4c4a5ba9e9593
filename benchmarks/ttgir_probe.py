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
    python benchmarks/ttgir_probe.py mla ... --dump /tmp/mla.ttgir   # the whole TTGIR

Integer arguments are compiled as multiples of 16, as Triton specializes them at launch when
they are (strides of bf16 rows of 576 or 128 elements are). Without that hint the loads cannot
be vectorized to 16 bytes and none become asynchronous.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayinfer.kernels.triton_compat import triton  # noqa: E402

INDEX_POINTERS = {"block_tables_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr", "kv_lens_ptr"}
FLOAT_POINTERS = {"mid_out_ptr", "mid_lse_ptr"}


def compile_for_sm90(kernel, constants: dict, warps: int, stages: int):
    """The compiled kernel: pointers bf16 (int32 index tensors, float32 partials), other
    non-constant arguments int32 multiples of 16, `scale` float32."""
    from triton.backends.compiler import GPUTarget
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
    target = GPUTarget("cuda", 90, 32)
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
    from rayinfer.kernels.mla_decode_kernels import _mla_decode_split_kernel

    constants = dict(
        LATENT_RANK=512, ROPE_DIM=64, BLOCK_L=512, BLOCK_R=64, BLOCK_H=args.block_h,
        BLOCK_N=args.block_n, BLOCK_SIZE=16, TOKENS_MAJOR=args.layout == "tokens_major",
        DOT_PRECISION="tf32", IS_ONLY_SPLIT=False, USE_TMA=args.tma, WARP_SPECIALIZE=False,
        EVICT_FIRST=False, TABLE_IN_LOOP=args.table_in_loop,
    )  # fmt: skip
    return _mla_decode_split_kernel, constants


def prefill_constants(args) -> tuple:
    from rayinfer.kernels.prefill_attention_kernel import _prefill_attention_kernel

    constants = dict(
        HEAD_DIM0=128, HEAD_DIM1=0, HEAD_DIM_V=128, BLOCK_D0=128, BLOCK_D1=16, BLOCK_DV=128,
        BLOCK_M=args.block_m, BLOCK_N=args.block_n, BLOCK_SIZE=16, IS_PAGED=False,
        IS_CAUSAL=True, DOT_PRECISION="tf32", USE_TMA=args.tma, PIPELINE_QK=False,
        HEADS_FASTEST=True, WARP_SPECIALIZE=False, CONDITIONAL_RESCALE=False,
    )  # fmt: skip
    return _prefill_attention_kernel, constants


KERNELS = {"mla": mla_constants, "prefill": prefill_constants}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=list(KERNELS))
    parser.add_argument("--block-n", type=int, default=32)
    parser.add_argument("--block-h", type=int, default=16, help="mla: heads per program")
    parser.add_argument("--block-m", type=int, default=128, help="prefill: query rows")
    parser.add_argument("--layout", default="tokens_major", choices=["tokens_major", "heads_major"])
    parser.add_argument("--table-in-loop", action="store_true", help="mla: TABLE_IN_LOOP")
    parser.add_argument("--tma", action="store_true")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--dump", help="write the whole TTGIR here")
    args = parser.parse_args(argv)
    kernel, constants = KERNELS[args.kernel](args)
    compiled = compile_for_sm90(kernel, constants, args.warps, args.stages)
    ttgir = compiled.asm["ttgir"]
    if args.dump:
        Path(args.dump).write_text(ttgir)
    report = dict(shared_memory_bytes=compiled.metadata.shared, **loop_report(ttgir))
    for key, value in report.items():
        print(f"{key:22s} {value}")
    return report


if __name__ == "__main__":
    main()
