"""GPU correctness of the attention and small fused kernels: bf16 runs vs float32 references on
random (never zero) inputs, at shapes of real models (head dim 128, MLA 512 + 64, block size 16)."""

from __future__ import annotations

import torch

from rayinfer.bench.attention_cases import as_float, paged_gqa_case, paged_mla_case
from rayinfer.kernels import ops
from rayinfer.kernels.attention import paged_attention, prefill_attention
from rayinfer.kernels.attention import reshape_and_cache as cache_ops
from rayinfer.kernels.elementwise import activation, rotary
from rayinfer.kernels.elementwise import rms_norm as norm_ops
from rayinfer.kernels.mla import mla_attention

BF16 = torch.bfloat16


def _row(name: str, ours: torch.Tensor, reference: torch.Tensor, atol: float) -> dict:
    """ok when every |ours - reference| <= atol + 1e-2 |reference| (bf16 keeps 8 bits)."""
    diff = (ours.float() - reference.float()).abs()
    ok = bool((diff <= atol + 1e-2 * reference.float().abs()).all())
    return dict(check=name, max_abs_error=diff.max().item(), atol=atol, ok=ok)


def check_prefill(device) -> list[dict]:
    rows = []
    q_lens, k_lens = [1, 100, 1000, 777], [1, 100, 1500, 777]
    cu_q = torch.tensor([0, *q_lens], device=device).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *k_lens], device=device).cumsum(0).to(torch.int32)
    for name, heads, kv_heads, dim_qk, dim_v in (
        ("gqa", 16, 4, 128, 128),
        ("mla", 16, 16, 192, 128),
    ):
        q = torch.randn(sum(q_lens), heads, dim_qk, device=device)
        k = torch.randn(sum(k_lens), kv_heads, dim_qk, device=device)
        v = torch.randn(sum(k_lens), kv_heads, dim_v, device=device)
        scale = dim_qk**-0.5
        args = (cu_q, cu_k, max(q_lens), scale)
        ours = prefill_attention.prefill_attention(q.to(BF16), k.to(BF16), v.to(BF16), *args)
        reference = prefill_attention.prefill_attention_reference(q, k, v, *args)
        rows.append(_row(f"prefill varlen {name} {dim_qk}/{dim_v}", ours, reference, 3e-2))
    case = paged_gqa_case([1000, 1500, 700, 5], [1000, 300, 1, 5], 32, 8, 128, 16, BF16, device)
    ours = ops.paged_attention(**case, scale=128**-0.5, query_lens_cpu=[1000, 300, 1, 5])
    reference = paged_attention.paged_attention_reference(**as_float(case), scale=128**-0.5)
    rows.append(_row("paged prefill chunk+decode mix", ours, reference, 3e-2))
    return rows


def check_decode(device) -> list[dict]:
    rows = []
    lens = [1, 17, 4096, 20000, 333, 65536, 2, 1000]
    for heads, kv_heads, dim in ((32, 8, 128), (8, 8, 128), (16, 2, 64)):
        case = paged_gqa_case(lens, [1] * len(lens), heads, kv_heads, dim, 16, BF16, device)
        ours = paged_attention.paged_decode_attention(
            case["query"], case["kv_cache"], case["block_tables"], case["seq_lens"], dim**-0.5
        )
        reference = paged_attention.paged_attention_reference(**as_float(case), scale=dim**-0.5)
        rows.append(_row(f"decode gqa {heads}/{kv_heads}x{dim}", ours, reference, 2e-2))
    for heads in (16, 128):
        case = paged_mla_case(lens[:5], heads, 512, 64, 16, BF16, device)
        args = (case["block_tables"], case["seq_lens"], 192**-0.5)
        ours = mla_attention.mla_decode_attention(
            case["q_latent"], case["q_pe"], case["kv_cache"], *args
        )
        ref_case = as_float(case)
        reference = mla_attention.mla_decode_attention_reference(
            ref_case["q_latent"], ref_case["q_pe"], ref_case["kv_cache"], args[0],
            lens[:5], args[2],
        )  # fmt: skip
        rows.append(_row(f"mla decode {heads} heads", ours, reference, 2e-2))
    return rows


