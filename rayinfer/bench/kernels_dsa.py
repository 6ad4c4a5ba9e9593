"""`python -m rayinfer.bench kernels dsa [--json PATH]`: DeepSeek Sparse Attention's kernels on
CUDA at GLM-5's shapes (64 heads per rank, latent 512, rope 64, index_topk 2048; indexer 32
heads x 128; cache rows [c_kv | k_pe | index key] 704 bf16 wide, blocks of 64), as medians of
`triton.testing.do_bench` after warm-up:

- the HBM copy figure of this run: a 1 GiB `copy_` (bytes read + written / time);
- sparse decode attention (kernels/sparse_mla) at batch 1/16/64 over contexts 8k/128k/1M, each
  decode attending to 2048 distinct random tokens of its context: time, and the bandwidth of the
  bytes it must read (T x 2048 rows of (L + R) x 2 bytes + the queries) against the copy figure;
- the indexer at decode (kernels/dsa_indexer) at batch 1/16/64 over contexts 8k/128k: the whole
  selection (scores + top-k) and the score kernel alone, with the bandwidth of its key reads.

Correctness at these shapes is tests/gpu/test_dsa_kernels.py's.
"""

from __future__ import annotations

import argparse
import json

import torch

from rayinfer.kernels.dsa_indexer import dsa_index_topk, index_params, index_scores
from rayinfer.kernels.sparse_mla import sparse_mla_attention

HEADS, LATENT_RANK, ROPE_DIM, TOPK = 64, 512, 64, 2048
INDEX_HEADS, INDEX_DIM, BLOCK_SIZE = 32, 128, 64
ROW_WIDTH = LATENT_RANK + ROPE_DIM + INDEX_DIM
ELEMENT_BYTES = 2  # bf16
ATTENTION_CASES = [(b, c) for c in (8192, 131072, 1 << 20) for b in (1, 16, 64)]
INDEXER_CASES = [(b, c) for c in (8192, 131072) for b in (1, 16, 64)]
COPY_BYTES = 1 << 30


def attention_bytes(batch: int, topk: int = TOPK) -> int:
    """What sparse decode attention must read: each decode's listed rows (c_kv and k_pe) and its
    queries (q_latent and q_pe)."""
    row = (LATENT_RANK + ROPE_DIM) * ELEMENT_BYTES
    return batch * topk * row + batch * HEADS * row


def indexer_bytes(batch: int, context: int) -> int:
    """What the score kernel must read: every decode's context of index keys."""
    return batch * context * INDEX_DIM * ELEMENT_BYTES


def median_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bytes_per_s() -> float:
    """HBM bandwidth of a 1 GiB device copy (read + write)."""
    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * COPY_BYTES / (ms * 1e-3)


def time_sparse_attention(batch: int, context: int, copy_rate: float) -> dict:
    """One decode step of `batch` queries over a shared cache of `context` tokens (a step reads
    its slot lists, wherever in the cache they point)."""
    generator = torch.Generator(device="cuda").manual_seed(batch)
    kv_cache = torch.randn(context // BLOCK_SIZE, BLOCK_SIZE, ROW_WIDTH, device="cuda",
                           generator=generator).bfloat16()  # fmt: skip
    scores = torch.rand(batch, context, device="cuda", generator=generator)
    slots = scores.topk(TOPK, dim=-1).indices.to(torch.int32)  # [B, 2048] distinct
    q_latent = torch.randn(batch, HEADS, LATENT_RANK, device="cuda").bfloat16()
    q_pe = torch.randn(batch, HEADS, ROPE_DIM, device="cuda").bfloat16()
    scale = (LATENT_RANK // 4 + ROPE_DIM) ** -0.5
    ms = median_ms(lambda: sparse_mla_attention(q_latent, q_pe, kv_cache, slots, scale))
    rate = attention_bytes(batch) / (ms * 1e-3)
    return dict(kernel="sparse_mla_decode", batch=batch, context=context, ms=ms,
                bytes=attention_bytes(batch), tb_per_s=rate / 1e12,
                copy_share=rate / copy_rate)  # fmt: skip


def time_indexer(batch: int, context: int, copy_rate: float) -> dict:
    """One decode step's selection: `batch` sequences of `context` tokens each in their own
    blocks, each decode at its context's last position."""
    generator = torch.Generator(device="cuda").manual_seed(batch)
    blocks_per_seq = context // BLOCK_SIZE
    kv_cache = torch.randn(batch * blocks_per_seq, BLOCK_SIZE, ROW_WIDTH, device="cuda",
                           generator=generator).bfloat16()  # fmt: skip
    order = torch.randperm(batch * blocks_per_seq, device="cuda", generator=generator)
    tables = order.view(batch, blocks_per_seq).to(torch.int32)
    query_seq = torch.arange(batch, dtype=torch.int32, device="cuda")
    positions = torch.full((batch,), context - 1, device="cuda")
    q_index = torch.randn(batch, INDEX_HEADS, INDEX_DIM, device="cuda").bfloat16()
    weights = torch.randn(batch, INDEX_HEADS, device="cuda")
    args = (q_index, weights, kv_cache, LATENT_RANK + ROPE_DIM, tables, query_seq, positions)
    ms = median_ms(lambda: dsa_index_topk(*args, TOPK, context))
    buffer = torch.empty(batch, context, dtype=torch.float32, device="cuda")
    params = index_params(q_index)
    scores_ms = median_ms(lambda: index_scores(*args, buffer, params))
    rate = indexer_bytes(batch, context) / (scores_ms * 1e-3)
    return dict(kernel="dsa_indexer_decode", batch=batch, context=context, ms=ms,
                scores_ms=scores_ms, topk_ms=ms - scores_ms, bytes=indexer_bytes(batch, context),
                tb_per_s=rate / 1e12, copy_share=rate / copy_rate)  # fmt: skip


def print_row(row: dict) -> None:
    extra = f" scores {row['scores_ms']:.3f} ms" if "scores_ms" in row else ""
    print(f"{row['kernel']:20s} B={row['batch']:<3d} ctx={row['context']:<8d} "
          f"{row['ms']:8.3f} ms{extra}  {row['tb_per_s']:5.2f} TB/s "
          f"({row['copy_share']:.0%} of copy)", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayinfer.bench kernels dsa")
    parser.add_argument("--json", help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels dsa: no CUDA device; nothing to measure")
        return 0
    copy_rate = copy_bytes_per_s()
    print(f"HBM copy (1 GiB): {copy_rate / 1e12:.2f} TB/s", flush=True)
    rows = []
    for timer, cases in ((time_sparse_attention, ATTENTION_CASES), (time_indexer, INDEXER_CASES)):
        for batch, context in cases:
            rows.append(timer(batch, context, copy_rate))
            print_row(rows[-1])
            torch.cuda.empty_cache()
    if args.json:
        result = dict(device=torch.cuda.get_device_name(), copy_tb_per_s=copy_rate / 1e12,
                      rows=rows)  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0
