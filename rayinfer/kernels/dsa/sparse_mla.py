"""Sparse MLA attention in absorbed form: every query attends to its own list of cached tokens.

With q_nope absorbed through W_UK (q_latent [N, L]) the score of a cached token with latent c_kv
[L] and rope key k_pe [R] is (q_latent . c_kv + q_pe . k_pe) * scale, and the output is the
softmax-weighted sum of the c_kv rows ([N, L]), which the caller maps through W_UV. Each query
(a prefill row or a decode) reads only the rows its slot list names; -1 entries are skipped.
The same op serves prefill and decode: a query's cost is its list's length, not its context's.

The Triton kernel runs one program per (head group, query, split of the slot list): it gathers
BLOCK_N listed rows at a time (c_kv and k_pe of each, once for the group's BLOCK_H heads), keeps
an online softmax, and the splits of a long list (index_topk 2048 at decode) are merged by their
log-sum-exps with mla_decode's combine kernel. A prefill step has enough queries to fill the GPU
with one split each, which then writes the output directly.

On sm_90 a config entry with a Gluon layout ("gluon_ws", "gluon_ws_tokens") runs the split kernel
of sparse_mla_hopper instead (same partial outputs, same combine), with the dense Gluon MLA
decode's split policy ("whole_waves", "programs_per_sm") and its "fallback" Triton tiles
wherever it cannot run or `backend` is "triton" (KernelBackends.mla_decode).
"""

from __future__ import annotations

import torch

from rayinfer.kernels.attention.paged_attention import choose_split, dot_precision, launch_params
from rayinfer.kernels.dsa import sparse_mla_hopper
from rayinfer.kernels.gluon_compat import GLUON_BUILD_ERRORS, gluon_enabled, gluon_failed
from rayinfer.kernels.mla.mla_decode import (
    GLUON_LAYOUTS,
    per_sm,
    split_buffers,
    triton_fallback,
)
from rayinfer.kernels.mla.mla_decode_kernels import _mla_combine_kernel
from rayinfer.kernels.triton_compat import tl, triton

# float32 on a GPU (parity checks, not a speed path): tiles that fit shared memory at four bytes
# an element on every target (sm_80, sm_89, sm_90).
FLOAT32_TILES = dict(BLOCK_H=16, BLOCK_N=16, num_warps=4, num_stages=2)
GLUON_KERNEL = "sparse_mla"  # its name for gluon_compat's failure record


