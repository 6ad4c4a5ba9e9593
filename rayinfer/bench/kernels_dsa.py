"""`python -m rayinfer.bench kernels dsa [--json PATH] [--sweep [--config-out FILE]]`: DeepSeek
Sparse Attention's kernels on CUDA at GLM-5's shapes (64 heads per rank, latent 512, rope 64,
index_topk 2048; indexer 32 heads x 128; cache rows [c_kv | k_pe | index key] 704 bf16 wide,
blocks of 64), as medians of CUDA-graph replays (bench/graph_timing.py: each op replayed as
decode runs it; `--timing eager`: `do_bench`, Python launches included) after warm-up:

- the HBM copy figure of this run: a 1 GiB `copy_` (bytes read + written / time);
- sparse decode attention (kernels/dsa/sparse_mla) at batch 1/16/64 over contexts 8k/128k/1M, each
  decode attending to 2048 distinct random tokens of its context: time, and the bandwidth of the
  bytes it must read (T x 2048 rows of (L + R) x 2 bytes + the queries) against the copy figure;
- the indexer at decode (kernels/dsa/dsa_indexer) at batch 1/16/64 over contexts 8k/128k/1M: the
  whole selection (scores + top-k as "auto" picks it), with the radix select and with torch.topk
  each, and the score kernel alone,
  with the bandwidth of its key reads;
- the same-run dense baseline: rayinfer's absorbed MLA decode (ops.mla_decode_attention) over
  plain [blocks, 64, 576] caches of the same contexts, and the kernel-level figure
  speedup = dense_ms / (indexer_ms + sparse_ms), DSA's whole attention cost per layer being its
  selection plus its sparse attention. A case whose caches would pass MEMORY_LIMIT_BYTES is
  skipped, and the output says so;
- with --sweep (bench/dsa_sweep.py): tile configs of both kernels at batch 1/16/64 over 128k,
  checked first, the best per shape and per file printed (--config-out writes them).

Correctness at these shapes is tests/gpu/test_dsa_kernels.py's.
"""

from __future__ import annotations

import argparse
import json

import torch

from rayinfer.bench import dsa_sweep
from rayinfer.bench.dsa_shapes import (
    BLOCK_SIZE,
    ELEMENT_BYTES,
    HEADS,
    INDEX_DIM,
    INDEX_HEADS,
    LATENT_RANK,
    ROPE_DIM,
    ROW_WIDTH,
    SCALE,
    TOPK,
    own_contexts,
    random_bf16,
)
from rayinfer.bench.graph_timing import graph_median_ms
from rayinfer.kernels import ops
from rayinfer.kernels.dsa.dsa_indexer import dsa_index_topk, index_params, index_scores
from rayinfer.kernels.dsa.sparse_mla import sparse_mla_attention

ATTENTION_CASES = [(b, c) for c in (8192, 131072, 1 << 20) for b in (1, 16, 64)]
INDEXER_CASES = ATTENTION_CASES  # the selection of every attention case (for the speedup)
COPY_BYTES = 1 << 30
# Caches of one case (each decode's own context): 1M x 64 would take 77 GB dense (576 wide) and
# 94 GB for the indexer (704 wide), past what the benchmark allocates.
MEMORY_LIMIT_BYTES = 60 * 10**9


def attention_bytes(batch: int, topk: int = TOPK) -> int:
    """What sparse decode attention must read: each decode's listed rows (c_kv and k_pe) and its
    queries (q_latent and q_pe)."""
    row = (LATENT_RANK + ROPE_DIM) * ELEMENT_BYTES
    return batch * topk * row + batch * HEADS * row


def indexer_bytes(batch: int, context: int) -> int:
    """What the score kernel must read: every decode's context of index keys."""
    return batch * context * INDEX_DIM * ELEMENT_BYTES


def dense_bytes(batch: int, context: int) -> int:
    """What dense MLA decode must read (and its cache holds): every decode's whole context."""
    return batch * context * (LATENT_RANK + ROPE_DIM) * ELEMENT_BYTES


def indexer_cache_bytes(batch: int, context: int) -> int:
    """The indexer case's cache: every decode's context of full DSA rows."""
    return batch * context * ROW_WIDTH * ELEMENT_BYTES


TIMINGS = ("graph", "eager")
TIMING = {"mode": "graph"}  # main's --timing


def median_ms(fn) -> float:
    """The median of fn's GPU time: replayed from a CUDA graph (bench/graph_timing.py, as decode
    runs these kernels), or launched eagerly (`--timing eager`, where a few small launches cost
    more on the host than on the GPU)."""
    import triton.testing

    if TIMING["mode"] == "eager":
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    return graph_median_ms(fn)


def copy_bytes_per_s() -> float:
    """HBM bandwidth of a 1 GiB device copy (read + write)."""
    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * COPY_BYTES / (ms * 1e-3)


