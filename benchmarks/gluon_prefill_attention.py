"""Check, then time, the warp-specialized Gluon prefill attention (prefill_attention_hopper) on
an H100/H200, against a float32 reference, SDPA and the Triton kernel in the same run.

    PYTHONPATH=$PWD python benchmarks/gluon_prefill_attention.py [--out ws.json] [--check-only]

Checks (bf16 against float32 per-sequence SDPA; relative Frobenius error < 2e-2, no NaN): one
sequence of 1, 70, 128, 300 and 4,096 tokens; a varlen batch with a chunk over a cached prefix
(queries the last tokens of longer contexts); GQA 4:1; 16 heads; and MLA's dims (qk 192, v 128
split off a wider projection; and with the rope columns apart, as the MLA layer passes them
now: q_pe and a rope key shared by the heads in their own tensors). Then do_bench medians of
one causal sequence of 4k/8k/16k tokens (qk 128 and 192, the latter also with the rope apart),
16 heads, for SDPA (torch's default backend), the Triton kernel (its shipped tiles) and the
Gluon kernel, with their TFLOP/s: plain launches, and in parentheses replayed from a CUDA graph
(no host time per launch; at 4k tokens a launch's host work is a large share of the kernel's
~0.15 ms).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from rayinfer.bench.attention_timings import causal_flops, launch_params_override  # noqa: E402
from rayinfer.kernels.attention import prefill_attention, prefill_attention_hopper  # noqa: E402

CASES = [  # (query lens, context lens, query heads, kv heads, qk head dim)
    ([1], [1], 16, 16, 128),
    ([70], [70], 16, 16, 128),
    ([128], [128], 16, 16, 128),
    ([300], [300], 16, 16, 128),
    ([4096], [4096], 16, 16, 128),
    ([100, 1000, 777, 5], [100, 1500, 777, 260], 16, 16, 128),
    ([513, 64], [2000, 64], 32, 8, 128),
    ([1], [1], 16, 16, 192),  # MLA's expanded prefill: qk 192 = 128 + 64 rope, v 128
    ([300], [300], 16, 16, 192),
    ([2048], [2048], 16, 16, 192),
    ([100, 1000, 5], [100, 1500, 260], 16, 16, 192),
]


def packed(lens: list[int], heads: int, dim: int = 128) -> torch.Tensor:
    return torch.randn(sum(lens), heads, dim, device="cuda")


def mla_value(lens: list[int], heads: int) -> torch.Tensor:
    """[S, H, 128] bf16 split off a [S, H, 256] projection, as MLA's kv_b output: row and head
    strides of the wider tensor."""
    return packed(lens, heads, 256).to(torch.bfloat16)[..., 128:]


def check(q_lens, k_lens, heads, kv_heads, dim) -> dict:
    q = packed(q_lens, heads, dim).to(torch.bfloat16)
    k = packed(k_lens, kv_heads, dim).to(torch.bfloat16)
    v = mla_value(k_lens, kv_heads) if dim != 128 else packed(k_lens, kv_heads).to(q.dtype)
    cu_q = torch.tensor([0, *q_lens], device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *k_lens], device="cuda").cumsum(0).to(torch.int32)
    args = (cu_q, cu_k, max(q_lens), dim**-0.5)
    typed = (q, k, v)
    assert prefill_attention_hopper.supports(*typed), "the Gluon kernel does not apply"
    ours = prefill_attention_hopper.prefill_attention_ws(*typed, *args).float()
    reference = prefill_attention.prefill_attention_reference(q.float(), k.float(), v.float(),
                                                              *args)  # fmt: skip
    rel = ((ours - reference).norm() / reference.norm()).item()
    ok = math.isfinite(rel) and not torch.isnan(ours).any().item() and rel < 2e-2
    return dict(q_lens=q_lens, k_lens=k_lens, heads=heads, kv_heads=kv_heads, dim=dim,
                rel_error=rel, ok=ok)  # fmt: skip


def check_rope_apart(q_lens, k_lens, heads, kv_heads, dim) -> dict:
    """MLA as the layer passes it now: q_nope a view of the [T, H, 192] query, q_pe apart,
    k_nope and the value views of one [S, H, 256] kv_b output, one [S, 1, 64] rope key shared
    by the heads; against float32 over the joined query and key."""
    query = packed(q_lens, heads, 192).to(torch.bfloat16)
    kv = packed(k_lens, kv_heads, 256).to(torch.bfloat16)
    k_pe = packed(k_lens, 1, 64).to(torch.bfloat16)
    q_nope, q_pe = query[..., :128], query[..., 128:].contiguous()
    k_nope, v = kv[..., :128], kv[..., 128:]
    cu_q = torch.tensor([0, *q_lens], device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *k_lens], device="cuda").cumsum(0).to(torch.int32)
    args = (cu_q, cu_k, max(q_lens), dim**-0.5)
    assert prefill_attention_hopper.supports(q_nope, k_nope, v, True, q_pe, k_pe)
    out = torch.full((sum(q_lens), heads, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    prefill_attention_hopper.prefill_attention_ws(q_nope, k_nope, v, *args, out, q_pe, k_pe)
    key = torch.cat([k_nope, k_pe.expand(-1, kv_heads, -1)], -1)
    reference = prefill_attention.prefill_attention_reference(query.float(), key.float(),
                                                              v.float(), *args)  # fmt: skip
    rel = ((out.float() - reference).norm() / reference.norm()).item()
    ok = math.isfinite(rel) and not torch.isnan(out).any().item() and rel < 2e-2
    return dict(q_lens=q_lens, k_lens=k_lens, heads=heads, kv_heads=kv_heads, dim=dim,
                rope_apart=True, rel_error=rel, ok=ok)  # fmt: skip


TIMED = [(128, 4096), (128, 8192), (128, 16384), (192, 4096), (192, 8192), (192, 16384)]
TRITON_TILES = {  # the Triton kernel's shipped tiles per qk head dim
    128: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    192: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
}


def triton_kernel(q, k, v, cu, seq_len, scale):
    """The Triton kernel with its shipped tiles, whatever the config file's backend says."""
    tiles = dict(TRITON_TILES[q.shape[-1]], USE_TMA=True, HEADS_FASTEST=True, backend="triton")
    with launch_params_override("prefill_attention", tiles):
        return prefill_attention.prefill_attention(q, k, v, cu, cu, seq_len, scale)


