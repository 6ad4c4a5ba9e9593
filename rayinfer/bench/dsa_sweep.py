"""`bench kernels dsa --sweep`: tile configs of the sparse MLA kernel and the indexer's score
kernel at GLM-5's decode shapes (batch 1/16/64 over 128k tokens; dsa_shapes.py's constants).

Each config (the keys its kernel reads from configs/sparse_mla.json or dsa_indexer.json) is
first checked against the float32 reference on one small case; one that fails to compile, to
launch (shared memory) or to match is skipped with its reason. The rest are timed from short
CUDA-graph replays (the whole --sweep stays within a few minutes on an H200). Printed: the best
config per shape, and the one for the file, whose entries are bucketed by heads per rank only
(not by batch): the least geometric-mean time over the three shapes.
"""

from __future__ import annotations

import functools
import json
import math

import torch

from rayinfer.bench import dsa_shapes as glm5
from rayinfer.bench.graph_timing import graph_median_ms
from rayinfer.kernels.dsa.dsa_indexer import context_slots, index_scores
from rayinfer.kernels.dsa.sparse_mla import sparse_mla_attention, sparse_mla_attention_reference

SWEEP_BATCHES, SWEEP_CONTEXT = (1, 16, 64), 131072
CHECK_TOLERANCE = 2e-2  # bf16 sparse attention (tests/gpu/test_dsa_kernels.py)
SCORE_TOLERANCE = 1e-3  # bf16 indexer scores, of the largest score
SPARSE_MLA_KEYS = ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages", "target_programs",
                   "min_tokens_per_split", "max_splits")  # fmt: skip
SPARSE_MLA_SWEEP = [dict(zip(SPARSE_MLA_KEYS, values)) for values in (
    (32, 32, 8, 2, 528, 128, 32),  # configs' "default" entry for 64 heads
    (16, 32, 4, 2, 528, 128, 32),
    (16, 64, 4, 2, 528, 128, 32),
    (32, 64, 8, 2, 528, 128, 32),
    (32, 16, 4, 3, 528, 128, 32),
    (32, 32, 4, 2, 528, 128, 32),
    (32, 32, 8, 3, 528, 128, 32),
    (32, 32, 8, 1, 528, 128, 32),
    (64, 32, 8, 2, 528, 128, 32),
    (64, 16, 8, 2, 528, 128, 32),
    (64, 64, 8, 1, 528, 128, 32),
    (32, 32, 8, 2, 1056, 64, 64),
    (32, 32, 8, 2, 264, 128, 32),
    (32, 32, 8, 2, 528, 64, 64),
    (32, 32, 8, 2, 528, 256, 16),
    (16, 32, 4, 2, 1056, 64, 64),
    (64, 32, 8, 2, 1056, 64, 64),
    (32, 64, 8, 2, 1056, 64, 64),
    (16, 16, 4, 3, 1056, 32, 64),
    (32, 16, 4, 2, 1056, 32, 64),
    # more splits: a few decodes' programs fill the GPU
    (16, 32, 4, 2, 2112, 64, 64),
    (32, 32, 8, 2, 2112, 32, 64),
    (64, 32, 8, 2, 2112, 32, 64),
    (16, 64, 4, 3, 1056, 64, 64),
)]  # fmt: skip
INDEXER_KEYS = ("BLOCK_N", "KEYS_PER_PROGRAM", "num_warps", "num_stages")
INDEXER_SWEEP = [dict(zip(INDEXER_KEYS, values)) for values in (
    (64, 1024, 4, 3),  # configs' "default" entry
    (64, 512, 4, 3), (64, 256, 4, 3), (64, 2048, 4, 3), (64, 4096, 4, 3),
    (32, 512, 4, 3), (32, 1024, 4, 4), (32, 256, 4, 4), (32, 2048, 4, 3),
    (128, 1024, 8, 3), (128, 512, 8, 2), (128, 2048, 8, 3), (128, 256, 8, 2), (128, 1024, 4, 2),
    (64, 1024, 8, 3), (64, 512, 8, 4), (64, 1024, 4, 2), (64, 256, 4, 2), (64, 2048, 8, 4),
    (64, 512, 4, 4),
)]  # fmt: skip


