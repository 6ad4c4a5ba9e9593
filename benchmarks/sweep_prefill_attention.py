"""Sweep the causal prefill flash-attention kernel's launch variants on one GPU (issue 6).

    PYTHONPATH=$PWD python benchmarks/sweep_prefill_attention.py --out $OUT/prefill_sweep.json
    python benchmarks/sweep_prefill_attention.py --smoke   # CPU interpreter, tiny fp32 shapes

Per variant (tiles + the kernel's launch options, see `prefill_attention.LAUNCH_OPTIONS`): a bf16
correctness check against a float32 reference (varlen, 128 or MLA dims; NaN fails), then medians of
`triton.testing.do_bench` at 4k/8k/16k tokens (16 heads x 128, causal, one sequence) and at 8k/16k
for MLA's dims (16 heads, qk 192 / v 128); SDPA (default backend and forced flash) in the same run.
Each list starts with the shipped H200 config (the same-run reference), then variants with
more programs per SM (one-warpgroup tiles, a register cap). The best 128
variant is also timed on a paged prefill (a 4k chunk over a 12k cached prefix, block size 16),
as is and with pointer tiles of its own (the bucket's "paged" override in the snippet).
A time budget (--budget-s, 100 s; stages stop starting variants at 55/78/82/95% of it, the first
variant of each stage always runs) keeps the whole run under 120 s with compiles; the JSON is
rewritten after every variant (`partial`), so a compiler crash keeps what ran before it. The final
JSON holds every row, and `config_snippet`: the best config per bucket (qk head dim) to paste
into rayinfer/kernels/configs/prefill_attention.json. The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter has to be chosen before triton loads
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rayinfer.bench.attention_cases import as_float, paged_gqa_case  # noqa: E402
from rayinfer.bench.attention_timings import causal_flops, launch_params_override  # noqa: E402
from rayinfer.kernels.attention import paged_attention, prefill_attention  # noqa: E402
from rayinfer.kernels.triton_compat import triton  # noqa: E402

OP = "prefill_attention"
HF = dict(HEADS_FASTEST=True)
TMA = dict(USE_TMA=True, HEADS_FASTEST=True)
PIPE = dict(PIPELINE_QK=True)
WS = dict(WARP_SPECIALIZE=True)
CR = dict(CONDITIONAL_RESCALE=True)


def config(block_m, block_n, warps, stages, maxnreg=None, **options) -> dict:
    """A full config: tiles plus every launch option (absent ones off), so none leaks in from the
    JSON entry the sweep overrides; maxnreg caps the registers per thread (None: the compiler's
    choice)."""
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
                maxnreg=maxnreg, **{**prefill_attention.LAUNCH_OPTIONS, **options})  # fmt: skip


# (name, config); the first of each list is the shipped H200 config, the same-run reference;
# most promising first: the time budget cuts the tail. Among the plain tiles TMA heads-fastest
# ones are best; the conditional rescale (cr) costs 128x64/8/3 13% (its block-wide max is a
# shared-memory reduction and a barrier per tile), yet helps 64x64/4/3. The variants below aim
# at more programs per SM, sized by offline sm_90a compiles with Triton 3.6 (registers from the
# cubin, spills counted in its SASS):
# - 64x64/4/3 without cr: 170 registers, 96 KiB: two one-warpgroup CTAs per SM whose softmax
#   and MMAs the warp schedulers interleave (a hardware ping-pong);
# - 128x64/8/3 capped at 128 registers (`maxnreg`): two CTAs per SM, at the cost of ~100
#   spill instructions;
# - 64x32/4/4: 148 registers, 64 KiB: three CTAs per SM, four stages;
# - 64x64/4/3 capped at 168 registers: room for the third CTA's registers (not its memory).
GLUON = dict(backend="gluon_ws")  # prefill_attention_hopper: warp-specialized, 128x128 tiles
SWEEP_128 = [
    ("tma 64x64/4/3 (shipped)", config(64, 64, 4, 3, **TMA)),
    ("gluon warp-specialized 128x128", config(128, 128, 4, 2, **GLUON)),
    ("tma 128x64/8/3", config(128, 64, 8, 3, **TMA)),
    ("tma 128x64/8/3 maxnreg128", config(128, 64, 8, 3, **TMA, maxnreg=128)),
    ("tma 64x32/4/4", config(64, 32, 4, 4, **TMA)),
    ("tma 64x64/4/4", config(64, 64, 4, 4, **TMA)),
    ("tma 64x32/4/3", config(64, 32, 4, 3, **TMA)),
    ("tma 64x64/4/3 cr", config(64, 64, 4, 3, **TMA, **CR)),
    ("tma 128x64/8/3 maxnreg160", config(128, 64, 8, 3, **TMA, maxnreg=160)),
]
SWEEP_192 = [  # MLA's 192/128 dims: 64x64/4/2 and 64x32/4/4 fit two CTAs per SM, 64x64/4/3 one
    ("mla tma 128x64/8/3 (shipped)", config(128, 64, 8, 3, **TMA)),
    ("mla tma 64x64/4/2", config(64, 64, 4, 2, **TMA)),
    ("mla tma 64x32/4/4", config(64, 32, 4, 4, **TMA)),
    ("mla tma 64x64/4/3", config(64, 64, 4, 3, **TMA)),
    ("mla tma 64x32/4/3", config(64, 32, 4, 3, **TMA)),
]


class Run:
    """Shapes, dtype, clock and the results of one sweep; `smoke` shrinks it for the CPU."""

    def __init__(self, smoke: bool, budget_s: float):
        self.smoke, self.budget_s, self.start = smoke, budget_s, time.monotonic()
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype = torch.float32 if smoke else torch.bfloat16
        self.heads = 2 if smoke else 16
        self.lengths = [48, 96] if smoke else [4096, 8192, 16384]
        self.mla_lengths = [64] if smoke else [8192, 16384]
        self.mla_dims = (48, 32) if smoke else (192, 128)
        self.paged = (64, 24) if smoke else (16384, 4096)  # (context, new tokens)
        self.out: str | None = None
        self.partial: dict = {}  # written after every variant: a compiler crash keeps the rest

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def out_of_time(self, share: float) -> bool:
        """True once `share` of the budget is spent: later stages keep the rest."""
        return self.elapsed() > share * self.budget_s

    def fit(self, params: dict) -> dict:
        """The interpreter runs small tiles only."""
        if not self.smoke:
            return params
        return {**params, "BLOCK_M": min(params["BLOCK_M"], 32), "BLOCK_N": 16}

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=self.dtype)


def measure_ms(run: Run, fn) -> float:
    """Median ms: do_bench on the GPU, a few wall-clock calls in the interpreter."""
    fn()
    if run.smoke:
        times = []
        for _ in range(2):
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e3)
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> dict:
    """||ours - ref|| / ||ref|| and max |ours - ref|; ok when finite and both are small
    (bf16 keeps 8 bits: about 4e-3 relative)."""
    diff = ours.float() - reference.float()
    rel = (diff.norm() / reference.float().norm()).item()
    max_abs = diff.abs().max().item()
    ok = math.isfinite(rel) and math.isfinite(max_abs) and rel < 2e-2 and max_abs < 0.1
    return dict(relative_error=rel, max_abs_error=max_abs, ok=ok)


def check_contiguous(run: Run, dim_qk: int, dim_v: int) -> dict:
    """Varlen batch (one token, short, ragged, a chunk over a prefix) vs float32 per-seq SDPA.
    GQA is covered by tests/kernels (interpreter) and `rayinfer.bench kernels attention`."""
    q_lens, k_lens = ([1, 5, 40, 33], [1, 5, 70, 33]) if run.smoke else (
        [1, 100, 1000, 777], [1, 100, 1500, 777])  # fmt: skip
    kv_heads = run.heads  # as the timed shapes: GQA's group size 1 compiles another kernel
    q = torch.randn(sum(q_lens), run.heads, dim_qk, device=run.device)
    k = torch.randn(sum(k_lens), kv_heads, dim_qk, device=run.device)
    v = torch.randn(sum(k_lens), kv_heads, dim_v, device=run.device)
    cu_q = torch.tensor([0, *q_lens], device=run.device).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *k_lens], device=run.device).cumsum(0).to(torch.int32)
    args = (cu_q, cu_k, max(q_lens), dim_qk**-0.5)
    typed = (t.to(run.dtype) for t in (q, k, v))
    ours = prefill_attention.prefill_attention(*typed, *args)
    reference = prefill_attention.prefill_attention_reference(q, k, v, *args)
    return relative_error(ours, reference)


def check_paged(run: Run) -> dict:
    """A chunk + a prefill + one token over shuffled paged blocks vs the float32 reference."""
    seq_lens, query_lens = ([40, 20, 7], [13, 20, 1]) if run.smoke else (
        [1500, 700, 5], [300, 700, 5])  # fmt: skip
    dim = 32 if run.smoke else 128
    case = paged_gqa_case(seq_lens, query_lens, run.heads, run.heads, dim, 16, run.dtype,
                          run.device)  # fmt: skip
    scale = case["query"].shape[-1] ** -0.5
    ours = prefill_attention.paged_prefill_attention(**case, max_query_len=max(query_lens),
                                                     scale=scale)  # fmt: skip
    reference = paged_attention.paged_attention_reference(**as_float(case), scale=scale)
    return relative_error(ours, reference)


def prefill_inputs(run: Run, seq_len: int, dim_qk: int, dim_v: int):
    q, k = run.randn(seq_len, run.heads, dim_qk), run.randn(seq_len, run.heads, dim_qk)
    v = run.randn(seq_len, run.heads, dim_v)
    cu = torch.tensor([0, seq_len], dtype=torch.int32, device=run.device)
    return q, k, v, cu


def timing_row(kind: str, name: str, seq_len: int, ms: float, flops: float) -> dict:
    return dict(kind=kind, name=name, tokens=seq_len, ms=ms, tflops=flops / ms / 1e9)


def time_ours(run: Run, name: str, params: dict, seq_len: int, dim_qk: int, dim_v: int) -> dict:
    q, k, v, cu = prefill_inputs(run, seq_len, dim_qk, dim_v)
    with launch_params_override(OP, params):
        ms = measure_ms(run, lambda: prefill_attention.prefill_attention(
            q, k, v, cu, cu, seq_len, dim_qk**-0.5))  # fmt: skip
    flops = causal_flops(seq_len, seq_len, run.heads, dim_qk, dim_v)
    return timing_row(f"ours {dim_qk}/{dim_v}", name, seq_len, ms, flops)


def time_sdpa(run: Run, seq_len: int, dim_qk: int, dim_v: int, backend) -> dict:
    """SDPA on [1, H, S, D]; backend None: torch's own choice."""
    q, k, v, _ = prefill_inputs(run, seq_len, dim_qk, dim_v)
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    call = lambda: sdpa(q, k, v, is_causal=True, scale=dim_qk**-0.5)  # noqa: E731
    if backend is None:
        ms = measure_ms(run, call)
    else:
        with torch.nn.attention.sdpa_kernel(backend):
            ms = measure_ms(run, call)
    name = "sdpa default" if backend is None else f"sdpa {backend.name.lower()}"
    flops = causal_flops(seq_len, seq_len, run.heads, dim_qk, dim_v)
    return timing_row(f"sdpa {dim_qk}/{dim_v}", name, seq_len, ms, flops)


