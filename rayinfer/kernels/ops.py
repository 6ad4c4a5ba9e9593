"""The engine's only door to kernels: Triton on CUDA where a kernel exists, the torch reference
elsewhere. Layers call `ops.<name>`; nothing else picks an implementation. Where several kernels
serve one op, the caller's `KernelBackends` (kernels/backends.py) says which."""

from __future__ import annotations

import torch

from rayinfer.kernels.attention.paged_attention import paged_attention_reference
from rayinfer.kernels.attention.prefill_attention import (
    paged_mixed_attention,
)
from rayinfer.kernels.attention.reshape_and_cache import (
    reshape_and_cache as reshape_and_cache_triton,
)
from rayinfer.kernels.attention.reshape_and_cache import reshape_and_cache_reference
from rayinfer.kernels.backends import DEFAULT_BACKENDS, KernelBackends
from rayinfer.kernels.cache_rows import CacheRowsTable, cache_rows_reference
from rayinfer.kernels.cache_rows import cache_rows as cache_rows_triton
from rayinfer.kernels.dsa.dsa_cache import dsa_write_cache as dsa_write_cache_triton
from rayinfer.kernels.dsa.dsa_indexer import dsa_index_topk as dsa_index_topk_triton
from rayinfer.kernels.dsa.dsa_indexer import dsa_index_topk_reference, dsa_write_cache_reference
from rayinfer.kernels.dsa.sparse_mla import sparse_mla_attention as sparse_mla_attention_triton
from rayinfer.kernels.dsa.sparse_mla import sparse_mla_attention_reference
from rayinfer.kernels.dsa.v4_attention import v4_attention as v4_attention_triton
from rayinfer.kernels.dsa.v4_attention import v4_attention_reference, v4_write_rows_reference
from rayinfer.kernels.dsa.v4_attention import v4_write_rows as v4_write_rows_triton
from rayinfer.kernels.elementwise import rotary as _rotary
from rayinfer.kernels.elementwise.activation import silu_and_mul as silu_and_mul_triton
from rayinfer.kernels.elementwise.activation import silu_and_mul_reference
from rayinfer.kernels.elementwise.rms_norm import rms_norm as rms_norm_triton
from rayinfer.kernels.elementwise.rms_norm import rms_norm_reference
from rayinfer.kernels.fp8.fp8_gemm import fp8_gemm_auto, fp8_gemm_reference
from rayinfer.kernels.fp8.fp8_quant import fp8_quant as fp8_quant_triton
from rayinfer.kernels.fp8.fp8_quant import fp8_quant_reference
from rayinfer.kernels.mla.mla_attention import mla_decode_attention as mla_decode_attention_triton
from rayinfer.kernels.mla.mla_attention import (
    mla_decode_attention_reference,
    mla_gather_context_reference,
    mla_prefill_attention_reference,
    mla_write_cache_reference,
)
from rayinfer.kernels.mla.mla_attention import mla_prefill_attention as mla_prefill_attention_triton
from rayinfer.kernels.mla.mla_attention import mla_write_cache as mla_write_cache_triton
from rayinfer.kernels.moe import moe_pack
from rayinfer.kernels.moe.fused_moe import dequantize_experts_reference, fused_moe_reference
from rayinfer.kernels.moe.fused_moe import fused_moe as fused_moe_triton
from rayinfer.kernels.moe.fused_moe_mxfp4 import (
    fused_moe_mxfp4,
    fused_moe_mxfp4_reference,
    is_mxfp4,
)
from rayinfer.kernels.moe.fused_moe_small import fits_small_batch, fused_moe_small_batch
from rayinfer.kernels.moe.moe_combine import moe_combine as moe_combine_triton
from rayinfer.kernels.moe.moe_combine import moe_combine_reference
from rayinfer.kernels.moe.moe_routing import MoeRouting, moe_routing_reference
from rayinfer.kernels.moe.moe_routing_kernel import moe_routing as moe_routing_triton
from rayinfer.kernels.moe.mxfp4_layouts import to_shipped
from rayinfer.kernels.moe.router_logits import router_logits as router_logits_triton
from rayinfer.kernels.moe.router_logits import router_logits_reference, uses_kernel
from rayinfer.kernels.triton_compat import HAS_TRITON


def _on_cuda(x: torch.Tensor) -> bool:
    """Whether the Triton kernel runs: a CUDA tensor and Triton installed."""
    return x.is_cuda and HAS_TRITON