def quick_ms(fn) -> float:
    """Median GPU time from a CUDA graph's replays (bench/graph_timing.py: decode's way, with no
    Python launch cost to drown small shapes); inf where it fails at this shape (printed), which
    rules the config out of the file's pick."""
    try:
        return graph_median_ms(fn, samples=12, replays=5, warm_samples=2)
    except Exception as failure:  # a launch past a limit that the small check did not reach
        print(f"  failed: {type(failure).__name__}: {failure}"[:240], flush=True)
        return math.inf


class SparseMlaCase:
    """Decodes of GLM-5's sparse attention: `batch` queries, 2048 distinct slots each (-1 for the
    tail of a context shorter than that) in one shared cache of `context` tokens."""

    def __init__(self, batch: int, context: int):
        generator = torch.Generator(device="cuda").manual_seed(batch)
        blocks = context // glm5.BLOCK_SIZE
        self.kv_cache = glm5.random_bf16(
            blocks, glm5.BLOCK_SIZE, glm5.ROW_WIDTH, generator=generator
        )
        scores = torch.rand(batch, context, device="cuda", generator=generator)
        self.slots = scores.topk(min(glm5.TOPK, context), dim=-1).indices.to(torch.int32)
        self.slots = torch.nn.functional.pad(
            self.slots, (0, glm5.TOPK - self.slots.shape[1]), value=-1
        )
        self.q_latent = glm5.random_bf16(batch, glm5.HEADS, glm5.LATENT_RANK, generator=generator)
        self.q_pe = glm5.random_bf16(batch, glm5.HEADS, glm5.ROPE_DIM, generator=generator)

    def run(self, params: dict) -> torch.Tensor:  # [B, 64, 512]
        return sparse_mla_attention(self.q_latent, self.q_pe, self.kv_cache, self.slots, glm5.SCALE,
                                    params)  # fmt: skip

    def error(self, params: dict) -> float:
        """Largest |ours - float32 reference| over the outputs."""
        reference = sparse_mla_attention_reference(
            self.q_latent.float(), self.q_pe.float(), self.kv_cache.float(), self.slots, glm5.SCALE
        )
        return (self.run(params).float() - reference).abs().max().item()


class IndexerCase:
    """Decodes of GLM-5's indexer scores: `batch` sequences of `context` tokens each."""

    def __init__(self, batch: int, context: int):
        generator = torch.Generator(device="cuda").manual_seed(batch)
        self.kv_cache, self.tables = glm5.own_contexts(batch, context, glm5.ROW_WIDTH, generator)
        self.query_seq = torch.arange(batch, dtype=torch.int32, device="cuda")
        self.positions = torch.full((batch,), context - 1, device="cuda")
        self.q_index = glm5.random_bf16(
            batch, glm5.INDEX_HEADS, glm5.INDEX_DIM, generator=generator
        )
        self.weights = torch.randn(batch, glm5.INDEX_HEADS, device="cuda", generator=generator)
        self.scores = torch.empty(batch, context, dtype=torch.float32, device="cuda")

    def run(self, params: dict) -> torch.Tensor:  # [B, context] float32
        index_scores(self.q_index, self.weights, self.kv_cache, glm5.LATENT_RANK + glm5.ROPE_DIM,
                     self.tables, self.query_seq, self.positions, self.scores, params)  # fmt: skip
        return self.scores

    def error(self, params: dict) -> float:
        """Largest |ours - float32 scores| over the scores, relative to the largest score."""
        slots = context_slots(self.tables, self.query_seq, glm5.BLOCK_SIZE, self.scores.shape[1])
        flat = self.kv_cache.view(-1, glm5.ROW_WIDTH)[:, glm5.LATENT_RANK + glm5.ROPE_DIM :]
        keys = flat[slots].float()  # [B, S, D]: each decode sees its whole context
        logits = torch.einsum("thd,tsd->ths", self.q_index.float(), keys).relu()
        reference = torch.einsum("th,ths->ts", self.weights, logits)  # [B, S]
        ours = self.run(params)
        return ((ours - reference).abs().max() / reference.abs().max()).item()