def time_paged(run: Run, name: str, params: dict) -> dict:
    context, chunk = run.paged
    dim = 32 if run.smoke else 128
    case = paged_gqa_case([context], [chunk], run.heads, run.heads, dim, 16, run.dtype, run.device)
    with launch_params_override(OP, params):
        ms = measure_ms(run, lambda: prefill_attention.paged_prefill_attention(
            **case, max_query_len=chunk, scale=dim**-0.5))  # fmt: skip
    row = timing_row(f"paged {dim}", name, chunk, ms, causal_flops(chunk, context, run.heads,
                                                                   dim, dim))  # fmt: skip
    return {**row, "cached": context - chunk}


def is_out_of_resources(error: Exception) -> bool:
    return "OutOfResources" in type(error).__name__ or "out of resource" in str(error).lower()


def sweep_variant(run: Run, name: str, params: dict, dims: tuple, lengths: list[int]) -> dict:
    """Check then time one variant; errors (out of shared memory, compile failures) are kept."""
    params = run.fit(params)
    row = dict(name=name, params=params, dims=list(dims), timings=[])
    try:
        with launch_params_override(OP, params):
            row["check"] = check_contiguous(run, *dims)
        if row["check"]["ok"]:
            row["timings"] = [time_ours(run, name, params, n, *dims) for n in lengths]
    except Exception as error:  # noqa: BLE001  a variant that cannot run is recorded, not fatal
        row["error"] = f"{type(error).__name__}: {error}"[:400]
        row["out_of_resources"] = is_out_of_resources(error)
        if not run.smoke:
            torch.cuda.empty_cache()
    print_variant(row, run.elapsed())
    return row


