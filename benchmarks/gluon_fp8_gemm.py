"""Check, then time, the warp-specialized Gluon FP8 block-scaled GEMM (fp8_gemm_hopper) on an
H100/H200 against per-tensor `torch._scaled_mm` and cuBLAS's block-scaled one in the same run.

    PYTHONPATH=$PWD python benchmarks/gluon_fp8_gemm.py [--out fp8_ws.json]

Checks: the float32 dequantized reference (fp8_gemm_reference) on ragged shapes (M not a multiple
of 128, N a multiple of 8 only, a single K block) and the DeepSeek-V3 projection shapes; relative
max error < 2e-2 (bf16 output). Timings: do_bench medians at M = 4,096 and 128 on the V3 shapes
the issue names, with TFLOP/s and the ratio to per-tensor `_scaled_mm`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks import fp8_gemm_hopper  # noqa: E402
from rayinfer.kernels.fp8 import fp8_gemm as fp8_gemm_module  # noqa: E402
from rayinfer.kernels.fp8.fp8_quant import fp8_quant  # noqa: E402

CHECKS = [(1, 256, 128), (100, 136, 256), (300, 7168, 2048), (4096, 4096, 7168), (129, 24576, 1536)]
SHAPES = [(7168, 2048), (4096, 7168), (24576, 1536)]  # (N, K): V3 projections


def operands(m: int, n: int, k: int):
    """Activations quantized as the engine does (column-major scales); weights with 128x128
    block scales in [0.5, 1.5)."""
    generator = torch.Generator(device="cuda").manual_seed(m + n + k)
    a, a_scale = fp8_quant(torch.randn(m, k, device="cuda", generator=generator).bfloat16(),
                           column_major_scales=True)  # fmt: skip
    b = torch.randn(n, k, device="cuda", generator=generator).to(torch.float8_e4m3fn)
    b_scale = torch.rand(-(-n // 128), -(-k // 128), device="cuda", generator=generator) + 0.5
    return a, a_scale, b, b_scale


def check(m: int, n: int, k: int) -> dict:
    a, a_scale, b, b_scale = operands(m, n, k)
    assert fp8_gemm_hopper.supports(a, b), "the Gluon kernel does not apply"
    ours = fp8_gemm_hopper.fp8_gemm_ws(a, a_scale, b, b_scale).float()
    ref = fp8_gemm_module.fp8_gemm_reference(a, a_scale, b, b_scale, torch.float32)
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    ok = bool(torch.isfinite(ours).all()) and err < 2e-2
    return dict(m=m, n=n, k=k, rel_max_error=err, ok=ok)


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def time_shape(m: int, n: int, k: int) -> dict:
    a, a_scale, b, b_scale = operands(m, n, k)
    one = torch.ones((), device="cuda")
    calls = {
        "per-tensor _scaled_mm": lambda: torch._scaled_mm(
            a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
        ),
        "cuBLAS block-scaled": lambda: fp8_gemm_module.fp8_gemm_scaled_mm(a, a_scale, b, b_scale),
        "gluon warp-specialized": lambda: fp8_gemm_hopper.fp8_gemm_ws(a, a_scale, b, b_scale),
    }
    row = dict(m=m, n=n, k=k)
    for name, call in calls.items():
        ms = bench(call)
        row[name] = dict(ms=ms, tflops=2 * m * n * k / ms / 1e9)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    checks = [check(*shape) for shape in CHECKS]
    for row in checks:
        print(json.dumps(row), flush=True)
    results = dict(gpu=torch.cuda.get_device_name(), triton=triton.__version__, checks=checks)
    if all(c["ok"] for c in checks):
        results["timings"] = []
        for m in (4096, 128):
            for n, k in SHAPES:
                row = time_shape(m, n, k)
                results["timings"].append(row)
                base = row["per-tensor _scaled_mm"]["ms"]
                cells = [f"{name} {v['ms']:.3f} ms {base / v['ms']:.2f}x"
                         for name, v in row.items() if isinstance(v, dict)]  # fmt: skip
                print(f"{m}x{n}x{k}: " + " | ".join(cells), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