def checked(configs: list[dict], case, tolerance: float) -> list[dict]:
    """The configs that compile, launch and match the reference on `case`; the rest printed."""
    passing = []
    for params in configs:
        try:
            error = case.error(params)
        except Exception as failure:  # out of shared memory or registers: skip the config
            print(f"  skipped {params}: {type(failure).__name__}: {failure}"[:240], flush=True)
            continue
        if error <= tolerance:
            passing.append(params)
        else:
            print(f"  skipped {params}: error {error:.2e} > {tolerance:.0e}", flush=True)
    return passing


def time_configs(case, configs: list[dict]) -> list[tuple[float, int]]:
    """(ms, index) of every config on one case."""
    return [(quick_ms(functools.partial(case.run, params)), i) for i, params in enumerate(configs)]


def sweep_kernel(name: str, configs: list[dict], case_type, tolerance: float) -> dict:
    """Every passing config at each sweep shape -> {"rows", "best_per_shape", "best"}."""
    print(f"== sweep {name}: {len(configs)} configs ==", flush=True)
    configs = checked(configs, case_type(2, 4096), tolerance)
    rows, best_per_shape = [], {}
    for batch in SWEEP_BATCHES:
        timed = time_configs(case_type(batch, SWEEP_CONTEXT), configs)  # [(ms, config index)]
        torch.cuda.empty_cache()
        rows += [dict(batch=batch, context=SWEEP_CONTEXT, ms=ms, params=configs[i])
                 for ms, i in timed]  # fmt: skip
        if timed:
            ms, i = min(timed)
            best_per_shape[batch] = dict(ms=ms, params=configs[i])
            print(f"  B={batch:<3d} ctx={SWEEP_CONTEXT}: best {ms:.3f} ms {configs[i]}", flush=True)
    log_ms = [sum(math.log(r["ms"]) for r in rows if r["params"] is p) for p in configs]
    finite = [(total, i) for i, total in enumerate(log_ms) if math.isfinite(total)]
    best = configs[min(finite)[1]] if finite else None
    print(f"  best over the shapes (geometric mean): {best}", flush=True)
    return dict(rows=rows, best_per_shape=best_per_shape, best=best)


def config_snippet(results: dict, device_name: str) -> dict:
    """The best tiles in the configs' layout: {op: {GPU name: {"default": {bucket: tiles}}}},
    sparse_mla bucketed by heads per rank (64), the indexer's single bucket "1"."""
    buckets = {"sparse_mla": str(glm5.HEADS), "dsa_indexer": "1"}
    return {op: {device_name: {"default": {buckets[op]: results[op]["best"]}}}
            for op in buckets if op in results and results[op]["best"]}  # fmt: skip


SWEPT_KERNELS = ("sparse_mla", "dsa_indexer")


def run(config_out: str | None, kernels: tuple[str, ...] = SWEPT_KERNELS) -> dict:
    """The sweeps of `kernels`; the snippet printed and, given config_out, written there."""
    sweeps = {
        "sparse_mla": lambda: sweep_kernel("sparse_mla", SPARSE_MLA_SWEEP, SparseMlaCase,
                                           CHECK_TOLERANCE),
        "dsa_indexer": lambda: sweep_kernel("dsa_indexer", INDEXER_SWEEP, IndexerCase,
                                            SCORE_TOLERANCE),
    }  # fmt: skip
    results = {kernel: sweeps[kernel]() for kernel in kernels}
    snippet = config_snippet(results, torch.cuda.get_device_name())
    print(json.dumps(snippet, indent=1), flush=True)
    if config_out:
        with open(config_out, "w") as f:
            json.dump(snippet, f, indent=1)
    return {**results, "config_snippet": snippet}