def router_logits(x, weight):
    """MoE router logits in float32: x [T, H] @ weight [E, H] float32 ^T -> [T, E]; 16-bit
    activations of a prefill read as they are (no float32 copy of x)."""
    if _on_cuda(x) and uses_kernel(x):
        return router_logits_triton(x, weight)
    return router_logits_reference(x, weight)


def rms_norm(x, weight, eps, residual=None):
    """x [..., H] (plus residual [..., H]) -> normed, or (normed, x + residual)."""
    if _on_cuda(x):
        return rms_norm_triton(x, weight, eps, residual)
    return rms_norm_reference(x, weight, eps, residual)


def cache_rows(table: CacheRowsTable, packed, slots, to_cache: bool) -> None:
    """packed [num_tokens * row bytes of all layers] uint8, layer-major <-> every layer's cache
    rows at slots [num_tokens] int64 (to_cache: into the cache); one launch on CUDA."""
    if _on_cuda(packed):
        cache_rows_triton(table, packed, slots, to_cache)
    else:
        cache_rows_reference(table.layers, packed, slots, to_cache)


def silu_and_mul(x, limit=None):
    """[..., 2I] gate then up -> [..., I]; limit (DeepSeek-V4's swiglu_limit): gate clamped
    above and up both ways first."""
    if _on_cuda(x):
        return silu_and_mul_triton(x, limit)
    return silu_and_mul_reference(x, limit)


def fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None, *,
              swiglu_limit=None, backends: KernelBackends = DEFAULT_BACKENDS,
              mxfp4_small_scales=False, mxfp4_layout="shipped"):  # fmt: skip
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I] (x.dtype, or float8_e4m3fn with [E, N/128, K/128]
    float32 block scales), topk_weights [T, K] float32, topk_ids [T, K] int64 -> [T, H].
    MXFP4 experts (DeepSeek-V4), chosen by their dtypes: w13 [E, 2I, H/2] and w2 [E, H, I/2]
    packed e2m1 bytes with UE8M0 byte scales [E, 2I, H/32] and [E, H, I/32]
    (kernels/moe/fused_moe_mxfp4.py; the weights stay packed on the GPU).
    swiglu_limit (DeepSeek-V4): the experts' activation is silu(min(gate, l)) * clamp(up, -l, l).
    mxfp4_small_scales: every UE8M0 byte is at most 128 (the kernel multiplies once).
    mxfp4_layout: how the packed bytes are kept (kernels/moe/mxfp4_layouts.py): "shipped" or
    "swapped" (the four-lane kernel's shorter lookup).
    On CUDA with backends.small_batch_moe, a few slots take the two-launch kernel
    (fused_moe_small.py; correct on an H200, not yet faster there than the general path)."""
    limit = {"swiglu_limit": swiglu_limit}
    if is_mxfp4(w13, w13_scale):
        # float32 activations (parity runs) and CPUs take the float32 dequantized reference
        if _on_cuda(x) and x.dtype != torch.float32:
            args = (x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
            return fused_moe_mxfp4(*args, small_scales=mxfp4_small_scales,
                                   bits_swapped=mxfp4_layout == "swapped", **limit)  # fmt: skip
        w13, w2 = to_shipped(w13, mxfp4_layout), to_shipped(w2, mxfp4_layout)
        args = (x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, swiglu_limit)
        return fused_moe_mxfp4_reference(*args)
    if _on_cuda(x):
        if backends.small_batch_moe and fits_small_batch(topk_ids, w13, x):
            return fused_moe_small_batch(x, w13, w2, topk_weights, topk_ids, **limit)
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, **limit)
    if w13_scale is not None:
        w13 = dequantize_experts_reference(w13, w13_scale).to(x.dtype)
        w2 = dequantize_experts_reference(w2, w2_scale).to(x.dtype)
    return fused_moe_reference(x, w13, w2, topk_weights, topk_ids, swiglu_limit)


def moe_combine(back, row_index, out_dtype=None, addends=()):
    """back [S, H] rows returned by combine's all-to-all, row_index [T, world] int32 (row of each
    token from each rank, -1: none), addends: up to two [T, H] -> [T, H] out_dtype: per token,
    the float32 sum of its addends' rows and its rows."""
    if _on_cuda(back):
        return moe_combine_triton(back, row_index, out_dtype, addends)
    return moe_combine_reference(back, row_index, out_dtype, addends)