def print_variant(row: dict, elapsed: float) -> None:
    if "error" in row:
        status = "OUT OF RESOURCES" if row["out_of_resources"] else row["error"][:120]
    elif not row["check"]["ok"]:
        status = f"WRONG rel {row['check']['relative_error']:.1e}"
    else:
        status = " ".join(f"{t['tflops']:.0f}" for t in row["timings"]) + " TFLOP/s"
    print(f"[{elapsed:5.1f}s] {row['name']:40s} {status}", flush=True)


def geometric_mean_ms(row: dict, lengths: list[int]) -> float | None:
    """Score of a fully timed, correct variant over the lengths that count."""
    times = [t["ms"] for t in row.get("timings", []) if t["tokens"] in lengths]
    if not row.get("check", {}).get("ok") or len(times) < len(lengths):
        return None
    return math.exp(sum(math.log(ms) for ms in times) / len(times))


def best_of(rows: list[dict], lengths: list[int]) -> dict | None:
    scored = [(geometric_mean_ms(r, lengths), i) for i, r in enumerate(rows)]
    scored = [(score, i) for score, i in scored if score is not None]
    return rows[min(scored)[1]] if scored else None


def sweep(run: Run, variants, dims, lengths, share: float, key: str) -> list[dict]:
    rows = run.partial[key] = []
    for index, (name, params) in enumerate(variants):
        if index and run.out_of_time(share):  # the first (today's default) always runs
            print(f"[{run.elapsed():5.1f}s] budget: skipped {name}")
            rows.append(dict(name=name, params=params, dims=list(dims), skipped="time budget"))
            continue
        rows.append(sweep_variant(run, name, params, dims, lengths))
        write(run.out, {**run.partial, "partial": True, "elapsed_s": run.elapsed()})
    return rows