def check_small_ops(device) -> list[dict]:
    rows = []
    x = torch.randn(1000, 4096, device=device)
    residual = torch.randn_like(x)
    weight = 1 + 0.1 * torch.randn(4096, device=device)
    out, new_residual = norm_ops.rms_norm(x.to(BF16), weight.to(BF16), 1e-6, residual.to(BF16))
    ref_out, ref_residual = norm_ops.rms_norm_reference(x, weight, 1e-6, residual)
    rows.append(_row("rms_norm + residual", out, ref_out, 6e-2))
    rows.append(_row("rms_norm residual out", new_residual, ref_residual, 3e-2))
    gate_up = torch.randn(1000, 2 * 1536, device=device)
    rows.append(
        _row(
            "silu_and_mul",
            activation.silu_and_mul(gate_up.to(BF16)),
            activation.silu_and_mul_reference(gate_up),
            5e-2,
        )
    )
    rows.append(_check_cache_writes(device))
    rows += _check_rotary(device)
    return rows


def _check_rotary(device) -> list[dict]:
    """DeepSeek-V3 shapes: 128 heads x 64 rope dims, interleaved, YaRN factor; Llama 32/8 x 128."""
    rows = []
    positions = torch.randint(0, 100_000, (500,), device=device)
    for name, heads, kv_heads, dim, interleaved, factor in (
        ("rope mla 128x64 interleaved", 128, 1, 64, True, 1.2),
        ("rope gqa 32/8x128 neox", 32, 8, 128, False, 1.0),
    ):
        query = torch.randn(500, heads, dim, device=device)
        key = torch.randn(500, kv_heads, dim, device=device)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, device=device).float() / dim))
        args = (inv_freq, interleaved, factor)
        ours = rotary.rotary_embedding(positions, query.to(BF16), key.to(BF16), *args)
        reference = rotary.rotary_embedding_reference(positions, query, key, *args)
        rows.append(_row(name, torch.cat([t.flatten() for t in ours]),
                         torch.cat([t.flatten() for t in reference]), 2e-2))  # fmt: skip
    latent = torch.randn(500, 512, device=device, dtype=BF16)
    slots = torch.randperm(64 * 16, device=device)[:500]
    ours_cache = torch.zeros(64, 16, 576, device=device, dtype=BF16)
    reference_cache = ours_cache.clone()
    q_pe = torch.randn(500, 16, 64, device=device, dtype=BF16)
    k_pe = torch.randn(500, 1, 64, device=device, dtype=BF16)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, device=device).float() / 64))
    _, k_pe = rotary.rotary_embedding_and_cache(
        positions, q_pe, k_pe, inv_freq, ours_cache, slots, latent, True
    )
    mla_attention.mla_write_cache_reference(reference_cache, slots, latent, k_pe[:, 0])
    same = torch.equal(ours_cache, reference_cache)
    rows.append(dict(check="rope + mla cache write (exact)", max_abs_error=0.0 if same
                     else float("nan"), atol=0.0, ok=same))  # fmt: skip
    return rows


def _check_cache_writes(device) -> dict:
    key, value = (torch.randn(300, 8, 128, device=device, dtype=BF16) for _ in range(2))
    slots = torch.randperm(64 * 16, device=device)[:300]
    slots[::7] = -1
    ours = torch.zeros(64, 16, 2, 8, 128, device=device, dtype=BF16)
    reference = ours.clone()
    cache_ops.reshape_and_cache(key, value, ours, slots)
    cache_ops.reshape_and_cache_reference(key, value, reference, slots)
    latent, rope = torch.randn(300, 512, device=device), torch.randn(300, 64, device=device)
    mla_ours = torch.zeros(64, 16, 576, device=device, dtype=BF16)
    mla_reference = mla_ours.clone()
    mla_attention.mla_write_cache(mla_ours, slots, latent, rope)
    mla_attention.mla_write_cache_reference(mla_reference, slots, latent, rope)
    same = torch.equal(ours, reference) and torch.equal(mla_ours, mla_reference)
    return dict(check="reshape_and_cache + mla_write_cache (exact)", max_abs_error=0.0 if same
                else float("nan"), atol=0.0, ok=same)  # fmt: skip


def run_checks(device) -> list[dict]:
    torch.manual_seed(0)
    return check_prefill(device) + check_decode(device) + check_small_ops(device)
