"""Multi-head latent attention (MLA) over the paged latent cache: torch references.

The cache of one layer is `[num_blocks, block_size, L + R]`: per token the normed compressed latent
c_kv (L = kv_lora_rank) followed by the roped shared key k_pe (R = qk_rope_head_dim).

- `mla_write_cache`: store the new tokens' (c_kv, k_pe) at their slots.
- `mla_gather_context`: one sequence's cached rows, for the expanded (prefill) form.
- `mla_causal_attention`: plain multi-head attention of the last q tokens over s context tokens.
- `mla_decode_attention`: the absorbed form, attention computed in latent space. With q_nope
  absorbed through W_UK (q_latent = q_nope @ W_UK, [N, L]) the score of a context token is
  q_latent . c_kv + q_pe . k_pe, and the output is softmax . c_kv ([N, L]), which the caller maps
  through W_UV. No per-token K or V is ever materialised.
"""

from __future__ import annotations

import functools

import torch

from rayinfer.kernels import paged_attention
from rayinfer.kernels.paged_attention import (
    causal_attention,
    choose_split,
    dot_precision,
    split_k_decode,
)
from rayinfer.kernels.prefill_attention import prefill_attention
from rayinfer.kernels.triton_compat import tl, triton


def mla_write_cache_reference(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]: updated in place
    slot_mapping: torch.Tensor,  # [T] int64: block_id * block_size + offset; < 0 skips the token
    kv_c: torch.Tensor,  # [T, L]: normed latent
    k_pe: torch.Tensor,  # [T, R]: roped shared key
) -> None:
    flat_cache = kv_cache.view(-1, kv_cache.shape[-1])  # [num_slots, L + R]
    is_real = slot_mapping >= 0  # [T]
    latent_rank = kv_c.shape[-1]
    slots = slot_mapping[is_real]
    flat_cache[slots, :latent_rank] = kv_c[is_real].to(kv_cache.dtype)
    flat_cache[slots, latent_rank:] = k_pe[is_real].to(kv_cache.dtype)


def mla_gather_context_reference(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    block_table: torch.Tensor,  # [max_blocks] int32, -1 padded
    seq_len: int,
) -> torch.Tensor:  # [seq_len, L + R]
    block_size = kv_cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = kv_cache[block_table[:num_blocks].long()]  # [n, block_size, L + R]
    return blocks.flatten(0, 1)[:seq_len]


def mla_causal_attention_reference(
    query: torch.Tensor,  # [q, N, Dqk]: the last q tokens of the context
    key: torch.Tensor,  # [s, N, Dqk]
    value: torch.Tensor,  # [s, N, Dv]
    scale: float,
) -> torch.Tensor:  # [q, N, Dv]
    """Expanded MLA is plain multi-head attention (value dim may differ from the key's)."""
    return causal_attention(query, key, value, scale)