def pack_for_every_rank(x, topk_ids, topk_weights, world, ids_at, row_bytes):
    """x [T, H], topk_ids [T, K] (global), topk_weights [T, K] -> [world * T, row_bytes] uint8:
    every token's row once per rank (layout in kernels/moe/moe_pack.py)."""
    if _on_cuda(x):
        return moe_pack.pack_for_every_rank(x, topk_ids, topk_weights, world, ids_at, row_bytes)
    return moe_pack.pack_for_every_rank_reference(
        x, topk_ids, topk_weights, world, ids_at, row_bytes
    )


def pack_fp8_for_every_rank(x, topk_ids, topk_weights, world, scale_at, ids_at, row_bytes):
    """x [T, H] -> [world * T, row_bytes] uint8: every token quantized once to e4m3 with its own
    scale, its row written once per rank (layout in kernels/moe/moe_pack.py)."""
    args = (x, topk_ids, topk_weights, world, scale_at, ids_at, row_bytes)
    if _on_cuda(x):
        return moe_pack.pack_fp8_for_every_rank(*args)
    return moe_pack.pack_fp8_for_every_rank_reference(*args)


def unpack_fp8_rows(rows, hidden, scale_at, dtype):
    """Arrived FP8 rows [R, row_bytes] uint8 -> [R, H] dtype (values times their row's scale)."""
    if _on_cuda(rows):
        return moe_pack.unpack_fp8_rows(rows, hidden, scale_at, dtype)
    return moe_pack.unpack_fp8_rows_reference(rows, hidden, scale_at, dtype)


def localize_expert_ids(rows, ids_at, topk, first_expert, num_local):
    """Arrived rows [R, row_bytes] uint8 -> (local expert ids [R, K] int64, -1 off this rank;
    weights [R, K] float32, 0 off this rank)."""
    if _on_cuda(rows):
        return moe_pack.localize_expert_ids(rows, ids_at, topk, first_expert, num_local)
    return moe_pack.localize_expert_ids_reference(rows, ids_at, topk, first_expert, num_local)


def moe_routing(
    router_logits,
    top_k,
    scoring="softmax",
    renormalize=False,
    num_groups=1,
    topk_groups=1,
    correction_bias=None,
    routed_scaling_factor=1.0,
    backends: KernelBackends = DEFAULT_BACKENDS,
) -> MoeRouting:
    """[T, E] router logits -> MoeRouting(topk_weights [T, K] float32, topk_ids [T, K] int64).
    On CUDA the one-launch kernel (moe_routing_kernel.py) unless backends.fused_routing is
    off."""
    fused = backends.fused_routing and _on_cuda(router_logits)
    route = moe_routing_triton if fused else moe_routing_reference
    return route(
        router_logits,
        top_k,
        scoring,
        renormalize,
        num_groups,
        topk_groups,
        correction_bias,
        routed_scaling_factor,
    )


def reshape_and_cache(key, value, kv_cache, slot_mapping):
    """Write K/V [T, Hkv, D] into kv_cache [blocks, block_size, 2, Hkv, D] at slot_mapping [T]."""
    if _on_cuda(key):
        reshape_and_cache_triton(key.contiguous(), value.contiguous(), kv_cache, slot_mapping)
    else:
        reshape_and_cache_reference(key, value, kv_cache, slot_mapping)


def paged_attention(query, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                    query_lens_cpu=None, seq_lens_cpu=None, new_kv=None,
                    backends: KernelBackends = DEFAULT_BACKENDS):  # fmt: skip
    """query [T, Hq, D] of a mixed batch over the paged cache -> [T, Hq, D]. On CUDA the decodes
    take the split-K decode kernel and the prefill chunks the varlen kernel; `query_lens_cpu`
    ([B] host ints) tells them apart without a device sync (absent: T == B means all decodes).
    new_kv: the step's own (key, value) [T, Hkv, D] with seq_lens_cpu, so that chunks with no
    cached prefix attend to them directly (see paged_mixed_attention)."""
    if not _on_cuda(query):
        return paged_attention_reference(
            query, kv_cache, block_tables, seq_lens, query_start_loc, scale
        )
    if query_lens_cpu is None:
        is_decode = query.shape[0] == seq_lens.shape[0]
        query_lens_cpu = [1] * query.shape[0] if is_decode else query_start_loc.diff().tolist()
    return paged_mixed_attention(
        query, kv_cache, block_tables, seq_lens, query_start_loc, query_lens_cpu, scale,
        seq_lens_cpu, new_kv, backends.prefill_attention,
    )  # fmt: skip


