"""`python -m rayinfer.bench kernels moe [--out FILE] [--sweep] [--shape S --ep N --tokens T..]`.

1. Correctness (relative error vs float32 references on random inputs).
2. With --sweep: tile configs per GEMM stage, the best written to the JSON (copy them into
   rayinfer/kernels/configs/{fused_moe,fp8_gemm}.json; `--config-out` writes the fused MoE ones
   in that file's layout).
3. Timings (`triton.testing.do_bench` medians) against torch baselines of the same run: fused MoE
   vs `torch._grouped_mm` and a per-expert loop (bf16 and FP8 experts), and vs a dense ceiling:
   cuBLAS batched matmuls over the same rows per expert, already gathered and evenly split;
   fp8_gemm vs `torch._scaled_mm` with per-tensor scales and dequantize + bf16.

Shapes: DeepSeek-V3 by default at 128 and 4,096 tokens; `--shape deepseek-v2-lite` for that
model's experts. `--ep N` times one expert-parallel rank: it holds E/N experts while tokens are
routed over all E (the other slots are skipped, as after dispatch).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import torch
import triton.testing

from rayinfer.bench import moe_cases
from rayinfer.bench.moe_cases import BF16, FP8, MoeShape
from rayinfer.kernels.fp8.fp8_gemm import fp8_gemm
from rayinfer.kernels.fp8.fp8_quant import fp8_quant
from rayinfer.kernels.moe import fused_moe as fused_moe_module
from rayinfer.kernels.moe.moe_align import moe_align

PEAK_BF16_TFLOPS, PEAK_FP8_TFLOPS, PEAK_BYTES_PER_S = 800.0, 1462.0, 4.23e12
GEMM_SHAPES = ((7168, 2048), (4096, 7168), (24576, 1536))  # DeepSeek-V3 (N, K)
TABLE_EXTRAS = ("grouped_mm_ms", "speedup_vs_grouped_mm", "loop_ms", "speedup_vs_loop",
                "ceiling_tflops", "vs_ceiling")  # fmt: skip


def bench_ms(fn, rep: int = 100) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def tile(bm, bn, bk, warps, stages, group_m=8) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m,
            "num_warps": warps, "num_stages": stages}  # fmt: skip


def with_tma(tiles: list[dict]) -> list[dict]:
    return tiles + [{**t, "USE_TMA": True} for t in tiles]


def moe_candidates(fp8: bool, num_tokens: int) -> dict[int, list[dict]]:
    """Row granule -> stage tiles to try (both GEMMs of one call share the granule: BLOCK_M, or
    TAIL_M for chunked tiles). Small and FP8: the sweep's best on DeepSeek-V3 experts; large bf16:
    wider, for models whose experts get thousands of rows (V2-Lite at 16k tokens)."""
    if num_tokens <= 256:
        if fp8:
            return {16: with_tma([tile(16, 32, 128, 4, 6, 1), tile(16, 64, 128, 4, 4, 1),
                                  tile(16, 128, 128, 4, 3, 1)])}  # fmt: skip
        return {16: with_tma([tile(16, 64, 128, 4, 5, 1), tile(16, 32, 128, 4, 5, 1)])}
    if fp8:  # 64 rows; 128 rows over two warpgroups (an expert's ~100 rows at 4k tokens once).
        # 64x128 with 8 warps: gate+up quantizes in its epilogue without spilling (sm_89/sm_90,
        # benchmarks/compile_moe_kernels.py); 128x128 gate+up spills there.
        return {
            64: with_tma([tile(64, 64, 128, 4, 4, 16), tile(64, 128, 128, 4, 4, 16),
                          tile(64, 64, 128, 4, 3, 8), tile(64, 128, 128, 8, 3, 16),
                          tile(64, 128, 128, 8, 4, 16)]),
            128: with_tma([tile(128, 64, 128, 8, 3, 16), tile(128, 64, 128, 4, 3, 16),
                           tile(128, 128, 128, 8, 3, 16)]),
        }  # fmt: skip
    rows_128 = [tile(128, n, 64, 8, stages, group) for n, stages, group in (
        (128, 3, 16), (256, 3, 16), (128, 4, 16), (256, 4, 16), (128, 3, 8), (256, 3, 8),
        (128, 3, 32), (256, 3, 32))] + [tile(128, 128, 128, 8, 3, 16)]  # fmt: skip
    rows_64 = [tile(64, 256, 64, 8, 3, 16), tile(64, 128, 64, 4, 4, 16),
               tile(64, 256, 64, 4, 3, 16), tile(64, 128, 128, 4, 3, 16)]  # fmt: skip
    # Chunks of 128 + 64 rows: w13 as one [rows, BN] product of BN/2 gate and BN/2 up columns.
    chunked = [{**tile(128, n, 64, 8, stages, group), "TAIL_M": 64, "USE_TMA": True,
                "GATE_UP_ONE_DOT": True} for n, stages, group in (
        (128, 3, 4), (128, 3, 16), (128, 4, 16), (256, 3, 16))]  # fmt: skip
    return {128: with_tma(rows_128), 64: with_tma(rows_64) + chunked}


def fits_registers(stage: str, t: dict) -> bool:
    """Gate+up without one dot keeps two [BM, BN] float32 accumulators: past 128x128 they spill."""
    two_accumulators = stage == "w13" and not ("TAIL_M" in t and t.get("GATE_UP_ONE_DOT"))
    return not two_accumulators or t["BLOCK_M"] * t["BLOCK_N"] <= 128 * 128


def gemm_candidates(m: int) -> list[dict]:
    """Run 2 kept TMA 64x128 (w4, s4) at M=4,096 and pointer 64x64 / 32x64 tiles at M=128."""
    if m <= 256:
        return [tile(64, 64, 128, 4, 5), tile(32, 64, 128, 4, 5), tile(64, 128, 128, 4, 4)]
    tiles = [tile(64, 128, 128, 4, 4), tile(64, 128, 128, 4, 4, 16), tile(64, 256, 128, 8, 3),
             tile(128, 128, 128, 8, 4), tile(64, 128, 128, 4, 3)]  # fmt: skip
    return [{**t, "USE_TMA": True} for t in tiles]


def stage_fns(x, experts, weights, ids, granule):
    """Callables running each GEMM stage alone with a given tile (for the sweep); chunked tiles
    build their chunks inside the call, as fused_moe does once for both stages. FP8 gate+up is
    timed with the down GEMM's activation quantization, as fused_moe runs it: in the epilogue
    where the tile `quantizes_in_epilogue`, else a pass of fp8_quant after it."""
    num_tokens, top_k = ids.shape
    alignment = moe_align(ids, experts.w13.shape[0], granule)
    inter = experts.w2.shape[2]
    act = torch.randn(num_tokens * top_k, inter, dtype=BF16, device=x.device)
    slot_out = torch.empty(num_tokens * top_k, x.shape[1], dtype=BF16, device=x.device)
    fp8 = experts.w13_scale is not None
    x_in, x_scale = fp8_quant(x) if fp8 else (x, None)
    act_in, act_scale = fp8_quant(act) if fp8 else (act, None)
    launch = fused_moe_module._launch_gemm
    w13_args = (x_in, experts.w13, torch.empty_like(act), x_scale, experts.w13_scale)
    w2_args = (act_in, experts.w2, slot_out, act_scale, experts.w2_scale)

    def gate_up(t):
        if fp8 and fused_moe_module.quantizes_in_epilogue(t, inter):
            launch(x_in, experts.w13, act_in, x_scale, experts.w13_scale, weights, alignment,
                   "w13", {"w13": t}, top_k, c_scale=act_scale, act_dtype=BF16)  # fmt: skip
            return
        launch(*w13_args, weights, alignment, "w13", {"w13": t}, top_k)
        if fp8:
            fp8_quant(w13_args[2])

    return {
        "w13": gate_up,
        "w2": lambda t: launch(*w2_args, weights, alignment, "w2", {"w2": t}, 1),
    }


def sweep_moe(x, experts, weights, ids, fp8) -> tuple[dict, list]:
    """Best {"w13": tile, "w2": tile} over the candidates; also every (stage, tile, ms)."""
    best, log = None, []
    for granule, tiles in moe_candidates(fp8, x.shape[0]).items():
        fns = stage_fns(x, experts, weights, ids, granule)
        chosen, total = {}, 0.0
        for stage, fn in fns.items():
            timed = []
            for t in (t for t in tiles if fits_registers(stage, t)):
                try:
                    timed.append((bench_ms(functools.partial(fn, t), rep=25), t))
                except Exception as error:  # out of shared memory / registers for this tile
                    log.append({"stage": stage, "tile": t, "error": str(error)[:200]})
            for ms, t in timed:
                log.append({"stage": stage, "tile": t, "ms": ms})
            if not timed:
                raise RuntimeError(f"every {stage} tile failed: {log[-1]}")
            ms, chosen[stage] = min(timed, key=lambda pair: pair[0])
            total += ms
        if best is None or total < best[0]:
            best = (total, chosen)
    return best[1], log


def time_moe(shape: MoeShape, experts, num_tokens, fp8, sweep, loop_baseline) -> dict:
    """fused_moe on this GPU's experts (E/ep of shape's E when expert-parallel), tokens routed
    over all E: timings, TFLOP/s of the held slots' work and the baselines of the same run."""
    device = experts.w13.device
    weights, ids = moe_cases.random_routing(num_tokens, shape, device, seed=num_tokens)
    x = torch.randn(num_tokens, shape.hidden, dtype=BF16, device=device)
    num_held = experts.w13.shape[0]
    held_slots = int((ids < num_held).sum())
    result = {"tokens": num_tokens, "dtype": "fp8" if fp8 else "bf16", "experts_held": num_held,
              "held_slots": held_slots}  # fmt: skip
    config = None
    if sweep:
        config, result["sweep"] = sweep_moe(x, experts, weights, ids, fp8)
        result["config"] = config
    scales = (experts.w13_scale, experts.w2_scale)
    run = functools.partial(fused_moe_module.fused_moe, x, experts.w13, experts.w2, weights, ids,
                            *scales)  # fmt: skip
    ours = bench_ms(functools.partial(run, config=config))
    result["align_ms"] = bench_ms(lambda: moe_align(ids, num_held, row_granule(config)))
    # The tuned tiles give the same result as the default ones (checked against float32).
    result["rel_err_vs_default_tiles"] = moe_cases.relative_error(run(config=config), run())
    flops = 2 * held_slots * 3 * shape.hidden * shape.intermediate
    weight_bytes = experts.w13.numel() * experts.w13.element_size() * 3 / 2
    result.update(ms=ours, tflops=flops / ours / 1e9, weight_gb=weight_bytes / 1e9,
                  hbm_share=weight_bytes / (ours / 1e3) / PEAK_BYTES_PER_S)  # fmt: skip
    if fp8:
        return result
    ceiling = bench_ms(dense_ceiling(experts, held_slots))
    result.update(ceiling_ms=ceiling, ceiling_tflops=flops / ceiling / 1e9)
    result["vs_ceiling"] = ceiling / ours
    if num_held < shape.num_experts:  # the torch baselines below need every expert held
        return result
    base = bench_ms(lambda: moe_cases.grouped_mm_moe(x, experts, weights, ids))
    baseline_out = moe_cases.grouped_mm_moe(x, experts, weights, ids)
    result["rel_err_vs_grouped_mm"] = moe_cases.relative_error(run(config=config), baseline_out)
    result.update(grouped_mm_ms=base, speedup_vs_grouped_mm=base / ours)
    if loop_baseline:
        loop = bench_ms(lambda: moe_cases.per_expert_loop_moe(x, experts, weights, ids), rep=1)
        result.update(loop_ms=loop, speedup_vs_loop=loop / ours)
    return result


