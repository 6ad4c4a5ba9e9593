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
import contextlib
import json

import torch
import triton.testing

from rayinfer.bench.attention_cases import gather_paged, paged_gqa_case, paged_mla_case
from rayinfer.bench.attention_checks import run_checks
from rayinfer.kernels import mla_attention, paged_attention, prefill_attention

BF16 = torch.bfloat16
PEAK_TFLOPS = 800.0  # H200 dense bf16
PEAK_BYTES_PER_S = 4.23e12  # H200 HBM copy
SDPA = torch.nn.functional.scaled_dot_product_attention


def bench_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


@contextlib.contextmanager
def launch_params_override(op: str, params: dict | None):
    """Run `op`'s kernels with `params` instead of its configs/<op>.json entry (for sweeps)."""
    original = paged_attention.launch_params
    if params is None:
        yield
        return

    def patched(name, device):
        return {**original(name, device), **params} if name == op else original(name, device)

    paged_attention.launch_params = prefill_attention.launch_params = patched
    try:
        yield
    finally:
        paged_attention.launch_params = prefill_attention.launch_params = original


def causal_flops(q_len: int, kv_len: int, heads: int, dim_qk: int, dim_v: int) -> float:
    visible = q_len * kv_len - q_len * (q_len - 1) / 2  # bottom-right causal (q_len <= kv_len)
    return 2 * visible * heads * (dim_qk + dim_v)


def time_prefill(device, seq_len, heads=16, dim_qk=128, dim_v=128, params=None) -> dict:
    q = torch.randn(seq_len, heads, dim_qk, device=device, dtype=BF16)
    k = torch.randn(seq_len, heads, dim_qk, device=device, dtype=BF16)
    v = torch.randn(seq_len, heads, dim_v, device=device, dtype=BF16)
    cu = torch.tensor([0, seq_len], dtype=torch.int32, device=device)
    scale = dim_qk**-0.5
    with launch_params_override("prefill_attention", params):
        ours = bench_ms(
            lambda: prefill_attention.prefill_attention(q, k, v, cu, cu, seq_len, scale)
        )
    qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, S, D]
    backend = torch.nn.attention.SDPBackend.FLASH_ATTENTION
    if dim_qk != dim_v:
        backend = torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION
    with torch.nn.attention.sdpa_kernel(backend):
        baseline = bench_ms(lambda: SDPA(qt, kt, vt, is_causal=True, scale=scale))
    flops = causal_flops(seq_len, seq_len, heads, dim_qk, dim_v)
    return dict(
        kernel=f"prefill {heads}x{dim_qk}/{dim_v}",
        shape=f"{seq_len} tokens",
        ours_ms=ours,
        baseline_ms=baseline,
        baseline=f"SDPA {backend.name.lower()}",
        ratio=baseline / ours,
        tflops=flops / ours / 1e9,
        roofline_share=flops / ours / 1e9 / PEAK_TFLOPS,
    )


def time_paged_prefill(device, context_len, chunk_len, heads=16, dim=128) -> dict:
    """The last `chunk_len` tokens of a `context_len` context, K/V read through a paged cache."""
    case = paged_gqa_case([context_len], [chunk_len], heads, heads, dim, 16, BF16, device)
    del case["query_start_loc"]
    starts = torch.tensor([0, chunk_len], dtype=torch.int32, device=device)
    ours = bench_ms(
        lambda: prefill_attention.paged_prefill_attention(
            **case, query_start_loc=starts, max_query_len=chunk_len, scale=dim**-0.5
        )
    )
    flops = causal_flops(chunk_len, context_len, heads, dim, dim)
    return dict(
        kernel=f"paged prefill {heads}x{dim}",
        shape=f"{chunk_len} new over {context_len - chunk_len} cached",
        ours_ms=ours,
        baseline_ms=None,
        baseline="none (SDPA has no paged prefix)",
        ratio=None,
        tflops=flops / ours / 1e9,
        roofline_share=flops / ours / 1e9 / PEAK_TFLOPS,
    )


