"""`python -m rayinfer.bench kernels attention [--out FILE] [--sweep]`: the attention kernels and
small fused ops on CUDA: bf16 correctness vs float32 references, then medians of
`triton.testing.do_bench` against torch baselines measured in the same run.

- prefill: our varlen causal flash attention vs SDPA (flash backend), 16 heads x 128, one sequence;
  also the same prefill read through the paged cache, a 4k chunk over a paged 12k prefix, MLA
  prefill (192/128 head dims).
- decode: split-K GQA (32/8 heads x 128) and absorbed MLA (512 + 64 latent, 16 or 128 heads) vs
  gather + SDPA, as HBM bandwidth (bytes of KV read once / time) against the 4.23 TB/s ceiling.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from rayinfer.bench.attention_checks import run_checks
from rayinfer.bench.attention_timings import (
    time_decode_gqa,
    time_decode_mla,
    time_paged_prefill,
    time_prefill,
    time_small_ops,
)

PREFILL_SWEEP = [
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
]
DECODE_SWEEP = [
    dict(BLOCK_N=64, num_warps=4, num_stages=3),
    dict(BLOCK_N=128, num_warps=4, num_stages=3),
    dict(BLOCK_N=64, num_warps=4, num_stages=4),
    dict(BLOCK_N=32, num_warps=2, num_stages=4),
    dict(BLOCK_N=128, num_warps=8, num_stages=2),
    dict(BLOCK_N=64, num_warps=4, num_stages=3, target_programs=1056),
]
MLA_SWEEP = [
    dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=2),
    dict(BLOCK_H=16, BLOCK_N=64, num_warps=4, num_stages=2),
    dict(BLOCK_H=32, BLOCK_N=32, num_warps=4, num_stages=2),
    dict(BLOCK_H=64, BLOCK_N=32, num_warps=8, num_stages=2),
    dict(BLOCK_H=64, BLOCK_N=16, num_warps=4, num_stages=2),
    dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=3),
]


SWEEPS = {  # op -> (configs, shapes timed for each, timing function)
    "prefill_attention": (PREFILL_SWEEP, [(8192,), (16384,)], time_prefill),
    "paged_attention": (DECODE_SWEEP, [(1, 131072), (32, 32768), (128, 4096)], time_decode_gqa),
    "mla_attention": (MLA_SWEEP, [(8, 32768, 128), (32, 8192, 16), (1, 131072, 16)],
                      time_decode_mla),
}  # fmt: skip


def safe_row(fn, *args, **kwargs) -> dict | None:
    """One measurement; a config that fails to compile or run is printed and skipped."""
    try:
        row = fn(*args, **kwargs)
    except Exception as error:  # out of resources, out of memory: report and go on
        print(f"skipped {fn.__name__}{args[1:]} {kwargs}: {type(error).__name__}: {error}"[:300])
        torch.cuda.empty_cache()
        return None
    print_table([row] if "params" not in kwargs else [{**row, "params": kwargs["params"]}])
    return row


def run_sweeps(device) -> tuple[list[dict], dict]:
    """Every config of each op on its shapes; the best by geometric-mean time per op."""
    rows, best = [], {}
    for op, (configs, shapes, timer) in SWEEPS.items():
        scores = []
        for params in configs:
            timed = [safe_row(timer, device, *shape, params=params, baseline=False)
                     for shape in shapes]  # fmt: skip
            rows += [{**r, "params": params} for r in timed if r]
            if all(timed):
                log_time = sum(math.log(r["ours_ms"]) for r in timed)
                scores.append((log_time, configs.index(params)))
        best[op] = configs[min(scores)[1]] if scores else None
        print(f"best {op}: {best[op]}")
    return rows, best


def run_timings(device, best: dict) -> list[dict]:
    # MLA decode keeps configs/mla_attention.json: its tiles are bucketed by head count, which
    # one swept best cannot express.
    prefill, decode, mla = best.get("prefill_attention"), best.get("paged_attention"), None
    rows = [safe_row(time_prefill, device, n, params=prefill) for n in (4096, 8192, 16384)]
    rows.append(safe_row(time_prefill, device, 8192, dim_qk=192, dim_v=128, params=prefill))
    rows.append(safe_row(time_paged_prefill, device, 16384, 16384, params=prefill))
    rows.append(safe_row(time_paged_prefill, device, 16384, 4096, params=prefill))
    for batch, seq_len in ((1, 4096), (1, 131072), (1, 1048576), (8, 32768), (32, 4096),
                           (32, 32768), (128, 4096), (128, 32768)):  # fmt: skip
        rows.append(safe_row(time_decode_gqa, device, batch, seq_len, params=decode))
    for heads in (16, 128):
        for batch, seq_len in ((1, 4096), (1, 131072), (8, 32768), (32, 8192), (128, 4096)):
            rows.append(safe_row(time_decode_mla, device, batch, seq_len, heads, params=mla))
    try:
        rows += time_small_ops(device)
    except Exception as error:  # the attention numbers above still count
        print(f"small ops skipped: {type(error).__name__}: {error}"[:300])
    return [r for r in rows if r]


def print_table(rows: list[dict]) -> None:
    print(f"{'kernel':28s} {'shape':30s} {'ours ms':>9s} {'base ms':>9s} {'ratio':>6s} "
          f"{'rate':>12s} {'roofline':>8s}")  # fmt: skip
    for row in rows:
        rate = f"{row['tflops']:.0f} TFLOP/s" if "tflops" in row else f"{row['tb_per_s']:.2f} TB/s"
        base = f"{row['baseline_ms']:9.3f}" if row["baseline_ms"] else f"{'-':>9s}"
        ratio = f"{row['ratio']:6.2f}" if row["ratio"] else f"{'-':>6s}"
        extra = f" {row['params']}" if "params" in row else ""
        print(f"{row['kernel']:28s} {row['shape']:30s} {row['ours_ms']:9.3f} {base} {ratio} "
              f"{rate:>12s} {row['roofline_share']:8.0%}{extra}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayinfer.bench kernels attention")
    parser.add_argument("--out", help="write the JSON results here")
    parser.add_argument("--sweep", action="store_true", help="also sweep tile configs")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the attention kernel benchmark needs a CUDA GPU")
        return 2
    device = torch.device("cuda")
    checks = run_checks(device)
    for check in checks:
        print(f"{'ok ' if check['ok'] else 'BAD'} {check['check']:45s} "
              f"max |err| {check['max_abs_error']:.2e} (atol {check['atol']:.0e})")  # fmt: skip
    sweeps, best = run_sweeps(device) if args.sweep else ([], {})
    timings = run_timings(device, best)
    print("== timings (best swept configs) ==")
    print_table(timings)
    result = dict(gpu=torch.cuda.get_device_name(), checks=checks, sweeps=sweeps, best=best,
                  timings=timings)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(c["ok"] for c in checks) else 1
