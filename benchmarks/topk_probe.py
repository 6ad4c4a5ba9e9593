"""The indexer's top-k at its shapes (k = 2048 of 16k-1M float32 scores per query, 1-2048
queries) on one GPU: rayinfer's radix select (kernels/dsa/radix_topk.py) under a few launch
configurations against torch.topk (unsorted, what the indexer ran before) in the same run,
medians of CUDA-graph replays (rayinfer/bench/graph_timing.py, as decode replays them), each radix
result checked to hold torch's values. The scores are the indexer's own (its score kernel at
GLM-5's shapes over random bf16 keys, the queries at a context's last positions): how they are
distributed decides how fast a top-k is.

    python benchmarks/topk_probe.py [--json PATH]

The best configuration by geometric mean is printed last, in configs/radix_topk.json's layout.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayinfer.bench.dsa_shapes import (  # noqa: E402
    INDEX_DIM,
    INDEX_HEADS,
    LATENT_RANK,
    ROPE_DIM,
    ROW_WIDTH,
    own_contexts,
    random_bf16,
)
from rayinfer.bench.graph_timing import graph_median_ms  # noqa: E402
from rayinfer.kernels.dsa.dsa_indexer import index_params, index_scores  # noqa: E402
from rayinfer.kernels.dsa.radix_topk import radix_topk  # noqa: E402

K = 2048
# decode batches over 128k / 1M contexts, and prefill chunks (rows x context)
SHAPES = [(1, 131072), (16, 131072), (64, 131072), (16, 1048576), (256, 16384), (2048, 131072)]
CONFIGS = [
    dict(BLOCK=b, num_warps=w, target_programs=t, min_cols_per_split=m)
    for b, w in ((512, 4), (1024, 4), (2048, 8))
    for t in (264, 528, 1056)
    for m in (2048, 8192)
]


def indexer_scores(num_rows: int, length: int) -> torch.Tensor:
    """[num_rows, length] float32: the score kernel's output for num_rows queries at the last
    positions of one `length`-token context."""
    generator = torch.Generator(device="cuda").manual_seed(num_rows)
    kv_cache, tables = own_contexts(1, length, ROW_WIDTH, generator)
    q_index = random_bf16(num_rows, INDEX_HEADS, INDEX_DIM, generator=generator)
    weights = torch.randn(num_rows, INDEX_HEADS, device="cuda", generator=generator)
    query_seq = torch.zeros(num_rows, dtype=torch.int32, device="cuda")
    positions = torch.arange(length - num_rows, length, device="cuda")
    scores = torch.empty(num_rows, length, dtype=torch.float32, device="cuda")
    index_scores(q_index, weights, kv_cache, LATENT_RANK + ROPE_DIM, tables, query_seq,
                 positions, scores, index_params(q_index))  # fmt: skip
    return scores


def median_ms(fn) -> float:
    return graph_median_ms(fn)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for num_rows, length in SHAPES:
        scores = indexer_scores(num_rows, length)
        expected = scores.topk(K, dim=-1).values.sort(-1).values
        torch_ms = median_ms(lambda x=scores: x.topk(K, dim=-1, sorted=False))
        out = torch.empty(num_rows, K, dtype=torch.int32, device="cuda")
        for index, config in enumerate(CONFIGS):
            radix_topk(scores, K, out, config)
            assert torch.equal(scores.gather(1, out.long()).sort(-1).values, expected), config
            run = lambda c=config, x=scores, o=out: radix_topk(x, K, o, c)  # noqa: E731
            ms = median_ms(run)
            rows.append(dict(rows=num_rows, length=length, config=index, radix_ms=ms,
                             torch_ms=torch_ms, speedup=torch_ms / ms))  # fmt: skip
        best = min((r for r in rows if r["length"] == length and r["rows"] == num_rows),
                   key=lambda r: r["radix_ms"])  # fmt: skip
        print(f"[{num_rows}, {length}] k={K}: torch.topk {torch_ms:.3f} ms, radix best "
              f"{best['radix_ms']:.3f} ms ({best['speedup']:.2f}x, config {best['config']}: "
              f"{CONFIGS[best['config']]})", flush=True)  # fmt: skip
    by_config = {
        i: math.exp(sum(math.log(r["speedup"]) for r in rows if r["config"] == i) / len(SHAPES))
        for i in range(len(CONFIGS))
    }
    best = max(by_config, key=by_config.get)
    for num_rows, length in SHAPES:
        row = next(r for r in rows if r["config"] == best and r["rows"] == num_rows
                   and r["length"] == length)  # fmt: skip
        print(f"best config [{num_rows}, {length}]: radix {row['radix_ms']:.3f} ms, torch.topk "
              f"{row['torch_ms']:.3f} ms, {row['speedup']:.2f}x", flush=True)  # fmt: skip
    print(f"best by geometric mean ({by_config[best]:.2f}x): {json.dumps(CONFIGS[best])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(configs=CONFIGS, rows=rows, best=CONFIGS[best]), f, indent=1)


if __name__ == "__main__":
    main()