def mla_decode_attention_reference(
    q_latent: torch.Tensor,  # [B, N, L]: q_nope absorbed through W_UK
    q_pe: torch.Tensor,  # [B, N, R]: roped query rope part
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    seq_lens: list[int],  # [B] context length of each sequence, its new token included
    scale: float,
) -> torch.Tensor:  # [B, N, L]: attention output in latent space (before W_UV)
    latent_rank = q_latent.shape[-1]
    block_size = kv_cache.shape[1]
    lengths = torch.as_tensor(seq_lens, device=q_latent.device)  # [B]
    max_len = int(lengths.max()) if lengths.numel() else 0
    tables = block_tables[:, : -(-max_len // block_size)].long().clamp(min=0)  # [B, nb]
    context = kv_cache[tables].flatten(1, 2)[:, :max_len].to(q_latent.dtype)  # [B, S, L + R]
    kv_c, k_pe = context[..., :latent_rank], context[..., latent_rank:]  # [B, S, L], [B, S, R]
    scores = q_latent @ kv_c.transpose(1, 2) + q_pe @ k_pe.transpose(1, 2)  # [B, N, S]
    is_context = torch.arange(max_len, device=q_latent.device) < lengths[:, None]  # [B, S]
    scores = (scores.float() * scale).masked_fill(~is_context[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(kv_c.dtype)  # [B, N, S]
    return probs @ kv_c  # [B, N, L]


# ---- Triton paths: absorbed decode (split-K over the latent cache) and expanded prefill ----


def mla_decode_attention(
    q_latent: torch.Tensor,  # [B, N, L]
    q_pe: torch.Tensor,  # [B, N, R]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]: new tokens already written
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    seq_lens: torch.Tensor | list[int],  # [B] context length, the new token included
    scale: float,
    params: dict | None = None,  # tile config override (sweeps, tests); else configs/*.json
) -> torch.Tensor:  # [B, N, L]
    """Each program holds BLOCK_H heads' queries and streams the shared latent rows once; the
    value tile is the key's latent part, so a cached byte is read once per head tile.

    `params["layout"]` picks the kernel: "tokens_major" / "heads_major" run the dedicated MLA
    kernel (below), absent or "shared" the split-K kernel shared with GQA. The other keys of
    `params` tune the dedicated kernel only: the shared one reads its tiles from the configs
    through `paged_attention.launch_params` (patched by the benchmarks' sweeps)."""
    latent_rank, rope_dim = q_latent.shape[-1], q_pe.shape[-1]
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != latent_rank + rope_dim:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be [blocks, bs, "
                         f"L + R = {latent_rank + rope_dim}]")  # fmt: skip
    if q_latent.stride(-1) != 1 or q_pe.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("q_latent, q_pe need a dense last dim; kv_cache must be contiguous")
    if not torch.is_tensor(seq_lens):
        seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=q_latent.device)
    seq_lens = seq_lens.to(torch.int32)
    slots = kv_cache.view(-1, latent_rank + rope_dim)  # [num_slots, L + R]
    found = paged_attention.launch_params("mla_attention", q_latent.device, q_latent.shape[1])
    params = {**found, **(params or {})}
    if params.get("layout", "shared") != "shared":
        return _mla_split_k_decode(q_latent, q_pe, slots, block_tables, seq_lens, scale, params,
                                   kv_cache.shape[1])  # fmt: skip
    layout = dict(
        heads_per_program=None, queries_per_kv=q_latent.shape[1], block_size=kv_cache.shape[1],
        head_dim_v=latent_rank, has_pe=True, stride_kv_head=0, value_offset=0, value_is_key=True,
    )  # fmt: skip
    return split_k_decode(q_latent, q_pe, slots, block_tables, seq_lens, scale, layout,
                          "mla_attention")  # fmt: skip


def _mla_split_k_decode(q_latent, q_pe, slots, block_tables, seq_lens, scale, params, block_size):
    """Split + combine launches of the dedicated kernel -> [B, N, L]. slots [num_slots, L + R]."""
    out, launch_split, launch_combine = mla_decode_launches(
        q_latent, q_pe, slots, block_tables, seq_lens, scale, params, block_size
    )
    launch_split()
    if launch_combine is not None:
        launch_combine()
    return out


def mla_tma_fits(slots: torch.Tensor, latent_rank: int, rope_dim: int, block_size: int,
                 params: dict) -> bool:  # fmt: skip
    """Whether USE_TMA can run: tiles inside one cache block, power-of-two latent and rope dims
    (the descriptors' boxes are the whole dims), 16-byte aligned rows and rope columns, sm_90+."""
    size = slots.element_size()
    dims_fit = latent_rank == triton.next_power_of_2(latent_rank) and rope_dim >= 16
    dims_fit = dims_fit and rope_dim == triton.next_power_of_2(rope_dim)
    offsets = (slots.data_ptr(), slots.stride(0) * size, latent_rank * size)
    if not dims_fit or block_size % params["BLOCK_N"] or any(o % 16 for o in offsets):
        return False
    return slots.device.type != "cuda" or torch.cuda.get_device_capability(slots.device)[0] >= 9


def _tma_scratch(device: torch.device):
    """Global scratch for the descriptors the kernel builds on device."""
    return lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device)


def mla_decode_launches(q_latent, q_pe, slots, block_tables, seq_lens, scale, params, block_size):
    """(out [B, N, L], split launch, combine launch or None): the dedicated kernel's launches on
    buffers allocated once, so that the sweep can time the split kernel and the combine apart.

    Launch options of `params` (absent: off): "USE_TMA" loads the full tiles through TMA
    descriptors over the flat cache (a tile never crosses a cache block; the last, partial tile of
    a split goes through masked pointer loads), "WARP_SPECIALIZE" runs that TMA loop with
    `tl.range(..., warp_specialize=True)`, "EVICT_FIRST" marks the pointer loads of the cache
    evict-first (the stream is read once; the partial outputs stay in L2 for the combine)."""
    num_seqs, num_heads, latent_rank = q_latent.shape
    rope_dim = q_pe.shape[-1]
    block_h = max(16, triton.next_power_of_2(min(params["BLOCK_H"], num_heads)))
    num_groups = triton.cdiv(num_heads, block_h)
    max_context = block_tables.shape[1] * block_size
    split = choose_split(num_seqs, num_groups, max_context, params)
    out = q_latent.new_empty(num_seqs, num_heads, latent_rank)  # [B, N, L]
    is_only_split = split.num_splits == 1  # the split kernel writes `out`: one launch
    mid_shape = (num_seqs, num_heads, split.num_splits, latent_rank)  # [B, N, S, L]
    mid_out = out[:, :, None] if is_only_split else out.new_empty(mid_shape, dtype=torch.float32)
    mid_lse = out.new_empty(num_seqs, num_heads, split.num_splits, dtype=torch.float32)
    use_tma = bool(params.get("USE_TMA")) and mla_tma_fits(slots, latent_rank, rope_dim,
                                                           block_size, params)  # fmt: skip
    if use_tma and slots.device.type == "cuda":
        triton.set_allocator(_tma_scratch(slots.device))  # per thread: set here
    grid = (num_groups, num_seqs, split.num_splits)
    launch_split = functools.partial(
        _mla_decode_split_kernel[grid],
        q_latent, q_pe, slots, mid_out, mid_lse, block_tables, seq_lens,
        scale, num_heads, split.tokens_per_split, slots.shape[0],
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), slots.stride(0),
        block_tables.stride(0), mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        LATENT_RANK=latent_rank, ROPE_DIM=rope_dim, BLOCK_L=triton.next_power_of_2(latent_rank),
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)), BLOCK_H=block_h,
        BLOCK_N=params["BLOCK_N"], BLOCK_SIZE=block_size,
        TOKENS_MAJOR=params["layout"] == "tokens_major",
        DOT_PRECISION=dot_precision(q_latent.dtype), IS_ONLY_SPLIT=is_only_split,
        USE_TMA=use_tma, WARP_SPECIALIZE=use_tma and bool(params.get("WARP_SPECIALIZE")),
        EVICT_FIRST=bool(params.get("EVICT_FIRST")),
        num_warps=params["num_warps"], num_stages=params["num_stages"],
    )  # fmt: skip
    if is_only_split:
        return out, launch_split, None
    return out, launch_split, functools.partial(_combine_splits, mid_out, mid_lse, out, params)