def time_case(seq_len: int, dim: int = 128) -> dict:
    q, k = (packed([seq_len], 16, dim).to(torch.bfloat16) for _ in range(2))
    v = packed([seq_len], 16).to(torch.bfloat16)
    cu = torch.tensor([0, seq_len], dtype=torch.int32, device="cuda")
    scale = dim**-0.5
    sdpa_args = [t.transpose(0, 1)[None] for t in (q, k, v)]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = {
        "sdpa default": lambda: sdpa(*sdpa_args, is_causal=True, scale=scale),
        "triton (shipped tiles)": lambda: triton_kernel(q, k, v, cu, seq_len, scale),
        "gluon warp-specialized": lambda: prefill_attention_hopper.prefill_attention_ws(
            q, k, v, cu, cu, seq_len, scale
        ),
    }
    if dim == 192:  # MLA's layer now: rope columns apart, the rope key shared by the heads
        q_pe, k_pe = q[..., 128:].contiguous(), k[:, :1, 128:].contiguous()
        calls["gluon rope apart"] = lambda: prefill_attention_hopper.prefill_attention_ws(
            q[..., :128], k[..., :128], v, cu, cu, seq_len, scale, None, q_pe, k_pe
        )
    flops = causal_flops(seq_len, seq_len, 16, dim, 128)
    row = {"tokens": seq_len, "dim": dim}
    for name, call in calls.items():
        call()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median")
        graph_ms = triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median")
        row[name] = dict(ms=ms, tflops=flops / ms / 1e9, graph_ms=graph_ms,
                         graph_tflops=flops / graph_ms / 1e9)  # fmt: skip
    return row


def time_engine_paths(seq_len: int = 16384, heads: int = 32, kv_heads: int = 8) -> dict:
    """A prompt's first chunk as the engine's GQA layer attends it (block size 16): through the
    block tables (paged kernel), and with the step's own K/V (the contiguous, Gluon kernel)."""
    from rayinfer.kernels.attention.prefill_attention import paged_mixed_attention
    from rayinfer.kernels.attention.reshape_and_cache import reshape_and_cache

    blocks = seq_len // 16
    q = packed([seq_len], heads).to(torch.bfloat16)
    k, v = (packed([seq_len], kv_heads).to(torch.bfloat16) for _ in range(2))
    cache = torch.zeros(blocks, 16, 2, kv_heads, 128, dtype=torch.bfloat16, device="cuda")
    table = torch.randperm(blocks, device="cuda").to(torch.int32)[None]
    slots = (table[0].long()[:, None] * 16 + torch.arange(16, device="cuda")).flatten()
    reshape_and_cache(k, v, cache, slots)
    lens = torch.tensor([seq_len], dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, seq_len], dtype=torch.int32, device="cuda")

    def run(new_kv):
        return paged_mixed_attention(q, cache, table, lens, starts, [seq_len], 128**-0.5,
                                     [seq_len], new_kv)  # fmt: skip

    paged, direct = run(None), run((k, v))
    rel = ((paged.float() - direct.float()).norm() / paged.float().norm()).item()
    flops = causal_flops(seq_len, seq_len, heads, 128, 128)
    row = dict(tokens=seq_len, heads=heads, kv_heads=kv_heads, paged_vs_direct_rel=rel)
    for name, new_kv in (("paged (block tables)", None), ("the step's own K/V", (k, v))):
        ms = triton.testing.do_bench(lambda: run(new_kv), warmup=10, rep=50,  # noqa: B023
                                     return_mode="median")  # fmt: skip
        row[name] = dict(ms=ms, tflops=flops / ms / 1e9)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--engine-paths", action="store_true", help="also time time_engine_paths")
    args = parser.parse_args()
    torch.manual_seed(0)
    checks = []
    for case in CASES:
        checks.append(check(*case))
        print(json.dumps(checks[-1]), flush=True)
        if case[-1] == 192:
            checks.append(check_rope_apart(*case))
            print(json.dumps(checks[-1]), flush=True)
    results = dict(gpu=torch.cuda.get_device_name(), triton=triton.__version__, checks=checks)
    if not args.check_only and all(c["ok"] for c in checks):
        results["timings"] = []
        for dim, seq_len in TIMED:
            row = time_case(seq_len, dim)
            results["timings"].append(row)
            cells = [f"{k} {v['tflops']:.0f} ({v['graph_tflops']:.0f})"
                     for k, v in row.items() if isinstance(v, dict)]  # fmt: skip
            print(f"qk {dim} {seq_len:6d} tokens: " + " | ".join(cells) + " TFLOP/s", flush=True)
    if args.engine_paths:
        results["engine_paths"] = row = time_engine_paths()
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
