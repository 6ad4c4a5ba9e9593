"""Sweep of the absorbed MLA paged decode kernels (issue 6): correctness, then timings, then the
best tile config per head bucket, ready for rayinfer/kernels/configs/mla_attention.json.

GPU (one H200, under 100 s with compiles):
    PYTHONPATH=$PWD python benchmarks/sweep_mla_decode.py --out $OUT/mla_sweep.json
CPU check of this script's logic (Triton interpreter, float32, tiny shapes):
    PYTHONPATH=$PWD python benchmarks/sweep_mla_decode.py --smoke --out /tmp/mla_sweep.json

Per config: a float32-reference check on a batch of mixed lengths (a NaN or a relative error above
2e-2 fails it; an OutOfResources compile is recorded and skipped), then the cases of its head
bucket timed from a CUDA graph (`triton.testing.do_bench_cudagraph`, median; the split and combine
kernels apart with `do_bench`) against the same-run torch baseline (gather + bmm/softmax/bmm, as in
rayinfer/bench/attention_timings.py, plain launches). Sweeping stops once the time budget
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
from rayinfer.kernels.mla import mla_attention  # noqa: E402
from rayinfer.kernels.mla.mla_decode import triton_fallback  # noqa: E402
from rayinfer.kernels.tile_configs import pick_tile_config  # noqa: E402

PEAK_BYTES_PER_S = 4.23e12  # H200 HBM copy
LATENT_RANK, ROPE_DIM, BLOCK_SIZE = 512, 64, 16
SPLITS = dict(target_programs=528, min_tokens_per_split=256, max_splits=256)

# (batch, context) per head bucket: DeepSeek-V2-Lite / V3 at TP8 have 16 heads, V3 at TP1 128.
CASES = {
    16: [(1, 512), (1, 4096), (1, 131072), (8, 32768), (32, 8192), (128, 4096)],
    32: [(1, 131072), (8, 32768), (32, 8192)],  # DeepSeek-V3 at TP=4: the 128-head entry today
    128: [(1, 131072), (8, 32768), (128, 4096)],
}


def tokens_major(block_h, block_n, warps, stages, **options) -> dict:
    """options: split knobs (target_programs, min_tokens_per_split, max_splits) and launch
    options (USE_TMA, WARP_SPECIALIZE, EVICT_FIRST; see mla_attention.mla_decode_launches)."""
    return dict(layout="tokens_major", BLOCK_H=block_h, BLOCK_N=block_n, num_warps=warps,
                num_stages=stages, **{**SPLITS, **options})  # fmt: skip


def heads_major(block_h, block_n, warps, stages, **options) -> dict:
    return {**tokens_major(block_h, block_n, warps, stages, **options), "layout": "heads_major"}


TMA = dict(USE_TMA=True)
WS = dict(USE_TMA=True, WARP_SPECIALIZE=True)
EVICT = dict(EVICT_FIRST=True)
SHIPPED = {  # configs/mla_attention.json's H200 entries: the same-run reference
    heads: pick_tile_config("mla_attention", "NVIDIA H200", "default", heads)
    for heads in (16, 32, 128)
}
TRITON_16 = triton_fallback(SHIPPED[16])  # their Triton tiles (the entries' "fallback")
TRITON_128 = triton_fallback(SHIPPED[128])

# In priority order (the time budget may cut the tail); the shipped configs first. Options the
# Triton kernel offers, and what sweeping them on an H200 showed:
# - TABLE_IN_LOOP loads a tile's block-table entries in its own iteration, so the pipeliner
#   issues them as an asynchronous indirect load a stage ahead of the rows (sm_90 compiles show
#   the entries loaded one iteration ahead stay synchronous): faster for 128 heads
#   (heads-major 64x64, 3 stages, its fallback), slower for 16.
# - min_tokens_per_split spreads a short context's one split over more programs: a batch-1 split
#   runs its tiles one after another, so the 16-head fallback splits down to 32 tokens (chosen
#   from the engine's decode profile; do_bench at these sizes measures launch cost).
# - TMA tiles, evict-first loads, deeper pipelines and other split counts do not beat the
#   shipped tiles. Configs timed in a fresh process's first ~20 s read ~2x slow, so
#   `warm_up_gpu` runs first and the shipped config is timed first and last.
TIL = dict(TABLE_IN_LOOP=True)
EVICT32 = dict(min_tokens_per_split=32, EVICT_FIRST=True)


# The warp-specialized Gluon split kernel (mla_decode_hopper): layout "gluon_ws" (heads-major: a
# TMA producer warp, 64-token tiles of four cache blocks, two consumers each with half the
# latent columns) wins at 64-128 heads; at 16 heads its 64-row query tile is three quarters
# padding, so "gluon_ws_tokens" (the tile's 64 tokens are wgmma's rows and the heads its
# columns, one consumer warpgroup) serves 16 and 32 heads. Off Hopper both fall back to
# heads-major Triton tiles.
def gluon_ws(block_h, layout="gluon_ws", **splits) -> dict:
    return {**heads_major(block_h, 64, 4, 2, **{"min_tokens_per_split": 64, **splits}),
            "layout": layout}  # fmt: skip


def gluon_tokens(block_h, **splits) -> dict:
    return gluon_ws(block_h, "gluon_ws_tokens", **splits)


# With 168-225 KiB of shared memory a program, one program runs per SM, so the waves decide:
# "whole_waves" launches at most target_programs (the SM count) programs, e.g. 32 x 8k in 4
# splits rather than a second wave of 28 programs after 132.
WAVES = dict(target_programs=132, whole_waves=True)
# The heads-major form computes a tile's scores once (warpgroup 0 hands p and the rescale
# factors to warpgroup 1 through shared memory): 8.9 instead of 13.6 MFLOP of wgmma per 64-token
# tile at 64 heads, where 128 heads are compute-bound. COMBINE_MIN_PROGRAMS narrows the
# combine's latent columns only until that many programs run: a single long context's 16
# (sequence, head) rows each reduce 128 splits, while a batch already fills the GPU.
# The list below compares the 32-head bucket (DeepSeek-V3 at TP=4) against the 128-head entry
# (heads-major, 64-row tiles: half padding) and tokens-major over 16 heads (two programs a
# sequence); benchmarks/RESULTS.md has the shipped configs' figures.
CONFIGS = [
    (32, SHIPPED[32]),
    (32, SHIPPED[128]),
    (32, {**gluon_tokens(16, **WAVES), "COMBINE_MIN_PROGRAMS": 132}),
    (32, SHIPPED[32]),
]

SMOKE_CASES = {4: [(1, 40), (3, 17)], 20: [(2, 33)]}
SMOKE_SPLITS = dict(target_programs=8, min_tokens_per_split=16)
SMOKE_CONFIGS = [
    (4, tokens_major(16, 16, 4, 1, **SMOKE_SPLITS)),
    (4, tokens_major(16, 16, 4, 1, **SMOKE_SPLITS, **WS)),
    (20, tokens_major(16, 32, 4, 1, **SMOKE_SPLITS, **EVICT)),
    (20, heads_major(16, 16, 4, 1, **SMOKE_SPLITS, **TMA)),
    (20, tokens_major(16, 16, 4, 1, **SMOKE_SPLITS, **TIL)),
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

    def time_ms(self, fn, graph: bool = False) -> float:
        """Median ms of fn. graph: replayed from a CUDA graph (as a decode step runs it), so
        that the host's launch cost does not hide the kernel's time: with plain launches the
        small and mid cases measured mostly that cost, which drifted 2x within a run."""
        fn()
        if self.smoke:  # no CUDA events on CPU: one wall-clock run
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        import triton.testing

        torch.cuda.synchronize()
        if graph:
            return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median")
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
    """The torch baseline per case, from a CUDA graph as our kernel is timed (plain launches
    where it cannot be captured: recorded in the row's "graph")."""
    rows = {}
    for (heads, batch, seq_len), case in cases.items():
        fn = lambda: baseline_decode(case, setup.scale, seq_len)  # noqa: B023, E731
        try:
            ms, graph = setup.time_ms(fn, graph=True), True
        except Exception:  # noqa: BLE001 - e.g. a host sync inside: timed with plain launches
            ms, graph = setup.time_ms(fn), False
        rows[(heads, batch, seq_len)] = dict(timing_row(setup, case, batch, seq_len, ms),
                                             graph=graph)  # fmt: skip
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
                ms = setup.time_ms(lambda: decode(case, setup.scale), graph=True)  # noqa: B023
                row = timing_row(setup, case, batch, seq_len, ms)
                result["timings"][f"{batch}x{seq_len}"] = row
    except Exception as error:  # noqa: BLE001 - a config that does not compile or run is skipped
        result.update(ok=False, error=f"{type(error).__name__}: {str(error)[:300]}")
    return result


def time_stages(setup: Setup, params: dict, cases: dict, heads: int) -> dict:
    """{"BxS": split kernel ms, combine ms, splits, programs} of one config, each launch timed on
    its own (do_bench flushes L2 before each call, so the combine reads its partials from HBM:
    an upper bound; in the decode they were just written and mostly sit in L2)."""
    from rayinfer.kernels.attention.paged_attention import choose_split
    from rayinfer.kernels.triton_compat import triton

    rows = {}
    for (case_heads, batch, seq_len), case in cases.items():
        if case_heads != heads:
            continue
        kv_cache = case["kv_cache"]
        slots = kv_cache.view(-1, kv_cache.shape[-1])
        _, split_fn, combine_fn = mla_attention.mla_decode_launches(
            case["q_latent"], case["q_pe"], slots, case["block_tables"], case["seq_lens"],
            setup.scale, params, kv_cache.shape[1],
        )  # fmt: skip
        block_h = max(16, triton.next_power_of_2(min(params["BLOCK_H"], heads)))
        groups = -(-heads // block_h)
        split = choose_split(batch, groups, case["block_tables"].shape[1] * BLOCK_SIZE, params)
        row = dict(split_ms=setup.time_ms(split_fn), splits=split.num_splits,
                   tokens_per_split=split.tokens_per_split,
                   programs=batch * groups * split.num_splits)  # fmt: skip
        row["combine_ms"] = setup.time_ms(combine_fn) if combine_fn is not None else 0.0
        rows[f"{batch}x{seq_len}"] = row
    return rows


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
    """e.g. "tokens_major H16 N16 w4 s4 tp396 m256 max512 tma" (m: min_tokens_per_split, max:
    max_splits where not 256)."""
    tiles = f"H{params['BLOCK_H']} N{params['BLOCK_N']} w{params['num_warps']}"
    splits = f"s{params['num_stages']} tp{params['target_programs']}"
    options = [name for key, name in OPTION_NAMES.items() if params.get(key)]
    if params["max_splits"] != SPLITS["max_splits"]:
        options.insert(0, f"max{params['max_splits']}")
    if "COMBINE_BLOCK_L" in params:
        options.append(f"cL{params['COMBINE_BLOCK_L']}")
    if "COMBINE_MIN_PROGRAMS" in params:
        options.append(f"cP{params['COMBINE_MIN_PROGRAMS']}")
    return " ".join([params["layout"], tiles, splits, f"m{params['min_tokens_per_split']}",
                     *options])  # fmt: skip


OPTION_NAMES = dict(USE_TMA="tma", WARP_SPECIALIZE="ws", EVICT_FIRST="evict", whole_waves="waves")


def config_status(result: dict) -> str:
    if result.get("skipped"):
        return "not run (time budget)"
    if result.get("error"):
        return f"FAILED {result['error']}"
    if not result.get("ok"):
        return f"FAILED rel_error {result['rel_error']:.2e}"
    return f"rel_error {result['rel_error']:.1e}, geomean {geometric_mean_ms(result):.3f} ms"


def print_table(results: list[dict], baselines: dict, best: dict, stages: dict) -> None:
    print("\nconfigs (geomean ms over the bucket's cases):")
    for index, result in enumerate(results):
        print(f"  #{index} {result['heads']:>3} heads {config_name(result['params'])}: "
              f"{config_status(result)}")  # fmt: skip
    shipped = {
        heads: next((r for r in results if r["heads"] == heads and r["params"] == params), {})
        for heads, params in SHIPPED.items()
    }
    print("\nsplit kernel / combine timed apart (combine after an L2 flush: an upper bound):")
    for (name, heads), rows in stages.items():
        for shape, row in rows.items():
            print(f"  {name} {heads} heads {shape}: split {row['split_ms']:.3f} ms, combine "
                  f"{row['combine_ms']:.3f} ms; {row['splits']} splits of "
                  f"{row['tokens_per_split']} tokens, {row['programs']} programs")  # fmt: skip
    for heads, result in best.items():
        print(f"best {heads} heads: {config_name(result['params'])}")
    print("\n| heads | B x ctx | baseline ms | shipped ms | best ms | KV TB/s | share of 4.23 TB/s "
          "| speed-up |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for (heads, batch, seq_len), base in baselines.items():
        key = f"{batch}x{seq_len}"
        ref = shipped.get(heads, {}).get("timings", {}).get(key)
        ref_ms = f"{ref['ms']:.3f}" if ref else "-"
        row = best.get(heads, {}).get("timings", {}).get(key)
        if row is None:
            cells = f"{heads} | {batch} x {seq_len} | {base['ms']:.3f} | {ref_ms}"
            print(f"| {cells} | - | - | - | - |")
            continue
        speedup = base["ms"] / row["ms"]
        print(f"| {heads} | {batch} x {seq_len} | {base['ms']:.3f} | {ref_ms} | {row['ms']:.3f} | "
              f"{row['tb_per_s']:.2f} | {row['hbm_share']:.0%} | {speedup:.2f}x |")  # fmt: skip


def warm_up_gpu(seconds: float) -> None:
    """Matmuls for `seconds` before anything is timed: configs timed in the first ~20 s of a
    fresh machine can read up to 2x slower than the same config later in the run."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes")
    parser.add_argument("--budget-s", type=float, default=70.0, help="stop sweeping after this")
    parser.add_argument("--warmup-s", type=float, default=10.0, help="GPU busy before timing")
    args = parser.parse_args()
    started = time.perf_counter()
    setup = Setup(args.smoke)
    if not args.smoke:
        warm_up_gpu(args.warmup_s)
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
    stages = {}  # the best and the shipped config per bucket: split kernel and combine apart
    for heads, result in best.items():
        for name, params in (("best", result["params"]), ("shipped", SHIPPED.get(heads))):
            if params is None or (name == "shipped" and params == result["params"]):
                continue
            try:
                stages[(name, heads)] = time_stages(setup, params, cases, heads)
            except Exception as error:  # noqa: BLE001 - reported, the table still prints
                print(f"stage timing of {name} {heads} heads failed: {error}")
    device_name = "cpu" if args.smoke else torch.cuda.get_device_name()
    output = dict(
        device=device_name,
        wall_s=time.perf_counter() - started,
        baselines={f"{h} heads {b}x{s}": row for (h, b, s), row in baselines.items()},
        results=results,
        stages={f"{name} {heads} heads": rows for (name, heads), rows in stages.items()},
        config_entry={device_name: {"default": {str(h): r["params"] for h, r in best.items()}}},
    )
    with open(args.out, "w") as file:
        json.dump(output, file, indent=1)
    print_table(results, baselines, best, stages)
    print(f"\nwall {output['wall_s']:.1f} s; best configs -> {args.out} (config_entry)")


if __name__ == "__main__":
    main()