def run_baselines(run: Run) -> list[dict]:
    flash = torch.nn.attention.SDPBackend.FLASH_ATTENTION
    rows = []
    for dims, lengths in (((128, 128), run.lengths), (run.mla_dims, run.mla_lengths)):
        for backend in (None, flash):
            for n in lengths:
                try:
                    rows.append(time_sdpa(run, n, *dims, backend))
                except Exception as error:  # noqa: BLE001  flash has no 192/128 kernel
                    print(f"sdpa {backend} {dims} {n}: {type(error).__name__}"[:200])
    return rows


# Paged prefill loads K/V through pointers (no TMA): tiles of its own, the bucket's "paged" entry.
# Offline sm_90a compiles: pointer tiles 128x64/8 spill ~330 bytes, 128x32/8 none.
PAGED_TILES = [
    ("paged 128x32/8/3", config(128, 32, 8, 3, **HF)),
    ("paged 128x32/8/3 cr", config(128, 32, 8, 3, **HF, **CR)),
    ("paged 128x64/8/3 cr", config(128, 64, 8, 3, **HF, **CR)),
    ("paged 64x32/4/3", config(64, 32, 4, 3, **HF)),
    ("paged 64x64/4/3", config(64, 64, 4, 3, **HF)),
]


def run_paged(run: Run, best: dict | None, shipped: dict) -> list[dict]:
    """The 128 bucket's best (and the shipped config) as they run paged, then with "paged" tiles
    on top of the best (`prefill_attention._launch` merges them in for paged K/V)."""
    base = best or shipped
    candidates = [("paged shipped", {**shipped, "paged": None})]
    if best:
        candidates.append(("paged best-128", {**best, "paged": None}))
    candidates += [(name, {**base, "paged": run.fit(tiles)}) for name, tiles in PAGED_TILES]
    rows = []
    for name, params in candidates:
        if rows and run.out_of_time(0.95):
            print(f"budget: skipped {name}")
            continue
        params = run.fit(params)
        try:
            with launch_params_override(OP, params):
                check = check_paged(run)
            rows.append({**time_paged(run, name, params), "check": check, "params": params})
        except Exception as error:  # noqa: BLE001
            rows.append(dict(kind="paged", name=name, error=f"{type(error).__name__}: {error}"))
        print(f"[{run.elapsed():5.1f}s] {name}: {rows[-1].get('tflops', rows[-1].get('error'))}")
        write(run.out, {**run.partial, "paged": rows, "partial": True})
    return rows


def best_paged_tiles(paged: list[dict]) -> dict | None:
    """The "paged" override of the fastest correct paged row, if the fastest has one."""
    ok = [r for r in paged if "ms" in r and r["check"]["ok"]]
    return min(ok, key=lambda r: r["ms"])["params"].get("paged") if ok else None


def config_snippet(best_128: dict | None, best_192: dict | None, paged_tiles=None) -> dict:
    """Buckets are qk head dims: `pick_tile_config` takes the smallest bucket >= the dim. Paged
    tiles go into bucket 128 (the paged benchmark's head dim)."""
    buckets = {}
    for bucket, row in (("128", best_128), ("192", best_192)):
        if row:
            buckets[bucket] = dict(row["params"])
    if paged_tiles and "128" in buckets:
        buckets["128"]["paged"] = paged_tiles
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {name: {"default": buckets}}