def row_granule(config: dict | None) -> int:
    return fused_moe_module.row_granule(config or fused_moe_module.DEFAULT_CONFIG)


def dense_ceiling(experts, held_slots: int):
    """cuBLAS at the same work with nothing to gather: every held expert gets an equal share of
    the rows, already contiguous, gate+up then down as two batched matmuls (no SiLU, no sum)."""
    num_held, two_i, hidden = experts.w13.shape
    rows = -(-held_slots // num_held)
    x = torch.randn(num_held, rows, hidden, dtype=BF16, device=experts.w13.device)
    act = torch.randn(num_held, rows, two_i // 2, dtype=BF16, device=x.device)
    w13_t, w2_t = experts.w13.transpose(1, 2), experts.w2.transpose(1, 2)
    return lambda: (torch.bmm(x, w13_t), torch.bmm(act, w2_t))


def check_held_moe(shape: MoeShape, experts, num_tokens: int = 256) -> float:
    """Relative error of bf16 fused_moe on held experts only, against float32."""
    device = experts.w13.device
    weights, ids = moe_cases.random_routing(num_tokens, shape, device, seed=2)
    x = torch.randn(num_tokens, shape.hidden, dtype=BF16, device=device)
    out = fused_moe_module.fused_moe(x, experts.w13, experts.w2, weights, ids)
    held = moe_cases.held_slots_only(weights, ids, experts.w13.shape[0])
    return moe_cases.relative_error(out, moe_cases.float32_moe_reference(x, experts, *held))


def time_fp8_gemm(m, n, k, sweep) -> dict:
    device = "cuda"
    a, a_scale = fp8_quant(torch.randn(m, k, dtype=BF16, device=device), column_major_scales=True)
    b = torch.randn(n, k, device=device).to(FP8)
    b_scale = torch.rand(n // 128, k // 128, device=device) + 0.5
    result, config = {"M": m, "N": n, "K": k}, None
    if sweep:
        tiles = gemm_candidates(m)
        timed = []
        for t in tiles:
            try:
                run = functools.partial(fp8_gemm, a, a_scale, b, b_scale, config=t)
                timed.append((bench_ms(run, rep=25), t))
            except Exception as error:
                result.setdefault("errors", []).append(f"{t}: {str(error)[:120]}")
        result["sweep"] = [{"tile": t, "ms": ms} for ms, t in timed]
        config = result["config"] = min(timed, key=lambda pair: pair[0])[1]
    flops = 2 * m * n * k
    ours = bench_ms(lambda: fp8_gemm(a, a_scale, b, b_scale, config=config))
    row_major = a_scale.contiguous()
    result["row_major_scales_ms"] = bench_ms(
        lambda: fp8_gemm(a, row_major, b, b_scale, config=config)
    )
    one = torch.ones((), device=device)
    b_t = b.t()
    scaled = bench_ms(lambda: torch._scaled_mm(a, b_t, scale_a=one, scale_b=one, out_dtype=BF16))
    b_bf16 = torch.randn(n, k, dtype=BF16, device=device)
    a_bf16 = torch.randn(m, k, dtype=BF16, device=device)
    bf16 = bench_ms(lambda: a_bf16 @ b_bf16.t())
    dequant = bench_ms(lambda: _dequant_matmul(a, a_scale, b, b_scale))
    result.update(
        ms=ours, tflops=flops / ours / 1e9, scaled_mm_tflops=flops / scaled / 1e9,
        ratio_vs_scaled_mm=scaled / ours, bf16_tflops=flops / bf16 / 1e9,
        dequant_bf16_tflops=flops / dequant / 1e9, speedup_vs_dequant=dequant / ours,
    )  # fmt: skip
    return result


def _dequant_matmul(a, a_scale, b, b_scale):
    a_full = a.to(BF16) * a_scale.repeat_interleave(128, 1).to(BF16)
    b_full = b.to(BF16) * b_scale.repeat_interleave(128, 0).repeat_interleave(128, 1).to(BF16)
    return a_full @ b_full.t()


def print_table(results: dict) -> None:
    print("\ncorrectness:", json.dumps(results["checks"]))
    for r in (r for r in results["moe"] if "error" not in r):
        extra = "".join(f" {k}={r[k]:.3g}" for k in TABLE_EXTRAS if k in r)
        print(f"moe {r['dtype']} T={r['tokens']}: {r['ms']:.3f} ms {r['tflops']:.0f} TFLOP/s "
              f"hbm={r['hbm_share']:.0%}{extra} cfg={r.get('config')}")  # fmt: skip
    for r in (r for r in results["fp8_gemm"] if "error" not in r):
        print(f"fp8_gemm M={r['M']} N={r['N']} K={r['K']}: {r['tflops']:.0f} TFLOP/s, scaled_mm "
              f"{r['scaled_mm_tflops']:.0f} (x{r['ratio_vs_scaled_mm']:.2f}), bf16 "
              f"{r['bf16_tflops']:.0f}, dequant+bf16 {r['dequant_bf16_tflops']:.0f} "
              f"cfg={r.get('config')}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayinfer.bench kernels moe")
    parser.add_argument("--out", default=None, help="write all results to this JSON file")
    parser.add_argument("--sweep", action="store_true", help="try tile configs first")
    parser.add_argument("--sweep-dtypes", nargs="+", choices=["bf16", "fp8"],
                        default=["bf16", "fp8"], help="with --sweep: the experts swept (the "
                        "others run their shipped tiles)")  # fmt: skip
    parser.add_argument("--no-loop", action="store_true", help="skip the per-expert loop baseline")
    parser.add_argument("--shape", choices=sorted(moe_cases.MOE_SHAPES), default="deepseek-v3")
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks: time one rank holding E/ep experts",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[128, 4096],
        help="tokens per call (after dispatch, for --ep)",
    )
    parser.add_argument(
        "--bf16-only", action="store_true", help="only bf16 experts: no FP8 experts, no fp8_gemm"
    )
    parser.add_argument(
        "--config-out",
        default=None,
        help="with --sweep: the best fused MoE tiles in configs/fused_moe.json's"
        " layout ({device: {shape key: {tokens: config}}})",
    )
    args = parser.parse_args(argv)
    shape = moe_cases.MOE_SHAPES[args.shape]
    if args.ep < 1 or shape.num_experts % args.ep:
        parser.error(f"--ep {args.ep} must divide the {shape.num_experts} experts of {args.shape}")
    if not torch.cuda.is_available():
        print("kernels moe: no CUDA device; nothing to measure")
        return 0
    held_shape = dataclasses.replace(shape, num_experts=shape.num_experts // args.ep)
    results = {"device": torch.cuda.get_device_name(), "shape": args.shape, "ep": args.ep}
    bf16 = moe_cases.random_experts(held_shape, fp8=False, device="cuda")
    fp8 = None if args.bf16_only else moe_cases.random_experts(held_shape, fp8=True, device="cuda")
    try:
        if fp8 is None or args.ep > 1:
            results["checks"] = {"fused_moe_bf16_held": check_held_moe(shape, bf16)}
        else:
            results["checks"] = moe_cases.correctness_checks(shape, bf16, fp8, "cuda")
    except Exception as error:  # still time the kernels; the error is in the results
        results["checks"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    print("correctness:", json.dumps(results["checks"]), flush=True)
    results["moe"], results["fp8_gemm"] = [], []
    for experts, is_fp8 in ((bf16, False), (fp8, True)):
        for num_tokens in args.tokens if experts is not None else ():
            run = functools.partial(time_moe, shape, experts, num_tokens, is_fp8)
            sweep = args.sweep and ("fp8" if is_fp8 else "bf16") in args.sweep_dtypes
            record(results, "moe", functools.partial(run, sweep, not args.no_loop), args.out)
    del bf16, fp8
    for n, k in GEMM_SHAPES if not args.bf16_only else ():
        for m in (128, 4096):
            record(
                results, "fp8_gemm", functools.partial(time_fp8_gemm, m, n, k, args.sweep), args.out
            )
    print_table(results)
    if args.sweep and args.config_out:
        write_tile_configs(results, held_shape, args.config_out)
    return 0


def write_tile_configs(results: dict, held_shape: MoeShape, path: str) -> None:
    """The swept fused MoE tiles keyed like configs/fused_moe.json (by the held experts' shape)."""
    by_shape: dict[str, dict] = {}
    for r in results["moe"]:
        if "config" in r:
            key = (f"{r['dtype']},E={held_shape.num_experts},I={held_shape.intermediate},"
                   f"H={held_shape.hidden}")  # fmt: skip
            by_shape.setdefault(key, {})[str(r["tokens"])] = r["config"]
    with open(path, "w") as f:
        json.dump({results["device"]: by_shape}, f, indent=1)


def record(results: dict, section: str, run, out: str | None) -> None:
    """Run one measurement; keep going on failure; rewrite the JSON after each (partial runs)."""
    try:
        result = run()
    except Exception as error:  # a failed case must not lose the others' numbers
        result = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    results[section].append(result)
    print(section, {k: v for k, v in result.items() if k != "sweep"}, flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