def time_decode_gqa(device, batch, seq_len, heads=32, kv_heads=8, dim=128, params=None) -> dict:
    case = paged_gqa_case([seq_len] * batch, [1] * batch, heads, kv_heads, dim, 16, BF16, device)
    args = (case["query"], case["kv_cache"], case["block_tables"], case["seq_lens"], dim**-0.5)
    with launch_params_override("paged_attention", params):
        ours = bench_ms(lambda: paged_attention.paged_decode_attention(*args))

    def gather_then_sdpa():
        context = gather_paged(case["kv_cache"], case["block_tables"], seq_len)  # [B,S,2,Hkv,D]
        key, value = context[:, :, 0].transpose(1, 2), context[:, :, 1].transpose(1, 2)
        return SDPA(case["query"][:, :, None], key, value, scale=dim**-0.5, enable_gqa=True)

    baseline = bench_ms(gather_then_sdpa)
    kv_bytes = batch * seq_len * 2 * kv_heads * dim * 2
    return dict(
        kernel=f"decode gqa {heads}/{kv_heads}x{dim}",
        shape=f"B={batch} ctx={seq_len}",
        ours_ms=ours,
        baseline_ms=baseline,
        baseline="gather + SDPA",
        ratio=baseline / ours,
        tb_per_s=kv_bytes / ours / 1e9,
        roofline_share=kv_bytes / ours / 1e-3 / PEAK_BYTES_PER_S,
    )


def time_decode_mla(device, batch, seq_len, heads, params=None) -> dict:
    case = paged_mla_case([seq_len] * batch, heads, 512, 64, 16, BF16, device)
    scale = 192**-0.5
    args = (case["q_latent"], case["q_pe"], case["kv_cache"], case["block_tables"])
    with launch_params_override("mla_attention", params):
        ours = bench_ms(lambda: mla_attention.mla_decode_attention(*args, case["seq_lens"], scale))

    def gather_then_sdpa():
        context = gather_paged(case["kv_cache"], case["block_tables"], seq_len)  # [B, S, 576]
        query = torch.cat((case["q_latent"], case["q_pe"]), dim=-1)[:, :, None]  # [B, N, 1, 576]
        key = context[:, None]  # [B, 1, S, 576]
        return SDPA(query, key, key[..., :512], scale=scale, enable_gqa=True)

    baseline = bench_ms(gather_then_sdpa)
    kv_bytes = batch * seq_len * 576 * 2
    return dict(
        kernel=f"decode mla {heads} heads",
        shape=f"B={batch} ctx={seq_len}",
        ours_ms=ours,
        baseline_ms=baseline,
        baseline="gather + SDPA",
        ratio=baseline / ours,
        tb_per_s=kv_bytes / ours / 1e9,
        roofline_share=kv_bytes / ours / 1e-3 / PEAK_BYTES_PER_S,
    )


PREFILL_SWEEP = [
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=4),
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


def run_sweeps(device) -> list[dict]:
    rows = []
    for params in PREFILL_SWEEP:
        rows.append({**time_prefill(device, 8192, params=params), "params": params})
    for params in DECODE_SWEEP:
        for batch, seq_len in ((1, 131072), (32, 32768)):
            row = time_decode_gqa(device, batch, seq_len, params=params)
            rows.append({**row, "params": params})
    for params in MLA_SWEEP:
        for batch, heads in ((8, 128), (32, 16)):
            rows.append({**time_decode_mla(device, batch, 32768, heads, params=params),
                         "params": params})  # fmt: skip
    return rows


def run_timings(device) -> list[dict]:
    rows = [time_prefill(device, n) for n in (4096, 8192, 16384)]
    rows.append(time_prefill(device, 8192, dim_qk=192, dim_v=128))
    rows.append(time_paged_prefill(device, 16384, 16384))
    rows.append(time_paged_prefill(device, 16384, 4096))
    for batch, seq_len in ((1, 4096), (1, 131072), (1, 1048576), (8, 32768), (32, 4096),
                           (32, 32768), (128, 4096), (128, 32768)):  # fmt: skip
        rows.append(time_decode_gqa(device, batch, seq_len))
    for heads in (16, 128):
        for batch, seq_len in ((1, 4096), (1, 131072), (8, 32768), (32, 8192), (128, 4096)):
            rows.append(time_decode_mla(device, batch, seq_len, heads))
    return rows


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
    sweeps = run_sweeps(device) if args.sweep else []
    if sweeps:
        print_table(sweeps)
    timings = run_timings(device)
    print_table(timings)
    result = dict(gpu=torch.cuda.get_device_name(), checks=checks, sweeps=sweeps, timings=timings)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(c["ok"] for c in checks) else 1
