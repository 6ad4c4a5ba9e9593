"""MLA decode in the absorbed form, on the Triton kernels: `mla_decode_attention` picks the kernel
shared with GQA (paged_attention.split_k_decode) or the dedicated MLA kernel, whose launches
`mla_decode_launches` builds (split, then combine). The math is in mla_attention's docstring.
"""

from __future__ import annotations

import functools

import torch

from rayinfer.kernels.attention import paged_attention
from rayinfer.kernels.attention.paged_attention import choose_split, dot_precision, split_k_decode
from rayinfer.kernels.gluon_compat import GLUON_BUILD_ERRORS, gluon_enabled, gluon_failed
from rayinfer.kernels.mla import mla_decode_hopper
from rayinfer.kernels.mla.mla_decode_kernels import _mla_combine_kernel, _mla_decode_split_kernel
from rayinfer.kernels.triton_compat import tma_rows_fit, triton

# The Gluon split kernel's forms (mla_decode_hopper): heads-major over 64-row query tiles (many
# heads) and tokens-major (few heads); where it cannot run, the Triton kernel runs heads-major.
GLUON_LAYOUTS = ("gluon_ws", "gluon_ws_tokens")
GLUON_SPLIT_KEYS = ("whole_waves", "programs_per_sm")  # a Gluon entry's split policy only
GLUON_KERNEL = "mla_decode"  # its name for gluon_compat's failure record
# float32 on a GPU (parity checks, not a speed path): tiles whose pipeline fits shared memory at
# four bytes an element, whatever the entry's bf16 tiles are.
FLOAT32_TILES = dict(BLOCK_H=16, BLOCK_N=32, num_warps=4, num_stages=3, USE_TMA=False,
                     WARP_SPECIALIZE=False)  # fmt: skip


def mla_decode_attention(
    q_latent: torch.Tensor,  # [B, N, L]
    q_pe: torch.Tensor,  # [B, N, R]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, L + R]: new tokens already written
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    seq_lens: torch.Tensor | list[int],  # [B] context length, the new token included
    scale: float,
    params: dict | None = None,  # tile config override (sweeps, tests); else configs/*.json
    backend: str = "auto",  # "triton" pins the Triton kernel (KernelBackends.mla_decode)
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
    if params.get("layout", "shared") != "shared":  # tokens_major, heads_major or gluon_ws*
        return _mla_split_k_decode(q_latent, q_pe, slots, block_tables, seq_lens, scale, params,
                                   kv_cache.shape[1], backend)  # fmt: skip
    layout = dict(
        heads_per_program=None, queries_per_kv=q_latent.shape[1], block_size=kv_cache.shape[1],
        head_dim_v=latent_rank, has_pe=True, stride_kv_head=0, value_offset=0, value_is_key=True,
    )  # fmt: skip
    return split_k_decode(q_latent, q_pe, slots, block_tables, seq_lens, scale, layout,
                          "mla_attention")  # fmt: skip


def _mla_split_k_decode(q_latent, q_pe, slots, block_tables, seq_lens, scale, params, block_size,
                        backend="auto"):  # fmt: skip
    """Split + combine launches of the dedicated kernel -> [B, N, L]. slots [num_slots, L + R].
    A Gluon split kernel that does not build with this Triton is reported once, and the Triton
    kernel answers this call and the later ones."""
    out, launch_split, launch_combine = mla_decode_launches(
        q_latent, q_pe, slots, block_tables, seq_lens, scale, params, block_size, backend
    )
    try:
        launch_split()
    except GLUON_BUILD_ERRORS as error:
        if getattr(launch_split, "func", None) is not mla_decode_hopper.mla_decode_ws_launch:
            raise  # the Triton kernel's own failure
        gluon_failed(GLUON_KERNEL, error)
        return _mla_split_k_decode(q_latent, q_pe, slots, block_tables, seq_lens, scale, params,
                                   block_size, backend)  # fmt: skip
    if launch_combine is not None:
        launch_combine()
    return out


def mla_tma_fits(slots: torch.Tensor, latent_rank: int, rope_dim: int, block_size: int,
                 params: dict) -> bool:  # fmt: skip
    """Whether USE_TMA can run: tiles inside one cache block, power-of-two latent and rope dims
    (the descriptors' boxes are the whole dims), 16-byte aligned rows and rope columns, a cache
    of slots that int32 coordinates reach (tma_rows_fit), sm_90+."""
    size = slots.element_size()
    dims_fit = latent_rank == triton.next_power_of_2(latent_rank) and rope_dim >= 16
    dims_fit = dims_fit and rope_dim == triton.next_power_of_2(rope_dim)
    offsets = (slots.data_ptr(), slots.stride(0) * size, latent_rank * size)
    if not dims_fit or block_size % params["BLOCK_N"] or any(o % 16 for o in offsets):
        return False
    if not tma_rows_fit(slots.shape[0], slots.stride(0) * size):
        return False
    return slots.device.type != "cuda" or torch.cuda.get_device_capability(slots.device)[0] >= 9


def _tma_scratch(device: torch.device):
    """Global scratch for the descriptors the kernel builds on device."""
    return lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device)