def _combine_splits(mid_out, mid_lse, out, params) -> None:
    """out [B, N, L] = the splits' partial outputs [B, N, S, L] weighted by their lse [B, N, S]."""
    num_seqs, num_heads, num_splits, latent_rank = mid_out.shape
    block_dv = min(params.get("COMBINE_BLOCK_L", 128), triton.next_power_of_2(latent_rank))
    grid = (num_seqs, num_heads, triton.cdiv(latent_rank, block_dv))
    _mla_combine_kernel[grid](
        mid_out, mid_lse, out, num_splits,
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        LATENT_RANK=latent_rank, BLOCK_L=block_dv,
        BLOCK_S=triton.next_power_of_2(num_splits), SPLITS_PER_STEP=16,
    )  # fmt: skip


@triton.jit
def _mla_scores(
    kv_c, k_pe, q_latent, q_pe, qk_scale, in_bounds,
    TOKENS_MAJOR: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Scaled log2 scores; masked tokens -inf. [BLOCK_N, BLOCK_H] tokens-major (queries are
    given transposed: [BLOCK_L, BLOCK_H], [BLOCK_R, BLOCK_H]), else [BLOCK_H, BLOCK_N]."""
    if TOKENS_MAJOR:
        scores = tl.dot(kv_c, q_latent, input_precision=DOT_PRECISION)
        scores = tl.dot(k_pe, q_pe, scores, input_precision=DOT_PRECISION)
        scores = tl.where(in_bounds[:, None], scores * qk_scale, float("-inf"))
    else:
        scores = tl.dot(q_latent, tl.trans(kv_c), input_precision=DOT_PRECISION)
        scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=DOT_PRECISION)
        scores = tl.where(in_bounds[None, :], scores * qk_scale, float("-inf"))
    return scores


@triton.jit
def _tile_slots(table_ptr, offs_n, split_end, BLOCK_SIZE: tl.constexpr):
    """[BLOCK_N] int64 cache slots of context positions offs_n (slot 0 past split_end)."""
    block_ids = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=offs_n < split_end, other=0)
    return block_ids.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE


@triton.jit
def _mla_update(
    acc, m_i, l_i, kv_c, k_pe, q_latent, q_pe, qk_scale, in_bounds,
    TOKENS_MAJOR: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One cache tile into the online softmax: (acc, m_i, l_i) updated."""
    scores = _mla_scores(kv_c, k_pe, q_latent, q_pe, qk_scale, in_bounds, TOKENS_MAJOR,
                         DOT_PRECISION)  # fmt: skip
    if TOKENS_MAJOR:  # scores [BLOCK_N, BLOCK_H]
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        p = tl.math.exp2(scores - m_new[None, :])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = tl.dot(
            tl.trans(kv_c), p.to(kv_c.dtype), acc * alpha[None, :], input_precision=DOT_PRECISION
        )  # [BLOCK_L, BLOCK_H]
    else:  # scores [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.math.exp2(scores - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(
            p.to(kv_c.dtype), kv_c, acc * alpha[:, None], input_precision=DOT_PRECISION
        )  # [BLOCK_H, BLOCK_L]
    return acc, m_new, l_i


