"""`python -m rayinfer.bench kernels router [--out FILE]`: MoE router logits on CUDA.

bf16 activations at DeepSeek-V2-Lite (H 2048, 64 experts) and V3 (H 7168, 256 experts) shapes,
256 to 16,384 tokens: the kernel (kernels/moe/router_logits) against torch's way (`x.float()` then a
float32 GEMM), both measured against a float64 product of the same operands (max error relative
to the largest logit), then `triton.testing.do_bench` medians of both in the same run.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from rayinfer.kernels.moe.router_logits import router_logits, router_logits_reference

SHAPES = {"deepseek-v2-lite": (2048, 64), "deepseek-v3": (7168, 256)}
TOKENS = (256, 4096, 16384)


def relative_max_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).abs().max() / exact.abs().max()).item()


def measure(hidden: int, experts: int, tokens: int) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=generator).bfloat16()
    weight = torch.randn(experts, hidden, device="cuda", generator=generator) * hidden**-0.5
    exact = x.double() @ weight.double().t()
    row = {"tokens": tokens, "hidden": hidden, "experts": experts}
    for name, fn in (("kernel", router_logits), ("torch", router_logits_reference)):
        row[f"{name}_rel_error"] = relative_max_error(fn(x, weight), exact)
        row[f"{name}_us"] = 1e3 * triton.testing.do_bench(
            lambda fn=fn: fn(x, weight), warmup=10, rep=50, return_mode="median"
        )
    row["speedup"] = row["torch_us"] / row["kernel_us"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayinfer.bench kernels router")
    parser.add_argument("--out", default=None, help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels router: no CUDA device; nothing to measure")
        return 0
    rows = []
    for model, (hidden, experts) in SHAPES.items():
        for tokens in TOKENS:
            rows.append({"model": model, **measure(hidden, experts, tokens)})
            r = rows[-1]
            print(f"router {model} T={tokens}: kernel {r['kernel_us']:.1f} us (err "
                  f"{r['kernel_rel_error']:.1e}), torch {r['torch_us']:.1f} us (err "
                  f"{r['torch_rel_error']:.1e}), x{r['speedup']:.2f}", flush=True)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0
