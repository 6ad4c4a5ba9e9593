"""Sweep of the absorbed MLA paged decode kernels (issue 6): correctness, then timings, then the
best tile config per head bucket, ready for rayinfer/kernels/configs/mla_attention.json.

GPU (one H200, about 2 minutes with compiles):
    PYTHONPATH=$PWD python benchmarks/sweep_mla_decode.py --out $OUT/mla_sweep.json
CPU check of this script's logic (Triton interpreter, float32, tiny shapes):
    PYTHONPATH=$PWD python benchmarks/sweep_mla_decode.py --smoke --out /tmp/mla_sweep.json

Per config: a float32-reference check on a batch of mixed lengths (a NaN or a relative error above
2e-2 fails it; an OutOfResources compile is recorded and skipped), then the cases of its head
bucket timed with `triton.testing.do_bench` (median) against the same-run torch baseline (gather +
bmm/softmax/bmm, as in rayinfer/bench/attention_timings.py). Sweeping stops once the time budget
is spent; what was not run is recorded as such.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

if "--smoke" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from rayinfer.bench.attention_cases import gather_paged, paged_mla_case  # noqa: E402
from rayinfer.bench.attention_timings import launch_params_override  # noqa: E402
from rayinfer.kernels import mla_attention  # noqa: E402

PEAK_BYTES_PER_S = 4.23e12  # H200 HBM copy
LATENT_RANK, ROPE_DIM, BLOCK_SIZE = 512, 64, 16
SPLITS = dict(target_programs=528, min_tokens_per_split=256, max_splits=256)

# (batch, context) per head bucket: DeepSeek-V2-Lite / V3 at TP8 have 16 heads, V3 at TP1 128.
CASES = {
    16: [(1, 4096), (1, 131072), (8, 32768), (32, 8192), (128, 4096)],
    128: [(1, 131072), (8, 32768), (128, 4096)],
}


def tokens_major(block_h, block_n, warps, stages, **splits) -> dict:
    return dict(layout="tokens_major", BLOCK_H=block_h, BLOCK_N=block_n, num_warps=warps,
                num_stages=stages, **{**SPLITS, **splits})  # fmt: skip


def heads_major(block_h, block_n, warps, stages, **splits) -> dict:
    return {**tokens_major(block_h, block_n, warps, stages, **splits), "layout": "heads_major"}


def shared(block_h, block_n, warps, stages) -> dict:
    """The split-K kernel shared with GQA: the configs/mla_attention.json entries before this."""
    return {**tokens_major(block_h, block_n, warps, stages), "layout": "shared"}


# In priority order (the time budget may cut the tail); "shared" rows are the configs in use.
# From sm_90 compiles (Triton 3.9, ptxas): the 64-token tokens-major tile uses wgmma for both
# dots but needs ~165 KiB of shared memory at 2 stages and ~236 KiB at 3 (too much), and at 2
# stages a tile's copies are waited for right after being issued (no overlap within a program).
# 32-token tiles pipeline with no spills: 3 stages 91 KiB (two programs per SM), 4 stages
# 127 KiB (copies two tiles ahead), 6 stages 199 KiB (four tiles, 147 KiB, in flight); their
# scores dot is mma.sync (M = 32), the output dot wgmma (M = L). Deep pipelines want long splits
# (min_tokens_per_split 1024: 1 x 128k runs 128 programs of 32 tiles). 128 heads is
# compute-bound: heads-major 64-head tiles run both dots on wgmma.
CONFIGS = [
    (16, shared(16, 64, 4, 2)),
    (128, shared(64, 32, 8, 2)),
    (16, tokens_major(16, 32, 4, 4)),
    (128, heads_major(64, 32, 8, 3)),
    (16, tokens_major(16, 32, 4, 6)),
    (16, tokens_major(16, 32, 4, 6, min_tokens_per_split=1024)),
    (128, heads_major(64, 32, 8, 4)),
    (16, tokens_major(16, 32, 4, 3)),
    (16, tokens_major(16, 32, 8, 5)),
    (128, tokens_major(64, 32, 8, 3)),
    (16, heads_major(16, 32, 4, 4)),
    (128, heads_major(64, 64, 8, 2)),
]

SMOKE_CASES = {4: [(1, 40), (3, 17)], 20: [(2, 33)]}
SMOKE_CONFIGS = [
    (4, shared(16, 16, 4, 1)),
    (4, tokens_major(16, 16, 4, 1, target_programs=8, min_tokens_per_split=16)),
    (20, tokens_major(16, 32, 4, 1, target_programs=8, min_tokens_per_split=16)),
    (20, heads_major(16, 16, 4, 1, target_programs=8, min_tokens_per_split=16)),
]


class Setup:
    """Shapes, dtype and timer of a run: the H200 sweep or the CPU smoke test."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype = torch.float32 if smoke else torch.bfloat16
        self.latent_rank, self.rope_dim = (32, 16) if smoke else (LATENT_RANK, ROPE_DIM)
        self.cases = SMOKE_CASES if smoke else CASES
        self.configs = SMOKE_CONFIGS if smoke else CONFIGS
        self.check_lens = [1, 17, 40, 5] if smoke else [1, 17, 4096, 333, 20000]
        self.scale = (self.latent_rank // 4 + self.rope_dim) ** -0.5  # 192**-0.5 for DeepSeek

    def case(self, seq_lens: list[int], heads: int) -> dict:
        return paged_mla_case(seq_lens, heads, self.latent_rank, self.rope_dim, BLOCK_SIZE,
                              self.dtype, self.device)  # fmt: skip

    def time_ms(self, fn) -> float:
        fn()
        if self.smoke:  # no CUDA events on CPU: one wall-clock run
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        import triton.testing

        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def decode(case: dict, scale: float) -> torch.Tensor:  # [B, N, L]
    """The Triton decode with the tile config in force (see `run_config`)."""
    return mla_attention.mla_decode_attention(
        case["q_latent"], case["q_pe"], case["kv_cache"], case["block_tables"],
        case["seq_lens"], scale,
    )  # fmt: skip


def baseline_decode(case: dict, scale: float, seq_len: int) -> torch.Tensor:  # [B, N, L]
    """torch's absorbed MLA (attention_timings' baseline): gather, bmm, softmax, bmm."""
    latent_rank = case["q_latent"].shape[-1]
    context = gather_paged(case["kv_cache"], case["block_tables"], seq_len)  # [B, S, L + R]
    query = torch.cat((case["q_latent"], case["q_pe"]), dim=-1)  # [B, N, L + R]
    scores = torch.bmm(query, context.transpose(1, 2)).float() * scale  # [B, N, S]
    return torch.bmm(scores.softmax(-1).to(query.dtype), context[..., :latent_rank])


def check(setup: Setup, heads: int) -> dict:
    """Relative max error vs the float32 reference on a batch of mixed lengths."""
    case = setup.case(setup.check_lens, heads)
    ours = decode(case, setup.scale).float()
    reference = mla_attention.mla_decode_attention_reference(
        case["q_latent"].float(), case["q_pe"].float(), case["kv_cache"].float(),
        case["block_tables"], setup.check_lens, setup.scale,
    )  # fmt: skip
    error = ((ours - reference).abs().max() / reference.abs().max()).item()
    has_nan = bool(torch.isnan(ours).any())
    return dict(rel_error=error, ok=not has_nan and math.isfinite(error) and error < 2e-2)


def timing_row(setup: Setup, case: dict, batch: int, seq_len: int, ms: float) -> dict:
    kv_bytes = batch * seq_len * (setup.latent_rank + setup.rope_dim) * case["kv_cache"].itemsize
    rate = kv_bytes / ms / 1e-3  # bytes per second
    return dict(ms=ms, tb_per_s=rate / 1e12, hbm_share=rate / PEAK_BYTES_PER_S)


def build_cases(setup: Setup) -> dict:
    """{(heads, batch, context): case} built once and shared by every config."""
    return {
        (heads, batch, seq_len): setup.case([seq_len] * batch, heads)
        for heads, shapes in setup.cases.items()
        for batch, seq_len in shapes
    }


def time_baselines(setup: Setup, cases: dict) -> dict:
    rows = {}
    for (heads, batch, seq_len), case in cases.items():
        ms = setup.time_ms(lambda: baseline_decode(case, setup.scale, seq_len))  # noqa: B023
        rows[(heads, batch, seq_len)] = timing_row(setup, case, batch, seq_len, ms)
    return rows


def run_config(setup: Setup, heads: int, params: dict, cases: dict) -> dict:
    """Check, then time every case of the bucket; an exception (OutOfResources) is recorded."""
    result = dict(heads=heads, params=params, timings={})
    try:
        with launch_params_override("mla_attention", params):  # patched once, not per call
            result.update(check(setup, heads))
            if not result["ok"]:
                return result
            for (case_heads, batch, seq_len), case in cases.items():
                if case_heads != heads:
                    continue
                ms = setup.time_ms(lambda: decode(case, setup.scale))  # noqa: B023
                row = timing_row(setup, case, batch, seq_len, ms)
                result["timings"][f"{batch}x{seq_len}"] = row
    except Exception as error:  # noqa: BLE001 - a config that does not compile or run is skipped
        result.update(ok=False, error=f"{type(error).__name__}: {str(error)[:300]}")
    return result


def geometric_mean_ms(result: dict) -> float:
    times = [row["ms"] for row in result["timings"].values()]
    return math.exp(sum(map(math.log, times)) / len(times))


def best_per_bucket(setup: Setup, results: list[dict]) -> dict:
    """{heads: result} of the passing config with every case timed and the lowest geomean ms."""
    best = {}
    for heads, shapes in setup.cases.items():
        complete = [
            result
            for result in results
            if result["heads"] == heads
            and result.get("ok")
            and len(result["timings"]) == len(shapes)
        ]
        if complete:
            best[heads] = min(complete, key=geometric_mean_ms)
    return best


def config_name(params: dict) -> str:
    """e.g. "tokens_major H16 N32 w4 s6 tp528 m1024" (m: min_tokens_per_split)."""
    tiles = f"H{params['BLOCK_H']} N{params['BLOCK_N']} w{params['num_warps']}"
    splits = f"s{params['num_stages']} tp{params['target_programs']}"
    return f"{params['layout']} {tiles} {splits} m{params['min_tokens_per_split']}"


def config_status(result: dict) -> str:
    if result.get("skipped"):
        return "not run (time budget)"
    if result.get("error"):
        return f"FAILED {result['error']}"
    if not result.get("ok"):
        return f"FAILED rel_error {result['rel_error']:.2e}"
    return f"rel_error {result['rel_error']:.1e}, geomean {geometric_mean_ms(result):.3f} ms"


def print_table(results: list[dict], baselines: dict, best: dict) -> None:
    print("\nconfigs (geomean ms over the bucket's cases):")
    for index, result in enumerate(results):
        print(f"  #{index} {result['heads']:>3} heads {config_name(result['params'])}: "
              f"{config_status(result)}")  # fmt: skip
    print("\n| heads | B x ctx | baseline ms | best ms | KV TB/s | share of 4.23 TB/s | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for (heads, batch, seq_len), base in baselines.items():
        row = best.get(heads, {}).get("timings", {}).get(f"{batch}x{seq_len}")
        if row is None:
            print(f"| {heads} | {batch} x {seq_len} | {base['ms']:.3f} | - | - | - | - |")
            continue
        speedup = base["ms"] / row["ms"]
        print(f"| {heads} | {batch} x {seq_len} | {base['ms']:.3f} | {row['ms']:.3f} | "
              f"{row['tb_per_s']:.2f} | {row['hbm_share']:.0%} | {speedup:.2f}x |")  # fmt: skip
    for heads, result in best.items():
        print(f"best {heads} heads: {config_name(result['params'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    parser.add_argument("--budget-s", type=float, default=90.0, help="stop sweeping after this")
    args = parser.parse_args()
    started = time.perf_counter()
    setup = Setup(args.smoke)
    torch.manual_seed(0)
    cases = build_cases(setup)
    baselines = time_baselines(setup, cases)
    results = []
    for heads, params in setup.configs:
        if time.perf_counter() - started > args.budget_s:
            results.append(dict(heads=heads, params=params, timings={}, skipped=True))
            continue
        results.append(run_config(setup, heads, params, cases))
        print(f"[{time.perf_counter() - started:5.1f} s] {heads} heads {config_name(params)}: "
              f"{config_status(results[-1])}", flush=True)  # fmt: skip
    best = best_per_bucket(setup, results)
    device_name = "cpu" if args.smoke else torch.cuda.get_device_name()
    output = dict(
        device=device_name,
        wall_s=time.perf_counter() - started,
        baselines={f"{h} heads {b}x{s}": row for (h, b, s), row in baselines.items()},
        results=results,
        config_entry={device_name: {"default": {str(h): r["params"] for h, r in best.items()}}},
    )
    with open(args.out, "w") as file:
        json.dump(output, file, indent=1)
    print_table(results, baselines, best)
    print(f"\nwall {output['wall_s']:.1f} s; best configs -> {args.out} (config_entry)")


if __name__ == "__main__":
    main()