@triton.jit
def _mla_pointer_tile(
    cache_ptr, rows, offs_n, split_end, offs_l, offs_r, stride_slot,
    LATENT_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, EVICT_FIRST: tl.constexpr,
):  # fmt: skip
    """(kv_c [BLOCK_N, BLOCK_L], k_pe [BLOCK_N, BLOCK_R], in_bounds [BLOCK_N]) through masked
    pointer loads of the cache rows `rows`; positions past split_end read as zeros."""
    in_bounds = offs_n < split_end
    row_ptrs = cache_ptr + rows[:, None] * stride_slot  # [BLOCK_N, 1]
    l_mask = in_bounds[:, None] & (offs_l[None, :] < LATENT_RANK)
    r_mask = in_bounds[:, None] & (offs_r[None, :] < ROPE_DIM)
    if EVICT_FIRST:
        kv_c = tl.load(row_ptrs + offs_l[None, :], mask=l_mask, other=0.0,
                       eviction_policy="evict_first")  # fmt: skip
        k_pe = tl.load(row_ptrs + LATENT_RANK + offs_r[None, :], mask=r_mask, other=0.0,
                       eviction_policy="evict_first")  # fmt: skip
    else:
        kv_c = tl.load(row_ptrs + offs_l[None, :], mask=l_mask, other=0.0)
        k_pe = tl.load(row_ptrs + LATENT_RANK + offs_r[None, :], mask=r_mask, other=0.0)
    return kv_c, k_pe, in_bounds