def sparse_attention_inputs(batch: int, context: int) -> tuple:
    """(q_latent, q_pe, kv_cache, slots, scale) of one decode step of `batch` queries over a
    shared cache of `context` tokens, each query's slots the top-k of random scores."""
    generator = torch.Generator(device="cuda").manual_seed(batch)
    kv_cache = random_bf16(context // BLOCK_SIZE, BLOCK_SIZE, ROW_WIDTH, generator=generator)
    scores = torch.rand(batch, context, device="cuda", generator=generator)
    slots = scores.topk(TOPK, dim=-1).indices.to(torch.int32)  # [B, 2048] distinct
    q_latent = random_bf16(batch, HEADS, LATENT_RANK, generator=generator)
    q_pe = random_bf16(batch, HEADS, ROPE_DIM, generator=generator)
    return q_latent, q_pe, kv_cache, slots, SCALE


def time_sparse_attention(batch: int, context: int, copy_rate: float) -> dict:
    """One decode step of `batch` queries over a shared cache of `context` tokens (a step reads
    its slot lists, wherever in the cache they point)."""
    inputs = sparse_attention_inputs(batch, context)
    ms = median_ms(lambda: sparse_mla_attention(*inputs))
    # the Triton kernel in the same run (the entry's fallback tiles where it is a Gluon entry)
    triton_ms = median_ms(lambda: sparse_mla_attention(*inputs, backend="triton"))
    rate = attention_bytes(batch) / (ms * 1e-3)
    return dict(kernel="sparse_mla_decode", batch=batch, context=context, ms=ms,
                bytes=attention_bytes(batch), tb_per_s=rate / 1e12,
                copy_share=rate / copy_rate, triton_ms=triton_ms,
                vs_triton=triton_ms / ms)  # fmt: skip


def time_indexer(batch: int, context: int, copy_rate: float) -> dict:
    """One decode step's selection: `batch` sequences of `context` tokens each in their own
    blocks, each decode at its context's last position."""
    generator = torch.Generator(device="cuda").manual_seed(batch)
    kv_cache, tables = own_contexts(batch, context, ROW_WIDTH, generator)
    query_seq = torch.arange(batch, dtype=torch.int32, device="cuda")
    positions = torch.full((batch,), context - 1, device="cuda")
    q_index = random_bf16(batch, INDEX_HEADS, INDEX_DIM, generator=generator)
    weights = torch.randn(batch, INDEX_HEADS, device="cuda", generator=generator)
    args = (q_index, weights, kv_cache, LATENT_RANK + ROPE_DIM, tables, query_seq, positions)
    ms = median_ms(lambda: dsa_index_topk(*args, TOPK, context))
    radix_ms = median_ms(lambda: dsa_index_topk(*args, TOPK, context, selection="radix"))
    torch_ms = median_ms(lambda: dsa_index_topk(*args, TOPK, context, selection="torch"))
    buffer = torch.empty(batch, context, dtype=torch.float32, device="cuda")
    params = index_params(q_index)
    scores_ms = median_ms(lambda: index_scores(*args, buffer, params))
    rate = indexer_bytes(batch, context) / (scores_ms * 1e-3)
    return dict(kernel="dsa_indexer_decode", batch=batch, context=context, ms=ms,
                scores_ms=scores_ms, topk_ms=ms - scores_ms, radix_topk_ms=radix_ms,
                torch_topk_ms=torch_ms, bytes=indexer_bytes(batch, context),
                tb_per_s=rate / 1e12, copy_share=rate / copy_rate)  # fmt: skip


def time_dense_attention(batch: int, context: int, copy_rate: float) -> dict:
    """Dense absorbed MLA decode (what the model's dense-MLA twin runs): `batch` decodes, each
    over its own `context` tokens of 576-wide rows."""
    generator = torch.Generator(device="cuda").manual_seed(batch)
    kv_cache, tables = own_contexts(batch, context, LATENT_RANK + ROPE_DIM, generator)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q_latent = random_bf16(batch, HEADS, LATENT_RANK, generator=generator)
    q_pe = random_bf16(batch, HEADS, ROPE_DIM, generator=generator)
    ms = median_ms(
        lambda: ops.mla_decode_attention(q_latent, q_pe, kv_cache, tables, seq_lens, SCALE)
    )
    rate = dense_bytes(batch, context) / (ms * 1e-3)
    return dict(kernel="mla_dense_decode", batch=batch, context=context, ms=ms,
                bytes=dense_bytes(batch, context), tb_per_s=rate / 1e12,
                copy_share=rate / copy_rate)  # fmt: skip


def too_large(kernel: str, batch: int, context: int) -> str | None:
    """Why a case is skipped (its caches past MEMORY_LIMIT_BYTES), None if it runs."""
    need = {"mla_dense_decode": dense_bytes, "dsa_indexer_decode": indexer_cache_bytes}
    size = need[kernel](batch, context) if kernel in need else 0
    if size <= MEMORY_LIMIT_BYTES:
        return None
    return f"{size / 1e9:.0f} GB of cache > {MEMORY_LIMIT_BYTES / 1e9:.0f} GB"


def speedup_row(sparse: dict, indexer: dict | None, dense: dict | None) -> dict:
    """DSA decode vs dense MLA decode at one (batch, context): dense / (selection + sparse)."""
    row = dict(kernel="dsa_vs_dense_decode", batch=sparse["batch"], context=sparse["context"],
               sparse_ms=sparse["ms"])  # fmt: skip
    if indexer is None or dense is None:
        return {**row, "skipped": "no indexer or dense time (memory)"}
    total = indexer["ms"] + sparse["ms"]
    return {**row, "indexer_ms": indexer["ms"], "dense_ms": dense["ms"],
            "speedup": dense["ms"] / total}  # fmt: skip


def print_row(row: dict) -> None:
    head = f"{row['kernel']:20s} B={row['batch']:<3d} ctx={row['context']:<8d}"
    if "skipped" in row:
        print(f"{head} skipped: {row['skipped']}", flush=True)
    elif "speedup" in row:
        print(f"{head} dense {row['dense_ms']:8.3f} ms / (indexer {row['indexer_ms']:.3f} + "
              f"sparse {row['sparse_ms']:.3f}) = {row['speedup']:6.2f}x", flush=True)  # fmt: skip
    else:
        extra = f" scores {row['scores_ms']:.3f} ms" if "scores_ms" in row else ""
        if "triton_ms" in row:  # the sparse attention's Triton kernel, same run
            extra += f" (Triton {row['triton_ms']:.3f} ms: {row['vs_triton']:.2f}x)"
        if "torch_topk_ms" in row:  # the same selection with torch.topk, same run
            extra += (f" (radix {row['radix_topk_ms']:.3f} ms, torch.topk "
                      f"{row['torch_topk_ms']:.3f} ms)")  # fmt: skip
        print(f"{head} {row['ms']:8.3f} ms{extra}  {row['tb_per_s']:5.2f} TB/s "
              f"({row['copy_share']:.0%} of copy)", flush=True)  # fmt: skip


def measure(timer, kernel: str, cases, copy_rate: float) -> dict:
    """{(batch, context): row} of one timer over its cases, the skipped ones as skip rows."""
    rows = {}
    for batch, context in cases:
        reason = too_large(kernel, batch, context)
        if reason:
            row = dict(kernel=kernel, batch=batch, context=context, skipped=reason)
        else:
            row = timer(batch, context, copy_rate)
        rows[batch, context] = row
        print_row(row)
        torch.cuda.empty_cache()
    return rows


def timed(rows: dict, case: tuple[int, int]) -> dict | None:
    """The case's row, None where it was skipped."""
    return None if "skipped" in rows[case] else rows[case]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rayinfer.bench kernels dsa")
    parser.add_argument("--json", help="write the rows to this JSON file")
    parser.add_argument("--timing", choices=TIMINGS, default="graph",
                        help="graph: each op replayed from a CUDA graph (decode's way); eager: "
                        "launched from Python, host launch cost included")  # fmt: skip
    parser.add_argument(
        "--sweep", action="store_true", help="also sweep both kernels' tiles at 1/16/64 x 128k"
    )
    parser.add_argument("--sparse-only", action="store_true",
                        help="only the sparse attention (no indexer, dense, sweep)")  # fmt: skip
    parser.add_argument("--sweep-kernels", nargs="+", choices=dsa_sweep.SWEPT_KERNELS,
                        default=list(dsa_sweep.SWEPT_KERNELS),
                        help="with --sweep: which kernels' tiles (default: both)")  # fmt: skip
    parser.add_argument("--config-out", help="with --sweep: write the best tiles here, in "
                        "configs/sparse_mla.json's and dsa_indexer.json's layout")  # fmt: skip
    args = parser.parse_args(argv)
    if args.config_out and not args.sweep:
        parser.error("--config-out needs --sweep")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    TIMING["mode"] = args.timing
    if not torch.cuda.is_available():
        print("kernels dsa: no CUDA device; nothing to measure")
        return 0
    copy_rate = copy_bytes_per_s()
    print(f"HBM copy (1 GiB): {copy_rate / 1e12:.2f} TB/s", flush=True)
    sparse = measure(time_sparse_attention, "sparse_mla_decode", ATTENTION_CASES, copy_rate)
    if args.sparse_only:
        rows = list(sparse.values())
        _write(
            args.json,
            dict(
                device=torch.cuda.get_device_name(),
                copy_tb_per_s=copy_rate / 1e12,
                timing=args.timing,
                rows=rows,
            ),
        )
        return 0
    indexer = measure(time_indexer, "dsa_indexer_decode", INDEXER_CASES, copy_rate)
    dense = measure(time_dense_attention, "mla_dense_decode", ATTENTION_CASES, copy_rate)
    speedups = [speedup_row(sparse[c], timed(indexer, c), timed(dense, c))
                for c in ATTENTION_CASES]  # fmt: skip
    for row in speedups:
        print_row(row)
    rows = [*sparse.values(), *indexer.values(), *dense.values(), *speedups]
    result = dict(device=torch.cuda.get_device_name(), copy_tb_per_s=copy_rate / 1e12,
                  timing=args.timing, rows=rows)  # fmt: skip
    if args.sweep:
        result["sweep"] = dsa_sweep.run(args.config_out, tuple(args.sweep_kernels))
    _write(args.json, result)
    return 0


def _write(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
