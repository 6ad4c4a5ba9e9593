"""Whether the DSA kernels (and DeepSeek-V4's, which build on them) build for Ampere (sm_80),
Ada (sm_89) and Hopper (sm_90), without a GPU: compiles each with Triton's compiler for that
target on this machine, with the tiles its launcher picks on a GPU that has no entry of its own
(configs' "default") at GLM-5's shapes (64 heads, latent 512, rope 64; indexer 32 heads x 128,
cache rows 704 wide, blocks of 64) and V4-Flash's (64 heads sharing one 512-wide key; indexer
64 heads x 128 over entries of 4 tokens), and reports the shared memory a program needs against
the target's per-block limit, the registers per thread and the spilled ones.

    python benchmarks/compile_dsa_kernels.py            # every kernel, every target (the FP8
                                                        # key kernels: sm_89 and sm_90)
    python benchmarks/compile_dsa_kernels.py --arch 89 --kernel sparse_mla
    python benchmarks/compile_dsa_kernels.py --kernel sparse_mla --arch 90 \
        --params '{"BLOCK_H": 64, "BLOCK_N": 16, "num_warps": 8}'
                                                        # a sweep candidate's tiles instead

The integer arguments are compiled as multiples of 16, as Triton specializes them at launch when
they are (every stride and size at these shapes is).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from ttgir_probe import (  # noqa: E402
    default_jobs,
    loop_report,
    registers_per_thread,
    reports_in_order,
    spill_instructions,
)

from rayinfer.kernels.dsa import (  # noqa: E402
    dsa_cache,
    dsa_indexer,
    radix_topk,
    sparse_mla,
    v4_attention,
)
from rayinfer.kernels.mla.mla_decode_kernels import _mla_combine_kernel  # noqa: E402
from rayinfer.kernels.tile_configs import pick_tile_config  # noqa: E402
from rayinfer.kernels.triton_compat import triton  # noqa: E402

# Shared memory one program may use (the opt-in maximum per block), in bytes.
SHARED_MEMORY_LIMITS = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
HEADS, LATENT_RANK, ROPE_DIM = 64, 512, 64
INDEX_HEADS, INDEX_DIM, BLOCK_SIZE = 32, 128, 64
V4_HEADS, V4_HEAD_DIM, V4_INDEX_HEADS, V4_CSA_RATE, V4_HCA_RATE = 64, 512, 64, 4, 128
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# --params: tiles overriding the configs' "default" ones for sparse_mla (a sweep candidate).
SPARSE_MLA_OVERRIDE: dict = {}


def compile_for(kernel, types: dict, constants: dict, arch: int, warps: int, stages: int):
    """`kernel` compiled for cuda:arch: `types` the signature of its runtime arguments (the
    rest i32), every non-float one hinted a multiple of 16."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    hinted = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
              if signature[n] not in ("constexpr", "fp32")}  # fmt: skip
    fixed = {(names.index(n),): v for n, v in constants.items()}
    source = ASTSource(fn=kernel, signature=signature, constexprs=fixed, attrs=hinted)
    options = dict(num_warps=warps, num_stages=stages)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def _pointer(dtype: str) -> str:
    return {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}[dtype]


def sparse_mla_split(arch: int, dtype: str):
    params = {**pick_tile_config("sparse_mla", "default", "default", HEADS), **SPARSE_MLA_OVERRIDE}
    if dtype == "fp32":
        params = {**params, **sparse_mla.FLOAT32_TILES}
    constants = sparse_mla.split_constants(params, DTYPES[dtype], HEADS, LATENT_RANK, ROPE_DIM,
                                           is_only_split=False)  # fmt: skip
    pointer = _pointer(dtype)
    types = dict(q_latent_ptr=pointer, q_pe_ptr=pointer, cache_ptr=pointer, slots_ptr="*i32",
                 mid_out_ptr="*fp32", mid_lse_ptr="*fp32", scale="fp32")  # fmt: skip
    return compile_for(sparse_mla._sparse_mla_split_kernel, types, constants, arch,
                       params["num_warps"], params["num_stages"])  # fmt: skip


def sparse_mla_combine(arch: int, dtype: str):
    types = dict(mid_out_ptr="*fp32", mid_lse_ptr="*fp32", out_ptr=_pointer(dtype),
                 seq_lens_ptr="*i32")  # fmt: skip
    constants = dict(LATENT_RANK=LATENT_RANK, BLOCK_L=256, BLOCK_S=32, SPLITS_PER_STEP=16)
    return compile_for(_mla_combine_kernel, types, constants, arch, 4, 1)


def index_scores(arch: int, dtype: str):
    params = pick_tile_config("dsa_indexer", "default", "default", 1)
    if dtype == "fp32":
        params = {**params, **dsa_indexer.FLOAT32_TILES}
    constants = dsa_indexer.score_constants(params, DTYPES[dtype], INDEX_HEADS, INDEX_DIM,
                                            BLOCK_SIZE)  # fmt: skip
    pointer = _pointer(dtype)
    types = dict(q_ptr=pointer, weights_ptr="*fp32", cache_ptr=pointer, block_tables_ptr="*i32",
                 query_seq_ptr="*i32", positions_ptr="*i64", scores_ptr="*fp32")  # fmt: skip
    return compile_for(dsa_indexer._index_scores_kernel, types, constants, arch,
                       params["num_warps"], params["num_stages"])  # fmt: skip


