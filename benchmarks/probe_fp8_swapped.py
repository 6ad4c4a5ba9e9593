"""Issue 6: is cuBLAS's block-scaled FP8 GEMM faster with its operands swapped?

C = A W^T (A [M, K] e4m3 with 1x128 scales, W [N, K] e4m3 with 128x128 scales) is what
`ops.fp8_gemm` asks of `torch._scaled_mm` as (1x128, 128x128). The same product transposed,
C^T = W A^T, is the (128x128, 1x128) recipe, for which cuBLAS may pick other kernels. This
probe tries the scale layouts torch might take for it, checks each against a float32 reference
and times it (`triton.testing.do_bench` medians) against the plain order and per-tensor
`_scaled_mm` of the same operands, with and without making C^T row-major again.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$PWD python benchmarks/probe_fp8_swapped.py --out $OUT/x.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from rayinfer.kernels.fp8.fp8_gemm import fp8_gemm_reference, fp8_gemm_scaled_mm
from rayinfer.kernels.fp8.fp8_quant import fp8_quant

SHAPES = ((7168, 2048), (4096, 7168), (24576, 1536))  # DeepSeek-V3 (N, K)


def operands(m, n, k, device):
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
    a_q, a_scale = fp8_quant(a, 128, column_major_scales=True)  # [M, K/128], strides (1, M)
    blocks = w.view(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)).float() / 448.0
    w_q = (w.view(n // 128, 128, k // 128, 128) / blocks[:, None, :, None]).view(n, k)
    return a_q, a_scale, w_q.to(torch.float8_e4m3fn), blocks.contiguous()


def swapped_variants(a_q, a_scale, w_q, w_scale):
    """name -> callable giving C [M, N] (or C^T's view) through the (128x128, 1x128) recipe."""
    a_t = a_q.t()  # [K, M] column-major: what mat2 must be
    scale_b_options = {"rowmajor": a_scale.t().contiguous(), "view": a_scale.t()}  # [K/128, M]
    scale_a_options = {"rowmajor": w_scale, "colmajor": w_scale.t().contiguous().t()}
    variants = {}
    for a_name, scale_a in scale_a_options.items():
        for b_name, scale_b in scale_b_options.items():

            def run(scale_a=scale_a, scale_b=scale_b):
                return torch._scaled_mm(
                    w_q, a_t, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16
                )  # [N, M]

            variants[f"swapped sa={a_name} sb={b_name}"] = run
    return variants


def measure(m: int, n: int, k: int, device) -> dict:
    a_q, a_scale, w_q, w_scale = operands(m, n, k, device)
    reference = fp8_gemm_reference(a_q, a_scale, w_q, w_scale).float()
    one = torch.ones((), device=device)
    per_tensor_ms = triton.testing.do_bench(
        lambda: torch._scaled_mm(a_q, w_q.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    )
    plain_ms = triton.testing.do_bench(lambda: fp8_gemm_scaled_mm(a_q, a_scale, w_q, w_scale))
    row = {"M": m, "N": n, "K": k, "per_tensor_ms": per_tensor_ms,
           "plain_ratio": per_tensor_ms / plain_ms, "variants": {}}  # fmt: skip
    for name, run in swapped_variants(a_q, a_scale, w_q, w_scale).items():
        try:
            out_t = run()
        except RuntimeError as error:
            row["variants"][name] = {"error": str(error).splitlines()[0][:160]}
            continue
        error = (out_t.t().float() - reference).norm() / reference.norm()
        ms = triton.testing.do_bench(run)
        ms_copy = triton.testing.do_bench(lambda run=run: run().t().contiguous())
        row["variants"][name] = {"rel_err": error.item(), "ratio": per_tensor_ms / ms,
                                 "ratio_with_copy": per_tensor_ms / ms_copy}  # fmt: skip
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for n, k in SHAPES:
        for m in args.rows:
            row = measure(m, n, k, device)
            rows.append(row)
            found = {
                name: f"{v['ratio']:.3f}/{v['ratio_with_copy']:.3f} err {v['rel_err']:.1e}"
                for name, v in row["variants"].items()
                if "ratio" in v
            }
            errors = {name: v["error"] for name, v in row["variants"].items() if "error" in v}
            print(f"M={m} N={n} K={k}: plain {row['plain_ratio']:.3f}x per-tensor; swapped "
                  f"(bare/with copy) {found} {errors}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