def sparse_mla_attention_reference(
    q_latent: torch.Tensor,  # [T, N, L]: q_nope absorbed through W_UK
    q_pe: torch.Tensor,  # [T, N, R]: roped query rope part
    kv_cache: torch.Tensor,  # [num_blocks, block_size, W]: c_kv at [0, L), k_pe at [L, L + R)
    slots: torch.Tensor,  # [T, K] int32: cache slots each query attends to, -1 padded
    scale: float,
) -> torch.Tensor:  # [T, N, L]: attention output in latent space (before W_UV)
    latent_rank, rope_dim = q_latent.shape[-1], q_pe.shape[-1]
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    rows = flat[slots.long().clamp(min=0)][..., : latent_rank + rope_dim]  # [T, K, L + R]
    rows = rows.to(q_latent.dtype)
    kv_c, k_pe = rows[..., :latent_rank], rows[..., latent_rank:]  # [T, K, L], [T, K, R]
    scores = q_latent @ kv_c.transpose(1, 2) + q_pe @ k_pe.transpose(1, 2)  # [T, N, K]
    scores = (scores.float() * scale).masked_fill((slots < 0)[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(kv_c.dtype)  # [T, N, K]
    return probs @ kv_c  # [T, N, L]


@triton.jit
def _sparse_mla_split_kernel(
    q_latent_ptr, q_pe_ptr, cache_ptr, slots_ptr, mid_out_ptr, mid_lse_ptr,
    scale, num_heads, num_listed, slots_per_split,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_row, stride_slots,
    stride_mid_t, stride_mid_h, stride_mid_s,
    LATENT_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, IS_ONLY_SPLIT: tl.constexpr,
):  # fmt: skip
    """One (head group, query, split): partial softmax . c_kv over the split's listed slots.

    Each gathered [BLOCK_N, L + R] tile feeds both dots: the scores (q_latent . c_kv + q_pe .
    k_pe) and the output (p @ c_kv, c_kv being the value too). -1 slots load nothing and weigh 0.
    """
    # Head groups vary fastest (they share the gathered rows in L2); the queries are on grid
    # axis 0 too, which has no 65,535 limit.
    num_groups = tl.cdiv(num_heads, BLOCK_H)
    head_start = (tl.program_id(0) % num_groups) * BLOCK_H
    query = (tl.program_id(0) // num_groups).to(tl.int64)  # T x N x L may exceed 2**31
    split = tl.program_id(1)
    split_start = split * slots_per_split
    split_end = tl.minimum(split_start + slots_per_split, num_listed)
    heads = head_start + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    head_mask = heads < num_heads
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    qk_scale = scale * 1.4426950408889634  # log2(e): exp2 instead of exp
    ql_ptrs = q_latent_ptr + query * stride_qlt + heads[:, None] * stride_qlh + offs_l[None, :]
    ql_mask = head_mask[:, None] & (offs_l[None, :] < LATENT_RANK)
    q_latent = tl.load(ql_ptrs, mask=ql_mask, other=0.0)  # [BLOCK_H, BLOCK_L]
    qp_ptrs = q_pe_ptr + query * stride_qpt + heads[:, None] * stride_qph + offs_r[None, :]
    q_pe = tl.load(qp_ptrs, mask=head_mask[:, None] & (offs_r[None, :] < ROPE_DIM), other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    slot_row = slots_ptr + query * stride_slots
    for start in range(split_start, split_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] entries of the slot list
        slot = tl.load(slot_row + offs_n, mask=offs_n < split_end, other=-1)
        is_listed = slot >= 0
        row_ptrs = cache_ptr + slot.to(tl.int64)[:, None] * stride_row  # multi-GB caches
        l_mask = is_listed[:, None] & (offs_l[None, :] < LATENT_RANK)
        kv_c = tl.load(row_ptrs + offs_l[None, :], mask=l_mask, other=0.0)  # [BLOCK_N, BLOCK_L]
        r_mask = is_listed[:, None] & (offs_r[None, :] < ROPE_DIM)
        k_pe = tl.load(row_ptrs + LATENT_RANK + offs_r[None, :], mask=r_mask, other=0.0)
        kv_c, k_pe = kv_c.to(q_latent.dtype), k_pe.to(q_latent.dtype)
        scores = tl.dot(q_latent, tl.trans(kv_c), input_precision=DOT_PRECISION)
        scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=DOT_PRECISION)
        scores = tl.where(is_listed[None, :], scores * qk_scale, float("-inf"))  # [H, N]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no listed slot yet: p = 0
        p = tl.math.exp2(scores - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(kv_c.dtype), kv_c, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # no listed slot: zeros, weighted 0 when combined
    mid_ptrs = mid_out_ptr + query * stride_mid_t + split * stride_mid_s
    mid_ptrs += heads[:, None] * stride_mid_h + offs_l[None, :]
    mid_mask = head_mask[:, None] & (offs_l[None, :] < LATENT_RANK)
    tl.store(mid_ptrs, (acc / l_safe[:, None]).to(mid_out_ptr.dtype.element_ty), mask=mid_mask)
    if not IS_ONLY_SPLIT:  # else mid_out is the output and no combine follows
        lse = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))  # [BLOCK_H] log2
        num_splits = tl.num_programs(1)
        tl.store(mid_lse_ptr + (query * num_heads + heads) * num_splits + split, lse,
                 mask=head_mask)  # fmt: skip


def sparse_mla_params(q_latent: torch.Tensor) -> dict:
    """Tiles and split policy from configs/sparse_mla.json (bucketed by heads per rank)."""
    return launch_params("sparse_mla", q_latent.device, q_latent.shape[1])


def triton_params(params: dict, q_latent: torch.Tensor) -> dict:
    """The Triton kernel's tiles: a Gluon entry's fallback; float32 tiles for float32 on a GPU."""
    if params.get("layout") in GLUON_LAYOUTS:
        params = triton_fallback(params)
    if q_latent.dtype == torch.float32 and q_latent.is_cuda:
        params = {**params, **FLOAT32_TILES}
    return params


def heads_per_program(params: dict, num_heads: int) -> int:
    """BLOCK_H: the tile's heads, no more than the next power of two of the heads there are."""
    return max(16, triton.next_power_of_2(min(params["BLOCK_H"], num_heads)))


def split_constants(params: dict, dtype: torch.dtype, num_heads: int, latent_rank: int,
                    rope_dim: int, is_only_split: bool) -> dict:  # fmt: skip
    """The split kernel's meta-parameters (the launcher's, and the offline compile's in
    benchmarks/compile_dsa_kernels.py)."""
    return dict(
        LATENT_RANK=latent_rank, ROPE_DIM=rope_dim, BLOCK_L=triton.next_power_of_2(latent_rank),
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)),
        BLOCK_H=heads_per_program(params, num_heads), BLOCK_N=params["BLOCK_N"],
        DOT_PRECISION=dot_precision(dtype), IS_ONLY_SPLIT=is_only_split,
    )  # fmt: skip