def index_scores_fp8(arch: int, dtype: str):
    """The score kernel over FP8 keys (index_cache_dtype="fp8_e4m3"): the cache's byte view."""
    params = pick_tile_config("dsa_indexer", "default", "default", 1)
    if dtype == "fp32":
        params = {**params, **dsa_indexer.FLOAT32_TILES}
    constants = dsa_indexer.score_constants(params, DTYPES[dtype], INDEX_HEADS, INDEX_DIM,
                                            BLOCK_SIZE, key_fp8=True)  # fmt: skip
    types = dict(q_ptr=_pointer(dtype), weights_ptr="*fp32", cache_ptr="*fp8e4nv",
                 block_tables_ptr="*i32", query_seq_ptr="*i32", positions_ptr="*i64",
                 scores_ptr="*fp32")  # fmt: skip
    return compile_for(dsa_indexer._index_scores_kernel, types, constants, arch,
                       params["num_warps"], params["num_stages"])  # fmt: skip


def write_cache_fp8(arch: int, dtype: str):
    """The cache write quantizing the index key (one program per token, GLM-5's row)."""
    pointer = _pointer(dtype)
    constants = dict(LATENT_RANK=LATENT_RANK, ROPE_DIM=ROPE_DIM, INDEX_DIM=INDEX_DIM,
                     BLOCK_L=LATENT_RANK, BLOCK_R=ROPE_DIM, BLOCK_D=INDEX_DIM, KEY_FP8=True,
                     ELEMENT_BYTES=DTYPES[dtype].itemsize)  # fmt: skip
    types = dict(kv_c_ptr=pointer, k_pe_ptr=pointer, index_key_ptr=pointer, cache_ptr=pointer,
                 cache_bytes_ptr="*fp8e4nv", slot_mapping_ptr="*i64")  # fmt: skip
    return compile_for(dsa_cache._dsa_write_cache_kernel, types, constants, arch, 4, 1)