@triton.jit
def _tile_first_slot(table_ptr, start_n, end, BLOCK_SIZE: tl.constexpr):
    """Cache slot of context position start_n (slot 0 at or past end): a tile's first row."""
    block_id = tl.load(table_ptr + start_n // BLOCK_SIZE, mask=start_n < end, other=0)
    return block_id * BLOCK_SIZE + start_n % BLOCK_SIZE


@triton.jit
def _mla_decode_split_kernel(
    q_latent_ptr, q_pe_ptr, cache_ptr, mid_out_ptr, mid_lse_ptr, block_tables_ptr, seq_lens_ptr,
    scale, num_heads, tokens_per_split, num_slots,
    stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_slot, stride_block_table,
    stride_mid_b, stride_mid_h, stride_mid_s,
    LATENT_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TOKENS_MAJOR: tl.constexpr, DOT_PRECISION: tl.constexpr,
    IS_ONLY_SPLIT: tl.constexpr, USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
):  # fmt: skip
    """One (head group, sequence, split): partial softmax . c_kv over the split's tokens.

    Each [BLOCK_N, L + R] tile of cached rows is loaded once and feeds both dots: the scores
    (q_latent . c_kv + q_pe . k_pe) and the output (p @ c_kv, c_kv being the value too).
    TOKENS_MAJOR computes the transposed problem (scores^T = c_kv @ q^T, out^T = c_kv^T @ p^T):
    the token and latent dims are then the dots' M (BLOCK_N and L: wgmma-sized on Hopper even with
    16 heads), the queries stay in shared memory and the accumulator is [L, BLOCK_H].
    USE_TMA: the split's full tiles come through TMA descriptors (one table load per tile, no
    per-row addresses), its last partial tile through masked pointer loads."""
    head_start = tl.program_id(0) * BLOCK_H  # head groups vary fastest: they share rows in L2
    seq = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)
    heads = head_start + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    head_mask = heads < num_heads
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    qk_scale = scale * 1.4426950408889634  # log2(e): exp2 instead of exp
    ql_base = q_latent_ptr + seq * stride_qlb
    qp_base = q_pe_ptr + seq * stride_qpb
    if TOKENS_MAJOR:  # queries transposed: [BLOCK_L, BLOCK_H], [BLOCK_R, BLOCK_H]
        ql_mask = (offs_l[:, None] < LATENT_RANK) & head_mask[None, :]
        q_latent = tl.load(ql_base + heads[None, :] * stride_qlh + offs_l[:, None], mask=ql_mask,
                           other=0.0)  # fmt: skip
        qp_mask = (offs_r[:, None] < ROPE_DIM) & head_mask[None, :]
        q_pe = tl.load(qp_base + heads[None, :] * stride_qph + offs_r[:, None], mask=qp_mask,
                       other=0.0)  # fmt: skip
        acc = tl.zeros([BLOCK_L, BLOCK_H], tl.float32)
    else:  # [BLOCK_H, BLOCK_L], [BLOCK_H, BLOCK_R]
        ql_mask = head_mask[:, None] & (offs_l[None, :] < LATENT_RANK)
        q_latent = tl.load(ql_base + heads[:, None] * stride_qlh + offs_l[None, :], mask=ql_mask,
                           other=0.0)  # fmt: skip
        qp_mask = head_mask[:, None] & (offs_r[None, :] < ROPE_DIM)
        q_pe = tl.load(qp_base + heads[:, None] * stride_qph + offs_r[None, :], mask=qp_mask,
                       other=0.0)  # fmt: skip
        acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    table_ptr = block_tables_ptr + seq * stride_block_table
    offs_tile = tl.arange(0, BLOCK_N)
    if USE_TMA:
        kv_desc = tl.make_tensor_descriptor(cache_ptr, shape=[num_slots, LATENT_RANK],
                                            strides=[stride_slot, 1],
                                            block_shape=[BLOCK_N, BLOCK_L])  # fmt: skip
        pe_desc = tl.make_tensor_descriptor(cache_ptr + LATENT_RANK, shape=[num_slots, ROPE_DIM],
                                            strides=[stride_slot, 1],
                                            block_shape=[BLOCK_N, BLOCK_R])  # fmt: skip
        full_end = split_start + tl.maximum(split_end - split_start, 0) // BLOCK_N * BLOCK_N
        all_in = offs_tile < BLOCK_N  # full tiles: every row is context
        # As for pointer loads: the next tile's first slot is loaded one iteration ahead.
        first_slot = _tile_first_slot(table_ptr, split_start, full_end, BLOCK_SIZE)
        if WARP_SPECIALIZE:
            for start_n in tl.range(split_start, full_end, BLOCK_N, warp_specialize=True):
                kv_c, k_pe = kv_desc.load([first_slot, 0]), pe_desc.load([first_slot, 0])
                first_slot = _tile_first_slot(table_ptr, start_n + BLOCK_N, full_end, BLOCK_SIZE)
                acc, m_i, l_i = _mla_update(acc, m_i, l_i, kv_c, k_pe, q_latent, q_pe, qk_scale,
                                            all_in, TOKENS_MAJOR, DOT_PRECISION)  # fmt: skip
        else:
            for start_n in range(split_start, full_end, BLOCK_N):
                kv_c, k_pe = kv_desc.load([first_slot, 0]), pe_desc.load([first_slot, 0])
                first_slot = _tile_first_slot(table_ptr, start_n + BLOCK_N, full_end, BLOCK_SIZE)
                acc, m_i, l_i = _mla_update(acc, m_i, l_i, kv_c, k_pe, q_latent, q_pe, qk_scale,
                                            all_in, TOKENS_MAJOR, DOT_PRECISION)  # fmt: skip
        if full_end < split_end:  # the sequence's last, partial tile
            offs_n = full_end + offs_tile
            rows = _tile_slots(table_ptr, offs_n, split_end, BLOCK_SIZE)
            kv_c, k_pe, in_bounds = _mla_pointer_tile(cache_ptr, rows, offs_n, split_end, offs_l,
                                                      offs_r, stride_slot, LATENT_RANK, ROPE_DIM,
                                                      EVICT_FIRST)  # fmt: skip
            acc, m_i, l_i = _mla_update(acc, m_i, l_i, kv_c, k_pe, q_latent, q_pe, qk_scale,
                                        in_bounds, TOKENS_MAJOR, DOT_PRECISION)  # fmt: skip
    else:
        # The next tile's slots are loaded one iteration ahead (carried): the cache loads then do
        # not wait on a table load of their own iteration, and Triton's pipeliner can issue them
        # num_stages - 1 tiles ahead instead of num_stages - 2.
        rows = _tile_slots(table_ptr, split_start + offs_tile, split_end, BLOCK_SIZE)
        for start_n in range(split_start, split_end, BLOCK_N):
            offs_n = start_n + offs_tile  # [BLOCK_N] context positions
            kv_c, k_pe, in_bounds = _mla_pointer_tile(cache_ptr, rows, offs_n, split_end, offs_l,
                                                      offs_r, stride_slot, LATENT_RANK, ROPE_DIM,
                                                      EVICT_FIRST)  # fmt: skip
            rows = _tile_slots(table_ptr, offs_n + BLOCK_N, split_end, BLOCK_SIZE)
            acc, m_i, l_i = _mla_update(acc, m_i, l_i, kv_c, k_pe, q_latent, q_pe, qk_scale,
                                        in_bounds, TOKENS_MAJOR, DOT_PRECISION)  # fmt: skip
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty split stores zeros, weighted 0 when combined
    mid_base = mid_out_ptr + seq * stride_mid_b + split * stride_mid_s
    if TOKENS_MAJOR:
        mid_ptrs = mid_base + heads[None, :] * stride_mid_h + offs_l[:, None]
        mid_mask = (offs_l[:, None] < LATENT_RANK) & head_mask[None, :]
        part = acc / l_safe[None, :]
    else:
        mid_ptrs = mid_base + heads[:, None] * stride_mid_h + offs_l[None, :]
        mid_mask = head_mask[:, None] & (offs_l[None, :] < LATENT_RANK)
        part = acc / l_safe[:, None]
    tl.store(mid_ptrs, part.to(mid_out_ptr.dtype.element_ty), mask=mid_mask)
    if not IS_ONLY_SPLIT:  # else mid_out is the output and no combine follows
        lse = tl.where(l_i > 0, m_i + tl.math.log2(l_safe), float("-inf"))  # [BLOCK_H] log2
        num_splits = tl.num_programs(2)
        tl.store(mid_lse_ptr + (seq * num_heads + heads) * num_splits + split, lse,
                 mask=head_mask)  # fmt: skip