def sdpa_reference(baselines: list[dict], kind: str, tokens: int) -> dict:
    """SDPA's default backend at this shape (issue 6's bar), else the fastest SDPA row."""
    same = [r for r in baselines if r["kind"] == kind and r["tokens"] == tokens]
    default = [r for r in same if r["name"] == "sdpa default"]
    return (default or sorted(same, key=lambda r: r["ms"]) or [{}])[0]


def summary_table(rows: list[dict], baselines: list[dict]) -> list[dict]:
    table = []
    for row in rows:
        for t in row.get("timings", []):
            sdpa = sdpa_reference(baselines, t["kind"].replace("ours", "sdpa"), t["tokens"])
            ratio = sdpa["ms"] / t["ms"] if sdpa else None
            table.append({**t, "sdpa": sdpa.get("name"), "sdpa_tflops": sdpa.get("tflops"),
                          "speed_vs_sdpa": ratio})  # fmt: skip
    return table


def print_table(table: list[dict], baselines: list[dict], paged: list[dict]) -> None:
    print(f"\n{'variant':40s} {'dims':8s} {'tokens':>6s} {'ms':>8s} {'TFLOP/s':>8s} "
          f"{'SDPA TF/s':>9s} {'x SDPA':>6s}")  # fmt: skip
    for t in table:
        ratio = f"{t['speed_vs_sdpa']:6.2f}" if t["speed_vs_sdpa"] else f"{'-':>6s}"
        sdpa = f"{t['sdpa_tflops']:9.0f}" if t["sdpa_tflops"] else f"{'-':>9s}"
        print(f"{t['name']:40s} {t['kind'][5:]:8s} {t['tokens']:6d} {t['ms']:8.3f} "
              f"{t['tflops']:8.0f} {sdpa} {ratio}")  # fmt: skip
    for b in baselines:
        print(f"{b['name']:40s} {b['kind'][5:]:8s} {b['tokens']:6d} {b['ms']:8.3f} "
              f"{b['tflops']:8.0f}")  # fmt: skip
    for p in paged:
        if "tflops" in p:
            print(f"{p['name']:40s} {p['kind'][6:]:8s} {p['tokens']:6d} {p['ms']:8.3f} "
                  f"{p['tflops']:8.0f}   (over {p['cached']} cached, check ok "
                  f"{p['check']['ok']})")  # fmt: skip


def write(path: str | None, result: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON results here")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny fp32 shapes")
    parser.add_argument("--budget-s", type=float, default=100.0, help="stop sweeping after this")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("the sweep needs a CUDA GPU (or --smoke for the CPU interpreter)")
        return 2
    run = Run(args.smoke, args.budget_s)
    torch.manual_seed(0)
    baselines = run_baselines(run)
    run.out, run.partial["sdpa"] = args.out, baselines
    rows_128 = sweep(run, SWEEP_128, (128, 128), run.lengths, 0.55, "sweep_128")
    best_128 = best_of(rows_128, run.lengths[1:])  # 8k and 16k: the targets
    rows_192 = sweep(run, SWEEP_192, run.mla_dims, run.mla_lengths, 0.78, "sweep_192")
    best_192 = best_of(rows_192, run.mla_lengths)
    paged = [] if run.out_of_time(0.82) else run_paged(
        run, best_128["params"] if best_128 else None, run.fit(SWEEP_128[0][1]))  # fmt: skip
    table = summary_table(rows_128 + rows_192, baselines)
    result = dict(
        gpu=torch.cuda.get_device_name() if not run.smoke else "cpu (interpreter)",
        torch=torch.__version__, triton=getattr(triton, "__version__", None),
        best={"128": best_128 and best_128["name"], "192": best_192 and best_192["name"]},
        config_snippet=config_snippet(best_128, best_192, best_paged_tiles(paged)),
        sweep_128=rows_128, sweep_192=rows_192, sdpa=baselines, paged=paged, table=table,
        elapsed_s=run.elapsed(),
    )  # fmt: skip
    write(args.out, result)
    print(f"done in {run.elapsed():.1f} s\nconfig_snippet: {json.dumps(result['config_snippet'])}")
    print(f"best: {result['best']}")
    print_table(table, baselines, paged)
    return 0


if __name__ == "__main__":
    sys.exit(main())
