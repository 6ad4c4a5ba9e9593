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
import math

import torch
import triton.testing

from rayinfer.bench.attention_cases import gather_paged, paged_gqa_case, paged_mla_case
from rayinfer.bench.attention_checks import run_checks
from rayinfer.kernels import activation, mla_attention, paged_attention, prefill_attention, rotary
from rayinfer.kernels import rms_norm as rms_norm_ops

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


def time_prefill(device, seq_len, heads=16, dim_qk=128, dim_v=128, params=None, baseline=True):
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
        sdpa = lambda: SDPA(qt, kt, vt, is_causal=True, scale=scale)  # noqa: E731
        baseline = bench_ms(sdpa) if baseline else None
    flops = causal_flops(seq_len, seq_len, heads, dim_qk, dim_v)
    return dict(
        kernel=f"prefill {heads}x{dim_qk}/{dim_v}",
        shape=f"{seq_len} tokens",
        ours_ms=ours,
        baseline_ms=baseline,
        baseline=f"SDPA {backend.name.lower()}",
        ratio=baseline / ours if baseline else None,
        tflops=flops / ours / 1e9,
        roofline_share=flops / ours / 1e9 / PEAK_TFLOPS,
    )


def time_paged_prefill(device, context_len, chunk_len, heads=16, dim=128, params=None) -> dict:
    """The last `chunk_len` tokens of a `context_len` context, K/V read through a paged cache."""
    case = paged_gqa_case([context_len], [chunk_len], heads, heads, dim, 16, BF16, device)
    del case["query_start_loc"]
    starts = torch.tensor([0, chunk_len], dtype=torch.int32, device=device)
    with launch_params_override("prefill_attention", params):
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


def time_decode_gqa(device, batch, seq_len, heads=32, kv_heads=8, dim=128, params=None,
                    baseline=True):  # fmt: skip
    case = paged_gqa_case([seq_len] * batch, [1] * batch, heads, kv_heads, dim, 16, BF16, device)
    args = (case["query"], case["kv_cache"], case["block_tables"], case["seq_lens"], dim**-0.5)
    with launch_params_override("paged_attention", params):
        ours = bench_ms(lambda: paged_attention.paged_decode_attention(*args))

    def gather_then_sdpa():
        context = gather_paged(case["kv_cache"], case["block_tables"], seq_len)  # [B,S,2,Hkv,D]
        key, value = context[:, :, 0].transpose(1, 2), context[:, :, 1].transpose(1, 2)
        return SDPA(case["query"][:, :, None], key, value, scale=dim**-0.5, enable_gqa=True)

    baseline = bench_ms(gather_then_sdpa) if baseline else None
    kv_bytes = batch * seq_len * 2 * kv_heads * dim * 2
    return dict(
        kernel=f"decode gqa {heads}/{kv_heads}x{dim}",
        shape=f"B={batch} ctx={seq_len}",
        ours_ms=ours,
        baseline_ms=baseline,
        baseline="gather + SDPA",
        ratio=baseline / ours if baseline else None,
        tb_per_s=kv_bytes / ours / 1e9,
        roofline_share=kv_bytes / ours / 1e-3 / PEAK_BYTES_PER_S,
    )


def time_decode_mla(device, batch, seq_len, heads, params=None, baseline=True) -> dict:
    case = paged_mla_case([seq_len] * batch, heads, 512, 64, 16, BF16, device)
    scale = 192**-0.5
    args = (case["q_latent"], case["q_pe"], case["kv_cache"], case["block_tables"])
    with launch_params_override("mla_attention", params):
        ours = bench_ms(lambda: mla_attention.mla_decode_attention(*args, case["seq_lens"], scale))

    def gather_then_attend():
        """torch's absorbed MLA: gather the latents, two matmuls and a softmax (SDPA's math
        path would expand the shared latent to every head: 72 GiB at 8 x 32k x 128 heads)."""
        context = gather_paged(case["kv_cache"], case["block_tables"], seq_len)  # [B, S, 576]
        query = torch.cat((case["q_latent"], case["q_pe"]), dim=-1)  # [B, N, 576]
        scores = torch.bmm(query, context.transpose(1, 2)).float() * scale  # [B, N, S]
        return torch.bmm(scores.softmax(-1).to(BF16), context[..., :512])  # [B, N, 512]

    baseline = bench_ms(gather_then_attend) if baseline else None
    kv_bytes = batch * seq_len * 576 * 2
    return dict(
        kernel=f"decode mla {heads} heads",
        shape=f"B={batch} ctx={seq_len}",
        ours_ms=ours,
        baseline_ms=baseline,
        baseline="gather + bmm/softmax/bmm",
        ratio=baseline / ours if baseline else None,
        tb_per_s=kv_bytes / ours / 1e9,
        roofline_share=kv_bytes / ours / 1e-3 / PEAK_BYTES_PER_S,
    )


def time_small_ops(device) -> list[dict]:
    """Memory-bound fused ops vs the torch references they replace, as HBM bandwidth."""
    tokens = 4096
    x, residual = (torch.randn(tokens, 7168, device=device, dtype=BF16) for _ in range(2))
    weight = torch.ones(7168, device=device, dtype=BF16)
    gate_up = torch.randn(tokens, 2 * 2048, device=device, dtype=BF16)
    positions = torch.arange(tokens, device=device)
    q_pe = torch.randn(tokens, 128, 64, device=device, dtype=BF16)
    k_pe = torch.randn(tokens, 1, 64, device=device, dtype=BF16)
    latent = torch.randn(tokens, 512, device=device, dtype=BF16)
    cache = torch.zeros(tokens // 16, 16, 576, device=device, dtype=BF16)
    slots = torch.randperm(tokens, device=device)
    inv_freq = torch.rand(32, device=device)
    cases = [  # (name, ours, reference, bytes read + written)
        ("rms_norm + residual", lambda: rms_norm_ops.rms_norm(x, weight, 1e-6, residual),
         lambda: rms_norm_ops.rms_norm_reference(x, weight, 1e-6, residual), 4 * x.nbytes),
        ("silu_and_mul", lambda: activation.silu_and_mul(gate_up),
         lambda: activation.silu_and_mul_reference(gate_up), 1.5 * gate_up.nbytes),
        ("rope + mla cache write", lambda: rotary.rotary_embedding_and_cache(
            positions, q_pe, k_pe, inv_freq, cache, slots, latent, True),
         lambda: rotary.rotary_embedding_and_cache_reference(
            positions, q_pe, k_pe, inv_freq, cache, slots, latent, True),
         2 * (q_pe.nbytes + k_pe.nbytes) + 2 * latent.nbytes),
    ]  # fmt: skip
    rows = []
    for name, ours_fn, reference_fn, num_bytes in cases:
        ours, baseline = bench_ms(ours_fn), bench_ms(reference_fn)
        rows.append(dict(kernel=name, shape=f"{tokens} tokens", ours_ms=ours,
                         baseline_ms=baseline, baseline="torch reference", ratio=baseline / ours,
                         tb_per_s=num_bytes / ours / 1e9,
                         roofline_share=num_bytes / ours / 1e-3 / PEAK_BYTES_PER_S))  # fmt: skip
    return rows


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
    prefill, decode, mla = (best.get(op) for op in SWEEPS)
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