def v4_index_scores(arch: int, dtype: str):
    """The score kernel over V4-Flash's pooled index keys (one per 4 tokens, spread over their
    rows: 32 columns each)."""
    params = pick_tile_config("dsa_indexer", "default", "default", 1)
    if dtype == "fp32":
        params = {**params, **dsa_indexer.FLOAT32_TILES}
    spread = (V4_CSA_RATE, INDEX_DIM // V4_CSA_RATE)
    constants = dsa_indexer.score_constants(params, DTYPES[dtype], V4_INDEX_HEADS, INDEX_DIM,
                                            BLOCK_SIZE, spread=spread)  # fmt: skip
    pointer = _pointer(dtype)
    types = dict(q_ptr=pointer, weights_ptr="*fp32", cache_ptr=pointer, block_tables_ptr="*i32",
                 query_seq_ptr="*i32", positions_ptr="*i64", scores_ptr="*fp32")  # fmt: skip
    return compile_for(dsa_indexer._index_scores_kernel, types, constants, arch,
                       params["num_warps"], params["num_stages"])  # fmt: skip


def _v4_attention(arch: int, dtype: str, entries: int, rate: int):
    constants = v4_attention.kernel_constants(DTYPES[dtype], V4_HEADS, V4_HEAD_DIM, BLOCK_SIZE,
                                              entries, rate, -(-V4_HEAD_DIM // rate))  # fmt: skip
    pointer = _pointer(dtype)
    types = dict(q_ptr=pointer, window_ptr=pointer, window_tables_ptr="*i32", cache_ptr=pointer,
                 tables_ptr="*i32", seq_ptr="*i64", pos_ptr="*i64", list_ptr="*i32",
                 sinks_ptr="*fp32", out_ptr=pointer, scale="fp32")  # fmt: skip
    return compile_for(v4_attention._v4_attention_kernel, types, constants, arch, 8, 1)


def v4_attention_listed(arch: int, dtype: str):
    """A CSA layer's attention: the window, then the indexer's listed entries."""
    return _v4_attention(arch, dtype, v4_attention.LISTED_ENTRIES, V4_CSA_RATE)


def v4_attention_every(arch: int, dtype: str):
    """An HCA layer's attention: the window, then every entry of 128 tokens reached."""
    return _v4_attention(arch, dtype, v4_attention.EVERY_ENTRY, V4_HCA_RATE)


def _radix_params() -> dict:
    return pick_tile_config("radix_topk", "default", "default", 1)


def topk_histogram(arch: int, dtype: str):
    """The selection's last histogram pass (three chosen bytes to re-derive): float32 scores,
    whatever the model's dtype."""
    params = _radix_params()
    types = dict(scores_ptr="*fp32", hist_ptr="*i32")
    constants = dict(PASS=3, BLOCK=params["BLOCK"])
    return compile_for(radix_topk._radix_histogram_kernel, types, constants, arch,
                       params["num_warps"], 1)  # fmt: skip


def topk_count(arch: int, dtype: str):
    params = _radix_params()
    types = dict(scores_ptr="*fp32", hist_ptr="*i32", split_counts_ptr="*i32")
    return compile_for(radix_topk._radix_count_kernel, types, dict(BLOCK=params["BLOCK"]), arch,
                       params["num_warps"], 1)  # fmt: skip


def topk_write(arch: int, dtype: str):
    """The write pass as decode runs it: chosen positions mapped to cache slots."""
    params = _radix_params()
    types = dict(scores_ptr="*fp32", hist_ptr="*i32", split_counts_ptr="*i32", out_ptr="*i32",
                 block_tables_ptr="*i32", query_seq_ptr="*i32", positions_ptr="*i64")  # fmt: skip
    constants = dict(BLOCK=params["BLOCK"], BLOCK_SPLITS=64, TO_SLOTS=True)
    return compile_for(radix_topk._radix_write_kernel, types, constants, arch,
                       params["num_warps"], 1)  # fmt: skip


KERNELS = {
    "sparse_mla": sparse_mla_split,
    "sparse_mla_combine": sparse_mla_combine,
    "dsa_index_scores": index_scores,
    "dsa_index_scores_fp8": index_scores_fp8,
    "dsa_write_cache_fp8": write_cache_fp8,
    "v4_index_scores": v4_index_scores,
    "v4_attention_listed": v4_attention_listed,
    "v4_attention_every": v4_attention_every,
    "dsa_topk_histogram": topk_histogram,
    "dsa_topk_count": topk_count,
    "dsa_topk_write": topk_write,
}
# DeepSeek-V4's serve bf16 models; their float32 path (parity runs) is the same code with
# smaller tiles, compiled on the GPU by tests/gpu/test_v4_kernels.py.
V4_KERNELS = ("v4_index_scores", "v4_attention_listed", "v4_attention_every")
# The radix top-k reads float32 scores whatever the model's dtype: compiled once ("bf16").
TOPK_KERNELS = ("dsa_topk_histogram", "dsa_topk_count", "dsa_topk_write")
# Triton's fp8e4nv builds for sm_89 and later only (kernels/fp8/fp8_support.FP8_CAPABILITY). FP8
# keys serve bf16/fp16 models: beside float32 queries the score kernel spills (sm_89: 42 spill
# instructions), left to float32 parity runs, which keep "auto" keys.
FP8_KERNELS, FP8_MIN_ARCH, FP8_DTYPES = (
    ("dsa_index_scores_fp8", "dsa_write_cache_fp8"),
    89,
    ("bf16", "fp16"),
)


def report(kernel: str, arch: int, dtype: str) -> dict:
    """One compile's resources, and whether its shared memory fits the target."""
    compiled = KERNELS[kernel](arch, dtype)
    cubin = compiled.asm["cubin"]
    shared = compiled.metadata.shared
    return dict(
        kernel=kernel, arch=arch, dtype=dtype, shared_memory_bytes=shared,
        shared_memory_limit=SHARED_MEMORY_LIMITS[arch],
        fits=shared <= SHARED_MEMORY_LIMITS[arch], registers=registers_per_thread(cubin),
        spill_instructions=spill_instructions(cubin),
        **_mma_kinds(compiled.asm["ttgir"]),
    )  # fmt: skip


def _mma_kinds(ttgir: str) -> dict:
    """How many dots became wgmma and how many mma.sync (ttgir_probe's loop report)."""
    counts = loop_report(ttgir)
    return dict(wgmma=counts["wgmma"], mma_sync=counts["mma_sync_dots"])


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=list(KERNELS), action="append")
    parser.add_argument("--arch", type=int, choices=list(SHARED_MEMORY_LIMITS), action="append")
    parser.add_argument("--dtype", choices=list(DTYPES), action="append")
    parser.add_argument("--params", type=json.loads, default={},
                        help="sparse_mla tiles (JSON) over the configs' default ones")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=default_jobs(), help="compiles at once")
    args = parser.parse_args(argv)
    SPARSE_MLA_OVERRIDE.clear()
    SPARSE_MLA_OVERRIDE.update(args.params)
    cases = []
    for kernel in args.kernel or list(KERNELS):
        for arch in args.arch or [80, 89, 90]:
            if kernel in FP8_KERNELS and arch < FP8_MIN_ARCH:
                continue
            for dtype in args.dtype or ["bf16"]:
                if kernel in FP8_KERNELS and dtype not in FP8_DTYPES:
                    continue
                if kernel in V4_KERNELS + TOPK_KERNELS and dtype == "fp32":
                    continue
                cases.append((kernel, arch, dtype))
    rows = []
    for row in reports_in_order(report, cases, args.jobs):
        rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


if __name__ == "__main__":
    main()