def mla_write_cache(kv_cache, slot_mapping, kv_c, k_pe):
    """Store latents kv_c [T, L] and k_pe [T, R] into kv_cache [blocks, block_size, L + R]."""
    if _on_cuda(kv_c):
        mla_write_cache_triton(kv_cache, slot_mapping, kv_c.contiguous(), k_pe.contiguous())
    else:
        mla_write_cache_reference(kv_cache, slot_mapping, kv_c, k_pe)


def mla_gather_context(kv_cache, block_table, seq_len):
    """One sequence's cached latents -> [seq_len, L + R]."""
    return mla_gather_context_reference(kv_cache, block_table, seq_len)


def mla_prefill_attention(q_nope, q_pe, k_nope, k_pe, value, scale, out, bounds=None,
                          is_causal=True, lse=None,
                          backends: KernelBackends = DEFAULT_BACKENDS):  # fmt: skip
    """Expanded MLA prefill: q_nope [q, N, Dn] and q_pe [q, N, R] over k_nope [s, N, Dn], the
    shared k_pe [s, 1, R] and value [s, N, Dv] -> out [q, N, Dv] (written). One sequence's last
    q of s tokens, or with bounds (cu_seqlens [B + 1] int32 on the device, longest) new prompts
    packed, each causal over its own rows. is_causal False: every query sees all s keys; lse
    [q, N] float32, if given, gets each row's log-sum-exp (to merge parts of a context)."""
    args = (q_nope, q_pe, k_nope, k_pe, value, scale, out, bounds, is_causal, lse)
    if _on_cuda(q_nope):
        return mla_prefill_attention_triton(*args, backend=backends.prefill_attention)
    return mla_prefill_attention_reference(*args)


def mla_decode_attention(q_latent, q_pe, kv_cache, block_tables, seq_lens, scale,
                         backends: KernelBackends = DEFAULT_BACKENDS):  # fmt: skip
    """Absorbed MLA decode: q_latent [B, N, L], q_pe [B, N, R] -> latent output [B, N, L].
    seq_lens: [B] host ints, or a device int32 tensor (what a CUDA graph can capture)."""
    if _on_cuda(q_latent):
        return mla_decode_attention_triton(
            q_latent, q_pe, kv_cache, block_tables, seq_lens, scale, backend=backends.mla_decode
        )
    return mla_decode_attention_reference(q_latent, q_pe, kv_cache, block_tables, seq_lens, scale)


def dsa_write_cache(kv_cache, slot_mapping, kv_c, k_pe, index_key, index_fp8=False):
    """Store a DSA layer's rows: kv_c [T, L], k_pe [T, R] and index_key [T, D] (None: a layer
    without indexer) into kv_cache [blocks, block_size, L + R + key columns] at slot_mapping
    [T]; negative slots (padding) skipped. index_fp8: the key as D FP8 e4m3 bytes and a float32
    scale (kernels/dsa/dsa_index_fp8.py). On CUDA one program per token
    (kernels/dsa/dsa_cache.py), with no data-dependent shape, so a decode graph captures it."""
    args = (kv_cache, slot_mapping, kv_c, k_pe, index_key, index_fp8)
    if _on_cuda(kv_c):
        return dsa_write_cache_triton(*args)
    dsa_write_cache_reference(*args)


def dsa_index_topk(q_index, weights, kv_cache, key_offset, block_tables, query_seq, positions,
                   topk, max_context, index_fp8=False, spread=None):  # fmt: skip
    """The lightning indexer's selection: q_index [T, Hi, D] and weights [T, Hi] float32 over
    each query's visible context (positions <= its own) -> [T, topk] int32 cache slots, -1
    padded (kernels/dsa/dsa_indexer.py; index_fp8: keys cached as FP8 + scale; spread:
    DeepSeek-V4's pooled entries (rate, share), max_context then counting entries and the
    selection entry numbers). On CUDA the Triton scores, then a top-k over chunks of queries
    whose scores stay within 1 GiB."""
    if _on_cuda(q_index):
        return dsa_index_topk_triton(
            q_index, weights, kv_cache, key_offset, block_tables, query_seq, positions, topk,
            max_context, index_fp8, spread=spread,
        )  # fmt: skip
    return dsa_index_topk_reference(
        q_index, weights, kv_cache, key_offset, block_tables, query_seq, positions, topk,
        max_context, index_fp8, spread,
    )  # fmt: skip


