"""Timed cases of the attention benchmark: each returns one row (ms, baseline ms, rate, share of
the H200 roofline) for `kernels_attention`. bf16 inputs from `attention_cases`."""

from __future__ import annotations

import contextlib

import torch
import triton.testing

from rayinfer.bench.attention_cases import gather_paged, paged_gqa_case, paged_mla_case
from rayinfer.kernels.attention import paged_attention, prefill_attention
from rayinfer.kernels.elementwise import activation, rotary
from rayinfer.kernels.elementwise import rms_norm as rms_norm_ops
from rayinfer.kernels.mla import mla_attention

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

    def patched(name, device, bucket=1):
        found = original(name, device, bucket)
        return {**found, **params} if name == op else found

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
