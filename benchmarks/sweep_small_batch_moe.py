"""Sweep of the small-batch fused MoE (kernels/moe/fused_moe_small.py, issue 6): correctness against
a float32 reference, then its tiles timed inside CUDA graphs (as a decode step runs it) against the
general fused MoE in the same run, per expert shape and batch 1-2.

GPU (one H200, about a minute with compiles):
    PYTHONPATH=$PWD python benchmarks/sweep_small_batch_moe.py --out $OUT/small_moe.json
CPU check of this script's logic (Triton interpreter, float32, tiny shapes, plain timings):
    PYTHONPATH=$PWD python benchmarks/sweep_small_batch_moe.py --smoke --out /tmp/small_moe.json

The bytes that must move are the distinct experts' weights (3 x H x I each); the share is of the
H200's 4.23 TB/s. The gate-up tiles are swept with the default down tiles, then the down tiles
with the best gate-up ones. The output's `config_entry` is ready for
rayinfer/kernels/configs/fused_moe_small.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from rayinfer.kernels.moe.fused_moe import fused_moe, fused_moe_reference  # noqa: E402
from rayinfer.kernels.moe.fused_moe_small import _DEFAULT_TILES, fused_moe_small_batch  # noqa: E402

PEAK_BYTES_PER_S = 4.23e12  # H200 HBM copy
# (name, experts, hidden, intermediate, top-k)
SHAPES = [("deepseek-v2-lite", 64, 2048, 1408, 6), ("deepseek-v3", 256, 7168, 2048, 8)]
SMOKE_SHAPES = [("tiny", 8, 64, 48, 2)]


def tile_grid(smoke: bool) -> list[dict]:
    if smoke:
        return [dict(BLOCK_N=16, BLOCK_K=k, num_warps=4, num_stages=1) for k in (16, 32)]
    return [
        dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
        for n, k, w, s in itertools.product((16, 32, 64), (128, 256), (4,), (3, 4))
    ]


def timer(smoke: bool):
    """ms per call: inside a CUDA graph on the GPU (launch cost out, as in a decode graph)."""
    if smoke:
        return lambda fn: _plain_median_ms(fn)
    import triton.testing

    return lambda fn: triton.testing.do_bench_cudagraph(fn, rep=20)


def _plain_median_ms(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def make_case(experts, hidden, inter, top_k, num_tokens, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(device, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(device, dtype)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return x, w13, w2, weights.to(device), ids.to(device)


def relative_error(out: torch.Tensor, case) -> float:
    x, w13, w2, weights, ids = case
    expected = fused_moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    return ((out.float() - expected).norm() / expected.norm()).item()


def sweep_case(shape, num_tokens, dtype, device, grid, bench, deadline: float) -> dict:
    """Gate-up tiles, then down tiles, each timed with the other part's best so far; configs
    left when the deadline (time.time()) passes are recorded as not run."""
    name, experts, hidden, inter, top_k = shape
    case = make_case(experts, hidden, inter, top_k, num_tokens, dtype, device)
    distinct = torch.unique(case[4]).numel()
    weight_bytes = distinct * 3 * hidden * inter * case[1].element_size()
    general_ms = bench(lambda: fused_moe(*case))
    row = dict(shape=name, tokens=num_tokens, distinct_experts=distinct, bytes=weight_bytes,
               general_ms=general_ms, general_error=relative_error(fused_moe(*case), case),
               gate_up={}, down={})  # fmt: skip

    def timed(params) -> tuple[float, float]:
        out = fused_moe_small_batch(*case, params=params)
        return bench(lambda: fused_moe_small_batch(*case, params=params)), relative_error(out, case)

    best = dict(_DEFAULT_TILES)
    for part in ("gate_up", "down"):
        for tiles in grid:
            if time.time() > deadline:
                row[part][_key(tiles)] = dict(error="not run: time budget spent")
                continue
            params = {**best, part: tiles}
            try:
                ms, error = timed(params)
            except Exception as exc:  # an OutOfResources compile: recorded, skipped
                row[part][_key(tiles)] = dict(error=type(exc).__name__)
                continue
            row[part][_key(tiles)] = dict(ms=ms, relative_error=error)
        passing = {k: v for k, v in row[part].items() if v.get("relative_error", 1) < 2e-2}
        if passing:
            best = {**best, part: _tiles(min(passing, key=lambda k: passing[k]["ms"]))}
    row["best"] = best
    row["best_ms"], row["best_error"] = timed(best)
    row["default_ms"], _ = timed(_DEFAULT_TILES)
    for key in ("general_ms", "default_ms", "best_ms"):
        row[key.replace("_ms", "_share")] = weight_bytes / (row[key] * 1e-3) / PEAK_BYTES_PER_S
    print(_table_line(row), flush=True)
    return row


def _table_line(r: dict) -> str:
    return (f"| {r['shape']} | {r['tokens']} | {r['bytes'] / 1e6:.0f} "
            f"| {r['general_ms'] * 1e3:.1f} ({r['general_share']:.0%}) "
            f"| {r['default_ms'] * 1e3:.1f} ({r['default_share']:.0%}) "
            f"| {r['best_ms'] * 1e3:.1f} ({r['best_share']:.0%}) "
            f"| {r['general_ms'] / r['best_ms']:.2f}x "
            f"| {r['general_error']:.1e} / {r['best_error']:.1e} |")  # fmt: skip


HEADER = (
    "| shape | tokens | weights MB | general us (share) | small default us (share) "
    "| small best us (share) | best x general | errors general / best |\n"
    "|---|---|---|---|---|---|---|---|"
)


def _key(tiles: dict) -> str:
    return f"N{tiles['BLOCK_N']}_K{tiles['BLOCK_K']}_w{tiles['num_warps']}_s{tiles['num_stages']}"


def _tiles(key: str) -> dict:
    n, k, w, s = (int(part[1:]) for part in key.split("_"))
    return dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    parser.add_argument("--budget-s", type=float, default=150.0, help="sweep time, all cases")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    gpu = "cpu" if args.smoke else torch.cuda.get_device_name()
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    grid, bench = tile_grid(args.smoke), timer(args.smoke)
    start, rows = time.time(), []
    print(HEADER, flush=True)
    cases = [(shape, num_tokens) for shape in shapes for num_tokens in (1, 2)]
    for index, (shape, num_tokens) in enumerate(cases):  # an equal share of the budget each
        deadline = start + args.budget_s * (index + 1) / len(cases)
        rows.append(sweep_case(shape, num_tokens, dtype, device, grid, bench, deadline))
    entry = {gpu: {}}
    for shape in shapes:  # batch 1's best tiles per shape (batch 2 printed beside them)
        first = next(r for r in rows if r["shape"] == shape[0] and r["tokens"] == 1)
        entry[gpu][f"H={shape[2]},I={shape[3]}"] = {"1": first["best"]}
    result = dict(device=gpu, wall_s=time.time() - start, rows=rows, config_entry=entry)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("best tiles:", json.dumps(entry))


if __name__ == "__main__":
    main()