def v4_attention(queries, window_cache, window_tables, cache, block_tables, seq_ids, positions,
                 window, spread, entry_list, max_entries, sinks, scale,
                 max_position):  # fmt: skip
    """DeepSeek-V4 attention (kernels/dsa/v4_attention.py): queries [T, N, D] over each one's
    window of raw keys (the window pool), its pooled entries spread over the paged cache's rows
    (spread (rate, share, column); entry_list [T, K] int32 listed, or None: every entry it has
    reached) and per-head sinks [N] -> [T, N, D]."""
    fn = v4_attention_triton if _on_cuda(queries) else v4_attention_reference
    return fn(
        queries, window_cache, window_tables, cache, block_tables, seq_ids, positions, window,
        spread, entry_list, max_entries, sinks, scale, max_position,
    )  # fmt: skip


def v4_write_rows(rows, slots, values, column):
    """rows [num_slots, W] (a DeepSeek-V4 cache's view) [slots[t], column:column + C] =
    values [T, C], skipping negative slots (kernels/dsa/v4_attention.py)."""
    fn = v4_write_rows_triton if _on_cuda(values) else v4_write_rows_reference
    fn(rows, slots, values, column)


def sparse_mla_attention(q_latent, q_pe, kv_cache, slots, scale):
    """Absorbed MLA over per-query slot lists: q_latent [T, N, L], q_pe [T, N, R], slots [T, K]
    int32 (-1 skipped) -> latent output [T, N, L] (kernels/dsa/sparse_mla.py)."""
    if _on_cuda(q_latent):
        return sparse_mla_attention_triton(q_latent, q_pe, kv_cache, slots, scale)
    return sparse_mla_attention_reference(q_latent, q_pe, kv_cache, slots, scale)


def fp8_quant(x, group_size=128, column_major_scales=True):
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, K/group] float32), x ~= q * scale.
    Scales column-major by default (strides (1, M)): what fp8_gemm's cuBLAS path reads as is."""
    if _on_cuda(x):
        return fp8_quant_triton(x, group_size, column_major_scales)
    q, scale = fp8_quant_reference(x, group_size)
    return q, scale.t().contiguous().t() if column_major_scales else scale


def fp8_gemm(a, a_scale, b, b_scale, out_dtype=torch.bfloat16,
             backends: KernelBackends = DEFAULT_BACKENDS):  # fmt: skip
    """a [M, K] fp8 with a_scale [M, K/128], b [N, K] fp8 with b_scale [N/128, K/128] -> [M, N].
    On CUDA: torch's blockwise _scaled_mm or the Triton kernel (fp8_gemm.fp8_gemm_backend)."""
    if _on_cuda(a):
        return fp8_gemm_auto(a, a_scale, b, b_scale, out_dtype, backends.fp8_gemm)
    return fp8_gemm_reference(a, a_scale, b, b_scale, out_dtype)


def rotary_embedding(positions, query, key, inv_freq, is_interleaved=False, attention_factor=1.0):
    """positions [T]; query [T, Hq, D], key [T, Hk, D]; inv_freq [R / 2] -> rotated copies."""
    if _on_cuda(query):
        return _rotary.rotary_embedding(
            positions, query, key, inv_freq.float(), is_interleaved, attention_factor
        )
    return _rotary.rotary_embedding_reference(
        positions, query, key, inv_freq, is_interleaved, attention_factor
    )


def rotary_embedding_and_cache(positions, query, key, inv_freq, kv_cache, slot_mapping, companion,
                               is_interleaved=False, attention_factor=1.0):  # fmt: skip
    """RoPE, then the rotated key (GQA: with V; MLA: k_pe [T, 1, R] with c_kv) into the cache."""
    fn = _rotary.rotary_embedding_and_cache
    if not _on_cuda(query):
        fn = _rotary.rotary_embedding_and_cache_reference
    return fn(positions, query, key, inv_freq.float(), kv_cache, slot_mapping, companion,
              is_interleaved, attention_factor)  # fmt: skip