def mla_decode_launches(q_latent, q_pe, slots, block_tables, seq_lens, scale, params, block_size,
                        backend="auto"):  # fmt: skip
    """(out [B, N, L], split launch, combine launch or None): the dedicated kernel's launches on
    buffers allocated once, so that the sweep can time the split kernel and the combine apart.

    Launch options of `params` (absent: off): "USE_TMA" loads the full tiles through TMA
    descriptors over the flat cache (a tile never crosses a cache block; the last, partial tile of
    a split goes through masked pointer loads), "TABLE_IN_LOOP" loads each tile's block-table
    entries in its own iteration (pipelined asynchronously) instead of one tile ahead,
    "WARP_SPECIALIZE" runs that TMA loop with
    `tl.range(..., warp_specialize=True)`, "EVICT_FIRST" marks the pointer loads of the cache
    evict-first (the stream is read once; the partial outputs stay in L2 for the combine).

    A Gluon entry (layout in GLUON_LAYOUTS) also has "whole_waves" and "programs_per_sm" (its
    split policy: one program per SM, see choose_split) and "fallback", the Triton tiles that
    run where the Gluon kernel cannot (`triton_fallback`), and wherever `backend` is "triton"
    (to compare, or to step around the Gluon kernel)."""
    num_seqs, num_heads, latent_rank = q_latent.shape
    rope_dim = q_pe.shape[-1]
    if params["layout"] in GLUON_LAYOUTS and _gluon_allowed(backend):
        q_latent = mla_decode_hopper.with_uniform_rows(q_latent)  # heads one row apart
        q_pe = mla_decode_hopper.with_uniform_rows(q_pe)
        params = per_sm(params, q_latent.device)
        block_h, split = _programs(params, num_seqs, num_heads, block_tables.shape[1] * block_size)
        if mla_decode_hopper.supports(q_latent, q_pe, slots, block_size, split.tokens_per_split):
            out, mid_out, mid_lse = split_buffers(q_latent, split.num_splits)
            launch_split = functools.partial(
                mla_decode_hopper.mla_decode_ws_launch, q_latent, q_pe, slots, block_tables,
                seq_lens, scale, mid_out, mid_lse, split.tokens_per_split, split.num_splits,
                split.num_splits == 1, tokens_major=params["layout"] == "gluon_ws_tokens",
                block_h=block_h,
            )  # fmt: skip
            return out, launch_split, _combine(mid_out, mid_lse, out, params, seq_lens, split)
    if params["layout"] in GLUON_LAYOUTS:  # not served (dtype, GPU, shapes) or pinned away
        params = triton_fallback(params)
    if q_latent.dtype == torch.float32 and q_latent.is_cuda:
        params = {**params, **FLOAT32_TILES}
    block_h, split = _programs(params, num_seqs, num_heads, block_tables.shape[1] * block_size)
    num_groups = triton.cdiv(num_heads, block_h)
    out, mid_out, mid_lse = split_buffers(q_latent, split.num_splits)
    is_only_split = split.num_splits == 1  # the split kernel writes `out`: one launch
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
        TABLE_IN_LOOP=bool(params.get("TABLE_IN_LOOP")),
        num_warps=params["num_warps"], num_stages=params["num_stages"],
    )  # fmt: skip
    return out, launch_split, _combine(mid_out, mid_lse, out, params, seq_lens, split)


def _gluon_allowed(backend: str) -> bool:
    """Not pinned to Triton (`backend`), and the Gluon kernel has not failed to build."""
    return backend != "triton" and gluon_enabled(GLUON_KERNEL)