def sparse_mla_attention(
    q_latent: torch.Tensor,  # [T, N, L]
    q_pe: torch.Tensor,  # [T, N, R]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, W >= L + R]
    slots: torch.Tensor,  # [T, K] int32, -1 skipped
    scale: float,
    params: dict | None = None,  # tile override (tests, sweeps); else sparse_mla_params
    backend: str = "auto",  # "triton" pins the Triton kernel (KernelBackends.mla_decode)
) -> torch.Tensor:  # [T, N, L]; a query with no listed slot gets zeros
    """Split launch (the Gluon kernel where the entry and operands allow, else Triton), then
    the combine where the list is split (module docstring)."""
    num_queries, num_heads, latent_rank = q_latent.shape
    rope_dim = q_pe.shape[-1]
    if q_pe.shape[:2] != (num_queries, num_heads) or slots.shape[0] != num_queries:
        raise ValueError(f"q_latent {tuple(q_latent.shape)}, q_pe {tuple(q_pe.shape)} and "
                         f"slots {tuple(slots.shape)} must share [T, N] / [T]")  # fmt: skip
    if kv_cache.dim() != 3 or kv_cache.shape[-1] < latent_rank + rope_dim:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be [blocks, block_size, "
                         f"W >= L + R = {latent_rank + rope_dim}]")  # fmt: skip
    if kv_cache.stride(-1) != 1 or kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):
        raise ValueError("kv_cache rows must be dense and its blocks one after another")
    if q_latent.stride(-1) != 1 or q_pe.stride(-1) != 1 or slots.dtype != torch.int32:
        raise ValueError("q_latent, q_pe need a dense last dim; slots must be int32")
    slots = slots.contiguous()
    found = sparse_mla_params(q_latent)
    if params and "layout" not in params and found.get("layout") in GLUON_LAYOUTS:
        found = triton_fallback(found)  # an override without a layout names Triton tiles
    params = {**found, **(params or {})}
    num_listed = slots.shape[1]
    if params.get("layout") in GLUON_LAYOUTS and backend != "triton":
        gluon_out = _gluon_split_k(q_latent, q_pe, kv_cache, slots, scale, params)
        if gluon_out is not None:
            return gluon_out
    params = triton_params(params, q_latent)
    num_groups = triton.cdiv(num_heads, heads_per_program(params, num_heads))
    split = choose_split(num_queries, num_groups, num_listed, params)
    out, mid_out, mid_lse = split_buffers(q_latent, split.num_splits)
    is_only_split = split.num_splits == 1  # the split kernel writes `out`: one launch
    constants = split_constants(params, q_latent.dtype, num_heads, latent_rank, rope_dim,
                                is_only_split)  # fmt: skip
    _sparse_mla_split_kernel[(num_groups * num_queries, split.num_splits)](
        q_latent, q_pe, kv_cache, slots, mid_out, mid_lse,
        scale, num_heads, num_listed, split.tokens_per_split,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(1), slots.stride(0),
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        **constants, num_warps=params["num_warps"], num_stages=params["num_stages"],
    )  # fmt: skip
    if not is_only_split:
        _combine_splits(mid_out, mid_lse, out, num_listed, split.tokens_per_split)
    return out