@triton.jit
def _mla_combine_kernel(
    mid_out_ptr, mid_lse_ptr, out_ptr, num_splits,
    stride_mid_b, stride_mid_h, stride_mid_s, stride_lse_b, stride_lse_h, stride_ob, stride_oh,
    LATENT_RANK: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr,
    SPLITS_PER_STEP: tl.constexpr,
):  # fmt: skip
    """One (sequence, head, latent chunk): merge the splits by their log-sum-exps, reading
    SPLITS_PER_STEP partial rows per step so that many loads are in flight."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_l = tl.program_id(2) * BLOCK_L + tl.arange(0, BLOCK_L)
    l_mask = offs_l < LATENT_RANK
    lse_base = mid_lse_ptr + seq * stride_lse_b + head * stride_lse_h
    offs_all = tl.arange(0, BLOCK_S)
    lses = tl.load(lse_base + offs_all, mask=offs_all < num_splits, other=float("-inf"))
    lse_max = tl.max(lses, 0)
    total = tl.sum(tl.math.exp2(lses - lse_max), 0)
    acc = tl.zeros([BLOCK_L], tl.float32)
    mid_base = mid_out_ptr + seq * stride_mid_b + head * stride_mid_h
    for first in range(0, num_splits, SPLITS_PER_STEP):
        offs_s = first + tl.arange(0, SPLITS_PER_STEP)  # [SPLITS_PER_STEP]
        s_mask = offs_s < num_splits
        weights = tl.math.exp2(tl.load(lse_base + offs_s, mask=s_mask, other=float("-inf"))
                               - lse_max)  # fmt: skip
        part_ptrs = mid_base + offs_s[:, None] * stride_mid_s + offs_l[None, :]
        parts = tl.load(part_ptrs, mask=s_mask[:, None] & l_mask[None, :], other=0.0)
        acc += tl.sum(weights[:, None] * parts, 0)  # [BLOCK_L]
    out = acc / total
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_l, out, mask=l_mask)


def mla_causal_attention(
    query: torch.Tensor,  # [q, N, Dqk]: the last q tokens of the context
    key: torch.Tensor,  # [s, N, Dqk]
    value: torch.Tensor,  # [s, N, Dv]
    scale: float,
) -> torch.Tensor:  # [q, N, Dv]
    """Expanded-form prefill of one sequence (Dqk = 128 nope + 64 rope runs as two dots)."""
    device = query.device
    cu_seqlens_q = torch.tensor([0, query.shape[0]], dtype=torch.int32, device=device)
    cu_seqlens_k = torch.tensor([0, key.shape[0]], dtype=torch.int32, device=device)
    return prefill_attention(query, key.to(query.dtype), value.to(query.dtype), cu_seqlens_q,
                             cu_seqlens_k, query.shape[0], scale)  # fmt: skip


@triton.jit
def _mla_write_cache_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_mapping_ptr,
    stride_kv_c, stride_k_pe, stride_slot,
    LATENT_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    kv_c = tl.load(kv_c_ptr + token * stride_kv_c + offs_l, mask=offs_l < LATENT_RANK)
    k_pe = tl.load(k_pe_ptr + token * stride_k_pe + offs_r, mask=offs_r < ROPE_DIM)
    row = cache_ptr + slot * stride_slot
    tl.store(row + offs_l, kv_c.to(cache_ptr.dtype.element_ty), mask=offs_l < LATENT_RANK)
    tl.store(row + LATENT_RANK + offs_r, k_pe.to(cache_ptr.dtype.element_ty),
             mask=offs_r < ROPE_DIM)  # fmt: skip


def mla_write_cache(
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]: updated in place
    slot_mapping: torch.Tensor,  # [T] int64; < 0 skips the token
    kv_c: torch.Tensor,  # [T, L]
    k_pe: torch.Tensor,  # [T, R]
) -> None:
    latent_rank, rope_dim = kv_c.shape[-1], k_pe.shape[-1]
    if kv_cache.shape[-1] != latent_rank + rope_dim or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be contiguous [blocks, bs, "
                         f"{latent_rank + rope_dim}]")  # fmt: skip
    if kv_c.stride(-1) != 1 or k_pe.stride(-1) != 1 or slot_mapping.shape[0] != kv_c.shape[0]:
        raise ValueError("kv_c/k_pe must be contiguous in the last dim, one slot per token")
    if kv_c.shape[0] == 0:
        return
    _mla_write_cache_kernel[(kv_c.shape[0],)](
        kv_c, k_pe, kv_cache, slot_mapping, kv_c.stride(0), k_pe.stride(0), kv_cache.shape[-1],
        LATENT_RANK=latent_rank, ROPE_DIM=rope_dim,
        BLOCK_L=triton.next_power_of_2(latent_rank), BLOCK_R=triton.next_power_of_2(rope_dim),
    )  # fmt: skip