def triton_fallback(params: dict) -> dict:
    """A Gluon entry's Triton tiles: its "fallback" keys over the entry, heads-major, without
    the split policy of a kernel that runs one program per SM ("whole_waves",
    "programs_per_sm")."""
    kept = {k: v for k, v in params.items() if k not in (*GLUON_SPLIT_KEYS, "fallback")}
    return {**kept, "layout": "heads_major", **params.get("fallback", {})}


def per_sm(params: dict, device: torch.device) -> dict:
    """Turns "programs_per_sm" (an entry for GPUs of any SM count) into target_programs here."""
    per_sm = params.get("programs_per_sm")
    if not per_sm or device.type != "cuda":
        return params
    index = torch.cuda.current_device() if device.index is None else device.index
    return {**params, "target_programs": per_sm * _sm_count(index)}


@functools.cache
def _sm_count(index: int) -> int:
    """SMs of a CUDA device (asked once: this runs on every decode call)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(params: dict, num_seqs: int, num_heads: int, max_context: int):
    """(heads per program, the context's split) of a launch with these tiles."""
    block_h = max(16, triton.next_power_of_2(min(params["BLOCK_H"], num_heads)))
    return block_h, choose_split(num_seqs, triton.cdiv(num_heads, block_h), max_context, params)


def split_buffers(q_latent: torch.Tensor, num_splits: int):
    """(out [B, N, L], partial outputs [B, N, S, L] float32, their lse [B, N, S]); one split
    writes `out` itself, so its partial outputs are `out` [B, N, 1, L]."""
    num_seqs, num_heads, latent_rank = q_latent.shape
    out = q_latent.new_empty(num_seqs, num_heads, latent_rank)
    mid_shape = (num_seqs, num_heads, num_splits, latent_rank)
    mid_out = out[:, :, None] if num_splits == 1 else out.new_empty(mid_shape, dtype=torch.float32)
    mid_lse = out.new_empty(num_seqs, num_heads, num_splits, dtype=torch.float32)
    return out, mid_out, mid_lse


def _combine(mid_out, mid_lse, out, params, seq_lens, split):
    """The combine's launch, None where one split wrote the output."""
    if split.num_splits == 1:
        return None
    return functools.partial(_combine_splits, mid_out, mid_lse, out, params, seq_lens,
                             split.tokens_per_split)  # fmt: skip


def combine_columns(rows: int, latent_rank: int, params: dict) -> int:
    """Latent columns per combine program for `rows` (sequence, head) rows."""
    block = min(params.get("COMBINE_BLOCK_L", 1 << 30), triton.next_power_of_2(latent_rank))
    wanted = params.get("COMBINE_MIN_PROGRAMS", 0)
    while block > 64 and rows * triton.cdiv(latent_rank, block) < wanted:
        block //= 2
    return block


def _combine_splits(mid_out, mid_lse, out, params, seq_lens, tokens_per_split) -> None:
    """out [B, N, L] = the splits' partial outputs [B, N, S, L] weighted by their lse [B, N, S].

    One program per (sequence, head) over the whole latent row, reading at most as many splits
    per step as there are: with 128-wide chunks and 16 splits a step, a batch-256 decode graph
    (3 splits) launched 16k programs that mostly loaded masked lanes, and the combine took twice
    the split kernel's time (1.3 ms per step on an H200, DeepSeek-V2-Lite shapes). Only the
    splits that hold tokens of the sequence are read (seq_lens [B] on the device).
    "COMBINE_BLOCK_L" caps the latent columns a program; "COMBINE_MIN_PROGRAMS" narrows them
    (down to 64) until that many programs run: one long context's 16 heads would otherwise be
    16 programs reducing 128 splits each (1 x 128k on an H200: 0.052 -> 0.047 ms a layer)."""
    num_seqs, num_heads, num_splits, latent_rank = mid_out.shape
    block_dv = combine_columns(num_seqs * num_heads, latent_rank, params)
    grid = (num_seqs, num_heads, triton.cdiv(latent_rank, block_dv))
    _mla_combine_kernel[grid](
        mid_out, mid_lse, out, seq_lens, tokens_per_split,
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        LATENT_RANK=latent_rank, BLOCK_L=block_dv,
        BLOCK_S=triton.next_power_of_2(num_splits),
        SPLITS_PER_STEP=min(16, triton.next_power_of_2(num_splits)),
        num_warps=4 if block_dv >= 256 else 2,
    )  # fmt: skip