def _gluon_split_k(q_latent, q_pe, kv_cache, slots, scale, params) -> torch.Tensor | None:
    """The Gluon split kernel and the combine -> out [T, N, L]; None where it cannot serve these
    operands (or did not build with this Triton: reported once, Triton from then on)."""
    if not gluon_enabled(GLUON_KERNEL):
        return None
    q_latent = sparse_mla_hopper.with_uniform_rows(q_latent)  # (query, head) rows one apart
    q_pe = sparse_mla_hopper.with_uniform_rows(q_pe)
    params = per_sm(params, q_latent.device)
    num_queries, num_heads = q_latent.shape[:2]
    tokens_major = params["layout"] == "gluon_ws_tokens"
    block_h = heads_per_program(params, num_heads) if tokens_major else sparse_mla_hopper.HEAD_ROWS
    num_listed = slots.shape[1]
    split = choose_split(num_queries, triton.cdiv(num_heads, block_h), num_listed, params)
    if not sparse_mla_hopper.supports(q_latent, q_pe, kv_cache, slots, split.tokens_per_split):
        return None
    out, mid_out, mid_lse = split_buffers(q_latent, split.num_splits)
    try:
        sparse_mla_hopper.sparse_mla_ws_launch(
            q_latent, q_pe, kv_cache, slots, scale, mid_out, mid_lse, split.tokens_per_split,
            split.num_splits, split.num_splits == 1, tokens_major=tokens_major, block_h=block_h,
        )  # fmt: skip
    except GLUON_BUILD_ERRORS as error:
        gluon_failed(GLUON_KERNEL, error)
        return None
    if split.num_splits > 1:
        _combine_splits(mid_out, mid_lse, out, num_listed, split.tokens_per_split)
    return out


def _combine_splits(mid_out, mid_lse, out, num_listed: int, slots_per_split: int) -> None:
    """out [T, N, L] = the splits' partial outputs [T, N, S, L] weighted by their lse [T, N, S],
    through mla_decode's combine kernel: every query's list is K long, so its "seq_lens" are K
    (all S splits read; one of only -1 slots has lse -inf and weighs 0)."""
    num_queries, num_heads, num_splits, latent_rank = mid_out.shape
    listed = torch.full((num_queries,), num_listed, dtype=torch.int32, device=out.device)
    block_l = min(256, triton.next_power_of_2(latent_rank))
    _mla_combine_kernel[(num_queries, num_heads, triton.cdiv(latent_rank, block_l))](
        mid_out, mid_lse, out, listed, slots_per_split,
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        LATENT_RANK=latent_rank, BLOCK_L=block_l, BLOCK_S=triton.next_power_of_2(num_splits),
        SPLITS_PER_STEP=min(16, triton.next_power_of_2(num_splits)),
        num_warps=4 if block_l >= 256 else 2,
    )  # fmt: skip
