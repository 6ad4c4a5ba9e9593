"""Issue 6 sweep: fused MoE (bf16, DeepSeek-V3 experts) and fp8_gemm (W8A8 block scales) on one GPU.

    PYTHONPATH=$PWD python benchmarks/sweep_moe_fp8.py --out $OUT/moe_fp8_sweep.json
    PYTHONPATH=$PWD python benchmarks/sweep_moe_fp8.py --smoke   # CPU, interpreter, tiny shapes

1. Every candidate config is checked against a float32 reference on random inputs (relative
   error; NaN fails; a config that runs out of resources is skipped and recorded).
2. `triton.testing.do_bench` medians, baselines in the same run: fused MoE at 4,096 and 128 tokens
   vs `torch._grouped_mm` (with the stage split of the best config); fp8_gemm at M = 4,096 and 128
   on the three V3 shapes vs per-tensor `torch._scaled_mm` and torch's blockwise scaled mm if this
   torch has it.
3. The best configs go to the JSON ("configs" -> paste into rayinfer/kernels/configs/), a short
   table is printed last. A time budget (--budget-s) skips what is left once spent.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from rayinfer.bench import moe_cases  # noqa: E402
from rayinfer.bench.moe_cases import Experts, MoeShape  # noqa: E402
from rayinfer.kernels.fp8 import fp8_gemm as fp8_gemm_module  # noqa: E402
from rayinfer.kernels.fp8.fp8_gemm import fp8_gemm, fp8_gemm_reference  # noqa: E402
from rayinfer.kernels.fp8.fp8_quant import fp8_quant  # noqa: E402
from rayinfer.kernels.moe import fused_moe as fused_moe_module  # noqa: E402
from rayinfer.kernels.moe.moe_align import moe_align  # noqa: E402
from rayinfer.kernels.tile_configs import pick_tile_config  # noqa: E402

GEMM_SHAPES = ((7168, 2048), (4096, 7168), (24576, 1536))  # DeepSeek-V3 (N, K)
MAX_REL_ERR = {"moe": 1e-2, "fp8_gemm": 1e-2}
MOE_SHARE_OF_BUDGET = 0.6  # the rest of --budget-s is the fp8_gemm sweep's


def tile(bm, bn, bk, warps, stages, group_m=8, **extra) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m,
            "num_warps": warps, "num_stages": stages, **extra}  # fmt: skip


@dataclass
class Setup:
    """What differs between the H200 run and the CPU smoke run."""

    smoke: bool
    device: str
    dtype: torch.dtype
    moe_shape: MoeShape
    moe_tokens: tuple[int, ...]
    gemm_shapes: tuple[tuple[int, int], ...]
    gemm_rows: tuple[int, ...]
    deadline: float
    skipped: list = field(default_factory=list)

    def out_of_time(self, what: str) -> bool:
        if time.monotonic() < self.deadline:
            return False
        self.skipped.append(what)
        return True


def make_setup(smoke: bool, budget_s: float) -> Setup:
    deadline = time.monotonic() + budget_s
    if smoke:
        shape = MoeShape(num_experts=8, hidden=256, intermediate=128, top_k=6)
        return Setup(True, "cpu", torch.float16, shape, (48, 4), ((256, 384),), (40, 8), deadline)
    gpu_rows = (4096, 128)
    return Setup(False, "cuda", torch.bfloat16, MoeShape(), (4096, 128), GEMM_SHAPES, gpu_rows,
                 deadline)  # fmt: skip


# ---------------------------------------------------------------- candidates


def moe_candidates(setup: Setup, num_tokens: int) -> dict[str, dict]:
    """name -> {"w13": tile, "w2": tile}. "tuned" is what configs/fused_moe.json gives today."""
    if setup.smoke:
        small = tile(16, 32, 32, 4, 2, 4)
        chunk = {**small, "TAIL_M": 8}
        return {"tuned": {"w13": small, "w2": small}, "chunk": {"w13": chunk, "w2": chunk},
                "chunk_one_dot": {"w13": {**chunk, "GATE_UP_ONE_DOT": True, "USE_TMA": True},
                                  "w2": chunk}}  # fmt: skip
    shape = setup.moe_shape
    key = f"bf16,E={shape.num_experts},I={shape.intermediate},H={shape.hidden}"
    tuned = pick_tile_config("fused_moe", torch.cuda.get_device_name(), key, num_tokens)
    candidates = {"tuned": tuned or fused_moe_module.DEFAULT_CONFIG}
    if num_tokens < 2048:  # ~4 rows per expert: chunks do not apply
        return candidates
    # One program per expert chunk of 128 + 64 rows (64-row tiles): each weight tile is read once
    # per K step for both accumulators. GATE_UP_ONE_DOT: a w13 tile is 64 gate + 64 up rows, one
    # [192, 128] product (96 accumulator registers a thread at 8 warps); without it, BLOCK_N 64.
    # No two programs share a weight tile (one chunk per expert here), so GROUP_M only keeps a
    # chunk's activation rows in L2: small groups (4 chunks x all column tiles) should do.
    chunk = {"TAIL_M": 64, "USE_TMA": True}
    one_dot = {**chunk, "GATE_UP_ONE_DOT": True}
    for stages, group in ((3, 4), (4, 4)):
        candidates[f"chunk_one_dot_s{stages}_g{group}"] = {
            "w13": tile(128, 128, 64, 8, stages, group, **one_dot),
            "w2": tile(128, 128, 64, 8, stages, group, **chunk),
        }
    # 32-row tiles: chunks of 128 + 32 rows cover 129..160 rows (~47% of experts at 4,096
    # tokens) with 160 rows, not 192; the 32-row tail product is too short for wgmma.
    tail32 = {"TAIL_M": 32, "USE_TMA": True}
    candidates["chunk_tail32_one_dot_s3_g4"] = {
        "w13": tile(128, 128, 64, 8, 3, 4, GATE_UP_ONE_DOT=True, **tail32),
        "w2": tile(128, 128, 64, 8, 3, 4, **tail32),
    }
    candidates["chunk_two_dots_s3_g4"] = {"w13": tile(128, 64, 64, 8, 3, 4, **chunk),
                                          "w2": tile(128, 128, 64, 8, 3, 4, **chunk)}  # fmt: skip
    no_tma = {"TAIL_M": 64}
    candidates["chunk_one_dot_pointers_s3_g4"] = {
        "w13": tile(128, 128, 64, 8, 3, 4, GATE_UP_ONE_DOT=True, **no_tma),
        "w2": tile(128, 128, 64, 8, 3, 4, **no_tma),
    }
    return candidates


def gemm_candidates(setup: Setup, n: int, k: int, m: int) -> dict[str, dict]:
    """name -> fp8_gemm config. K_UNROLL 2: two K blocks per iteration (dots before rescale)."""
    if setup.smoke:
        small = tile(16, 32, 64, 4, 2, 2)
        return {"tuned": small, "unroll2": {**small, "K_UNROLL": 2},
                "unroll2_tma": {**small, "K_UNROLL": 2, "USE_TMA": True}}  # fmt: skip
    tuned = pick_tile_config("fp8_gemm", torch.cuda.get_device_name(), f"N={n},K={k}", m)
    tuned = tuned or dict(fp8_gemm_module.DEFAULT_CONFIG)  # a GPU without tuned tiles
    if m <= 256:  # a stage of an unrolled loop holds two K blocks: about half the stages
        unrolled = {**tuned, "K_UNROLL": 2, "num_stages": tuned["num_stages"] // 2 + 1}
        return {"tuned": tuned, "tuned_unroll2": unrolled}
    return {
        "tuned": tuned,
        "64x128_w4_s3_u2": tile(64, 128, 128, 4, 3, 8, K_UNROLL=2, USE_TMA=True),
        "128x128_w8_s2_u2": tile(128, 128, 128, 8, 2, 8, K_UNROLL=2, USE_TMA=True),
        "128x128_w8_s4_u1": tile(128, 128, 128, 8, 4, 8, K_UNROLL=1, USE_TMA=True),
    }


# ---------------------------------------------------------------- timing and checks


def bench_ms(setup: Setup, fn, rep: int = 60) -> float:
    fn()
    if setup.smoke:  # the interpreter: one timed call, only to exercise the code
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return moe_cases.relative_error(out, ref)  # inf when out has NaN/inf


def is_out_of_resources(error: Exception) -> bool:
    text = f"{type(error).__name__} {error}"
    return "OutOfResources" in text or "out of resource" in text.lower()


def try_config(record: dict, check, time_fn) -> None:
    """Check then time one config into `record`; resource failures are skipped, others recorded."""
    try:
        record["rel_err"] = err = check()
        record["ok"] = err <= record["max_rel_err"]
        if record["ok"]:
            record["ms"] = time_fn()
    except Exception as error:  # one config failing must not lose the others
        record["ok"] = False
        kind = "skipped_out_of_resources" if is_out_of_resources(error) else "error"
        record[kind] = f"{type(error).__name__}: {str(error)[:300]}"


# ---------------------------------------------------------------- fused MoE


def moe_problem(setup: Setup, experts: Experts, num_tokens: int, seed: int):
    weights, ids = moe_cases.random_routing(num_tokens, setup.moe_shape, setup.device, seed=seed)
    x = torch.randn(num_tokens, setup.moe_shape.hidden, device=setup.device).to(setup.dtype)
    return x, weights, ids


def moe_check_problems(setup: Setup, experts: Experts) -> list:
    """(x, experts, weights, ids, reference): V3 routing at 256 tokens, and long runs per expert
    (16 experts, 1,024 tokens x top-4: ~256 rows each, several chunks) for the chunked tiles."""
    problems = []
    small_tokens = 32 if setup.smoke else 256
    x, weights, ids = moe_problem(setup, experts, small_tokens, seed=2)
    problems.append((x, experts, weights, ids))
    few = min(16, setup.moe_shape.num_experts)
    subset = Experts(experts.w13[:few], experts.w2[:few])
    long_tokens = 40 if setup.smoke else 1024
    x, weights, ids = moe_problem(setup, experts, long_tokens, seed=3)
    problems.append((x, subset, weights[:, :4].contiguous(), ids[:, :4] % few))
    return [(*p, moe_cases.float32_moe_reference(*p)) for p in problems]


def moe_error(problem, config) -> float:
    """Relative error of fused_moe with `config` on one check problem."""
    x, experts, weights, ids, reference = problem
    out = fused_moe_module.fused_moe(x, experts.w13, experts.w2, weights, ids, config=config)
    return relative_error(out, reference)


def moe_stage_split(setup: Setup, x, experts: Experts, weights, ids, config) -> dict:
    """Each piece of the best config timed alone: align (+ chunks), gate+up, down."""
    num_tokens, top_k = ids.shape
    num_experts = experts.w13.shape[0]
    granule = fused_moe_module.row_granule(config)
    alignment = moe_align(ids, num_experts, granule)
    chunks = None
    if "TAIL_M" in config["w13"]:
        chunks = fused_moe_module.expert_chunks(alignment, ids.numel(), num_experts, config["w13"])

    def align():
        aligned = moe_align(ids, num_experts, granule)
        if "TAIL_M" in config["w13"]:
            fused_moe_module.expert_chunks(aligned, ids.numel(), num_experts, config["w13"])

    inter = experts.w2.shape[2]
    act = torch.randn(num_tokens * top_k, inter, device=x.device).to(x.dtype)  # [T*K, I]
    slot_out = torch.empty(num_tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    stage = functools.partial(fused_moe_module._launch_gemm, topk_weights=weights.float(),
                              alignment=alignment, config=config)  # fmt: skip
    w2_chunks = chunks if config["w2"].get("BLOCK_M") == config["w13"]["BLOCK_M"] else None
    gate_up = functools.partial(stage, x, experts.w13, torch.empty_like(act), None, None,
                                stage="w13", top_k=top_k, chunks=chunks)  # fmt: skip
    down = functools.partial(stage, act, experts.w2, slot_out, None, None, stage="w2", top_k=1,
                             chunks=w2_chunks)  # fmt: skip
    return {
        "align_ms": bench_ms(setup, align),
        "w13_ms": bench_ms(setup, gate_up),
        "w2_ms": bench_ms(setup, down),
    }


def sweep_moe(setup: Setup, experts: Experts, num_tokens: int) -> dict:
    shape = setup.moe_shape
    x, weights, ids = moe_problem(setup, experts, num_tokens, seed=num_tokens)
    checks = moe_check_problems(setup, experts)
    flops = 2 * num_tokens * shape.top_k * 3 * shape.hidden * shape.intermediate
    result = {"tokens": num_tokens, "dtype": str(setup.dtype), "flops": flops, "configs": {}}
    for name, config in moe_candidates(setup, num_tokens).items():
        record = result["configs"][name] = {"config": config, "max_rel_err": MAX_REL_ERR["moe"]}
        if setup.out_of_time(f"moe T={num_tokens} {name}"):
            record["skipped"] = "time budget"
            continue

        def check(config=config):
            return max(moe_error(problem, config) for problem in checks)

        run = functools.partial(fused_moe_module.fused_moe, x, experts.w13, experts.w2, weights,
                                ids, config=config)  # fmt: skip
        try_config(record, check, lambda run=run: bench_ms(setup, run))
    timed = {name: r for name, r in result["configs"].items() if "ms" in r}
    if timed:
        best = min(timed, key=lambda name: timed[name]["ms"])
        result.update(best=best, ms=timed[best]["ms"], tflops=flops / timed[best]["ms"] / 1e9)
        if not setup.out_of_time(f"moe T={num_tokens} stage split"):
            try:
                split = moe_stage_split(setup, x, experts, weights, ids, timed[best]["config"])
                split["rest_ms"] = result["ms"] - sum(split.values())
                result["stage_split"] = split
            except Exception as error:
                result["stage_split"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    try:
        grouped = functools.partial(moe_cases.grouped_mm_moe, x, experts, weights, ids)
        result["grouped_mm_ms"] = bench_ms(setup, grouped)
        result["grouped_mm_tflops"] = flops / result["grouped_mm_ms"] / 1e9
    except Exception as error:  # torch._grouped_mm: CUDA only
        result["grouped_mm_error"] = f"{type(error).__name__}: {str(error)[:200]}"
    return result


# ---------------------------------------------------------------- fp8_gemm


def gemm_operands(setup: Setup, m: int, n: int, k: int):
    generator = torch.Generator(device=setup.device).manual_seed(m + n + k)
    x = torch.randn(m, k, device=setup.device, generator=generator)
    a, a_scale = fp8_quant(x.to(setup.dtype))
    b = torch.randn(n, k, device=setup.device, generator=generator).to(torch.float8_e4m3fn)
    b_scale = torch.rand(-(-n // 128), -(-k // 128), device=setup.device, generator=generator)
    return a, a_scale, b, b_scale + 0.5


def blockwise_scaled_mm_variants(a, a_scale, b, b_scale, out_dtype):
    """name -> callable, for torch's own block-scaled FP8 GEMM in the layouts it might accept.

    Hopper + CUDA >= 12.9: scale_a [M, K/128] fp32 and scale_b [K/128, N/128] fp32; cuBLAS wants
    the scales "outer-dim major" (scale_a column-major). Each variant is tried; errors recorded.
    """
    b_t = b.t()  # [K, N] column-major, as _scaled_mm wants its second operand
    a_scale_cols = a_scale.t().contiguous().t()  # [M, K/128], strides (1, M)
    b_scale_t = b_scale.t()  # [K/128, N/128], strides (1, K/128)
    variants = {
        "_scaled_mm(a_s col-major, b_s.t())": lambda: torch._scaled_mm(
            a, b_t, scale_a=a_scale_cols, scale_b=b_scale_t, out_dtype=out_dtype),
        "_scaled_mm(a_s col-major, b_s.t() contiguous)": lambda: torch._scaled_mm(
            a, b_t, scale_a=a_scale_cols, scale_b=b_scale_t.contiguous(), out_dtype=out_dtype),
        "_scaled_mm(a_s row-major, b_s.t())": lambda: torch._scaled_mm(
            a, b_t, scale_a=a_scale.contiguous(), scale_b=b_scale_t, out_dtype=out_dtype),
    }  # fmt: skip
    functional = getattr(torch.nn.functional, "scaled_mm", None)
    scaling = getattr(torch.nn.functional, "ScalingType", None)
    if functional is not None and scaling is not None:
        recipe_a = getattr(scaling, "Blockwise_1x128", None)
        recipe_b = getattr(scaling, "Blockwise_128x128", None)
        variants["F.scaled_mm(Blockwise_1x128, Blockwise_128x128)"] = lambda: functional(
            a, b_t, a_scale_cols, recipe_a, b_scale_t, recipe_b, output_dtype=out_dtype
        )
    return variants


def time_torch_baselines(setup: Setup, a, a_scale, b, b_scale, ref, flops, out_dtype) -> dict:
    result = {}
    one = torch.ones((), device=setup.device)
    try:
        per_tensor = functools.partial(torch._scaled_mm, a, b.t(), scale_a=one, scale_b=one,
                                       out_dtype=out_dtype)  # fmt: skip
        result["scaled_mm_per_tensor_ms"] = bench_ms(setup, per_tensor)
        result["scaled_mm_per_tensor_tflops"] = flops / result["scaled_mm_per_tensor_ms"] / 1e9
    except Exception as error:  # CPU, or an FP8-less GPU
        result["scaled_mm_per_tensor_error"] = f"{type(error).__name__}: {str(error)[:200]}"
    blockwise = result["blockwise"] = {}
    for name, fn in blockwise_scaled_mm_variants(a, a_scale, b, b_scale, out_dtype).items():
        record = blockwise[name] = {}
        try:
            record["rel_err"] = relative_error(fn(), ref)
            if record["rel_err"] <= MAX_REL_ERR["fp8_gemm"]:
                record["ms"] = bench_ms(setup, fn)
                record["tflops"] = flops / record["ms"] / 1e9
        except Exception as error:
            record["error"] = f"{type(error).__name__}: {str(error)[:800]}"
    return result


def sweep_fp8_gemm(setup: Setup, m: int, n: int, k: int) -> dict:
    out_dtype = torch.float32 if setup.smoke else torch.bfloat16
    a, a_scale, b, b_scale = gemm_operands(setup, m, n, k)
    ref = fp8_gemm_reference(a, a_scale, b, b_scale, torch.float32)
    flops = 2 * m * n * k
    result = {"M": m, "N": n, "K": k, "configs": {}}
    for name, config in gemm_candidates(setup, n, k, m).items():
        record = result["configs"][name] = {
            "config": config,
            "max_rel_err": MAX_REL_ERR["fp8_gemm"],
        }
        if setup.out_of_time(f"fp8_gemm M={m} N={n} K={k} {name}"):
            record["skipped"] = "time budget"
            continue
        run = functools.partial(fp8_gemm, a, a_scale, b, b_scale, out_dtype, config=config)
        try_config(record, lambda run=run: relative_error(run(), ref),
                   lambda run=run: bench_ms(setup, run))  # fmt: skip
    timed = {name: r for name, r in result["configs"].items() if "ms" in r}
    if timed:
        best = min(timed, key=lambda name: timed[name]["ms"])
        result.update(best=best, ms=timed[best]["ms"], tflops=flops / timed[best]["ms"] / 1e9)
    result.update(time_torch_baselines(setup, a, a_scale, b, b_scale, ref, flops, out_dtype))
    return result


# ---------------------------------------------------------------- output


def best_configs(results: dict) -> dict:
    """The winners in the layout of configs/fused_moe.json and configs/fp8_gemm.json; a bucket
    whose winner is the config already tuned there ("tuned") is left out."""
    device = results["device"]
    shape = results["moe_shape"]
    moe_key = f"bf16,E={shape['num_experts']},I={shape['intermediate']},H={shape['hidden']}"
    moe, gemm = {}, {}
    for r in results["moe"]:
        if r.get("best", "tuned") != "tuned":
            moe.setdefault(moe_key, {})[str(r["tokens"])] = r["configs"][r["best"]]["config"]
    for r in results["fp8_gemm"]:
        if r.get("best", "tuned") != "tuned":
            config = r["configs"][r["best"]]["config"]
            gemm.setdefault(f"N={r['N']},K={r['K']}", {})[str(r["M"])] = config
    return {"fused_moe.json": {device: moe}, "fp8_gemm.json": {device: gemm}}


def print_table(results: dict) -> None:
    print("\nwhat              |      ms | TFLOP/s | baseline                       | ratio")
    for r in results["moe"]:
        if "ms" not in r:
            print(f"moe T={r['tokens']}: no config ran ({list(r['configs'])})")
            continue
        base = r.get("grouped_mm_ms")
        ratio = f"{base / r['ms']:.2f}x" if base else "-"
        base_text = f"grouped_mm {base:.3f} ms" if base else "grouped_mm n/a"
        print(f"moe T={r['tokens']:<5} {r['best']:<12}| {r['ms']:7.3f} | {r['tflops']:7.0f} | "
              f"{base_text:<30} | {ratio}")  # fmt: skip
        if "stage_split" in r:
            print("    split:", {k: round(v, 3) for k, v in r["stage_split"].items()
                               if isinstance(v, float)})  # fmt: skip
    for r in results["fp8_gemm"]:
        if "ms" not in r:
            print(f"fp8_gemm M={r['M']} N={r['N']} K={r['K']}: no config ran")
            continue
        base = r.get("scaled_mm_per_tensor_ms")
        ratio = f"{base / r['ms']:.2f}x" if base else "-"
        blockwise = [b["ms"] for b in r.get("blockwise", {}).values() if "ms" in b]
        block_text = f", blockwise {min(blockwise):.3f} ms" if blockwise else ""
        base_text = f"per-tensor {base:.3f} ms{block_text}" if base else "n/a"
        label = f"gemm {r['M']}x{r['N']}x{r['K']}"
        print(f"{label:<18}| {r['ms']:7.3f} | {r['tflops']:7.0f} | {base_text:<30} | {ratio}")
    if results["skipped"]:
        print("skipped (time budget):", results["skipped"])


def write(results: dict, out: str | None) -> None:
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1, default=str)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file for all results and best configs")
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes")
    parser.add_argument("--budget-s", type=float, default=110.0, help="stop sweeping after this")
    args = parser.parse_args(argv)
    started = time.monotonic()
    if not args.smoke and not torch.cuda.is_available():
        print("sweep_moe_fp8: no CUDA device (use --smoke on CPU)")
        return 1
    setup = make_setup(args.smoke, args.budget_s)
    device_name = "cpu" if setup.smoke else torch.cuda.get_device_name()
    shape = setup.moe_shape
    results = {"device": device_name, "torch": torch.__version__, "triton": triton.__version__,
               "moe_shape": dataclasses.asdict(shape),
               "moe": [], "fp8_gemm": [], "skipped": setup.skipped}  # fmt: skip
    experts = moe_cases.random_experts(shape, fp8=False, device=setup.device)
    if setup.smoke:
        experts = Experts(experts.w13.to(setup.dtype), experts.w2.to(setup.dtype))
    moe_deadline = time.monotonic() + MOE_SHARE_OF_BUDGET * args.budget_s
    setup.deadline = min(setup.deadline, moe_deadline)  # leave the fp8_gemm sweep its share
    for num_tokens in setup.moe_tokens:
        results["moe"].append(sweep_moe(setup, experts, num_tokens))
        print("moe", num_tokens, results["moe"][-1].get("best"), flush=True)
        write(results, args.out)
    del experts
    setup.deadline = started + args.budget_s
    for m in setup.gemm_rows:
        for n, k in setup.gemm_shapes:
            results["fp8_gemm"].append(sweep_fp8_gemm(setup, m, n, k))
            print("fp8_gemm", m, n, k, results["fp8_gemm"][-1].get("best"), flush=True)
            write(results, args.out)
    results["configs"] = best_configs(results)
    results["wall_s"] = time.monotonic() - started
    write(results, args.out)
    print_table(results)
    print(f"wall {results['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
