"""Causal flash attention over packed variable-length sequences (prefill and chunked prefill).

Sequence b owns queries `cu_seqlens_q[b]:cu_seqlens_q[b+1]`: the last q tokens of its s-token
context (causal mask aligned bottom-right, as flash-attn's varlen: query j sits at position
s - q + j). Its keys/values come from one of two places:
- contiguous: `key`/`value` rows `cu_seqlens_k[b]:cu_seqlens_k[b+1]` (plain prefill, MLA's
  expanded form);
- paged: the layer cache `[num_blocks, block_size, 2, Hkv, D]` through `block_tables[b]`, with
  `seq_lens[b]` tokens (chunked prefill over a cached prefix: the new tokens are already written).
GQA: query head h reads kv head h // (Hq / Hkv). The query/key head dim may differ from the value
head dim (MLA: 192 = 128 nope + 64 rope, value 128); a non-power-of-two qk dim is split into a
power-of-two part and a remainder so no FLOPs go to padding.

Launch options beyond the tile sizes (keys of configs/prefill_attention.json, off when absent):
- USE_TMA: contiguous Q/K/V/O through per-(sequence, head) TMA descriptors (Hopper+, 16-byte
  aligned rows); their bounds zero-fill the rows past a sequence, so no row masks or pointer math;
- PIPELINE_QK: software pipelining by one key tile: the P.V product of tile j-1 is issued
  (asynchronously) before the softmax of tile j, so the tensor cores have work while it runs;
- HEADS_FASTEST: heads vary fastest in the grid: a wave holds the heaviest query tiles of every
  head (longest first over the whole grid), and a GQA group's heads run side by side on one K/V;
- WARP_SPECIALIZE: `tl.range(..., warp_specialize=True)` on the unmasked loop when it is not
  PIPELINE_QK's, with USE_TMA only (the paged and unaligned pointer paths run without it); an
  sm_90a compile (triton 3.9) gets no warp partitions from it on Hopper: same code as without;
- "paged" (a dict of the above and tiles): overrides for paged_prefill_attention, whose K/V
  always load through pointers (an sm_90a compile of 128x64/8 pointer tiles spills registers);
- maxnreg: a cap on registers per thread (Triton's launch option), so that two programs of a
  big tile fit on an SM; spills are the price (an sm_90a compile shows them);
- "backend": "gluon_ws": contiguous causal K/V go to the warp-specialized Gluon kernel of
  prefill_attention_hopper where it applies (an H100/H200, bf16, value head dim 128, query/key
  128 or MLA's 192); the tiles and options above serve everything else.
  a call's backend="triton" (KernelBackends.prefill_attention) pins the Triton kernel whatever
  the config says;
- CONDITIONAL_RESCALE: the running max moves only when some row of the tile grew by more than
  RESCALE_THRESHOLD (8, log2 units): otherwise the tile's probabilities are taken against the old
  max (each <= 2**8, exact after the final division by the sum, which carries the same factor)
  and the [BLOCK_M, BLOCK_DV] rescale of the accumulator is skipped by a scalar branch (FA3's
  trick; past the first few key tiles the max rarely moves that much).
"""

from __future__ import annotations

from itertools import accumulate

import torch

from rayinfer.kernels.attention import prefill_attention_hopper
from rayinfer.kernels.attention.paged_attention import (
    causal_attention,
    dot_precision,
    launch_params,
    paged_decode_attention,
)
from rayinfer.kernels.attention.prefill_attention_kernel import _prefill_attention_kernel
from rayinfer.kernels.attention.prefill_attention_tiles import RESCALE_THRESHOLD  # noqa: F401 (re-export)
from rayinfer.kernels.gluon_compat import GLUON_BUILD_ERRORS, gluon_enabled, gluon_failed
from rayinfer.kernels.host_lists import device_ints
from rayinfer.kernels.triton_compat import tma_rows_fit, triton

GLUON_KERNEL = "prefill_attention"  # its name for gluon_compat's failure record
LAUNCH_OPTIONS = dict(USE_TMA=False, PIPELINE_QK=False, HEADS_FASTEST=False, WARP_SPECIALIZE=False,
                      CONDITIONAL_RESCALE=False)  # fmt: skip


def split_head_dim(head_dim: int) -> tuple[int, int]:
    """qk head dim -> (power-of-two part, remainder): 128 -> (128, 0), 192 -> (128, 64)."""
    main = 1 << (head_dim.bit_length() - 1)
    return (head_dim, 0) if main == head_dim else (main, head_dim - main)


def _check(query, key, value, cu_seqlens_q, kv_lens):
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError(f"query {query.shape}, key {key.shape}, value {value.shape} must be 3-D")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads {query.shape[1]} not a multiple of kv heads {key.shape[1]}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query head dim {query.shape[-1]} != key head dim {key.shape[-1]}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim; call .contiguous()")
    if cu_seqlens_q.dtype != torch.int32 or kv_lens.dtype != torch.int32:
        raise ValueError("cu_seqlens_q / seq lens must be int32 (AttentionMetadata's dtype)")


def _tma_fits(tensors: tuple[torch.Tensor, ...], column_offsets: tuple[int, ...]) -> bool:
    """TMA descriptors need 16-byte aligned bases, row and head strides (and split columns), and
    rows their int32 coordinates reach (tma_rows_fit); Hopper or newer on CUDA (the interpreter
    accepts them on CPU)."""
    device = tensors[0].device
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        return False
    for t in tensors:
        size = t.element_size()
        if not tma_rows_fit(t.shape[0], t.stride(0) * size):
            return False
        byte_offsets = (t.data_ptr(), t.stride(0) * size, t.stride(1) * size)
        if any(offset % 16 for offset in byte_offsets + tuple(c * size for c in column_offsets)):
            return False
    return True


def _tma_scratch_allocator(device: torch.device):
    """Global scratch for the descriptors a kernel builds on device (128 bytes per program)."""
    return lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device)


def _launch_options(params: dict, tensors, column_offsets, is_paged: bool) -> dict:
    """The config's launch options (LAUNCH_OPTIONS's defaults where absent); TMA only where it
    can run: contiguous K/V with aligned rows, and warp specialization only with TMA."""
    options = {name: bool(params.get(name, default)) for name, default in LAUNCH_OPTIONS.items()}
    options["USE_TMA"] = options["USE_TMA"] and not is_paged and _tma_fits(tensors, column_offsets)
    # Warp specialization was only ever compiled and timed over TMA loads: off on pointer paths.
    options["WARP_SPECIALIZE"] = options["WARP_SPECIALIZE"] and options["USE_TMA"]
    if options["USE_TMA"] and tensors[0].device.type == "cuda":
        triton.set_allocator(_tma_scratch_allocator(tensors[0].device))  # per thread: set here
    return options


def _backend(params: dict, backend: str) -> str:
    """The config's "backend" ("triton" when absent), unless `backend` "triton" pins the Triton
    kernel (to compare, or to step around the Gluon one)."""
    if backend == "triton":
        return "triton"
    return params.get("backend", "triton")


def _register_cap(params: dict, device: torch.device) -> dict:
    """The config's "maxnreg" (registers per thread, so that more programs fit per SM) as a launch
    option: CUDA only, absent or None for the compiler's own choice."""
    cap = params.get("maxnreg")
    return {"maxnreg": int(cap)} if cap and device.type == "cuda" else {}


def _grid(num_tiles: int, num_seqs: int, num_heads: int, heads_fastest: bool) -> tuple:
    return (num_heads, num_tiles, num_seqs) if heads_fastest else (num_tiles, num_seqs, num_heads)


def join_rope(nope: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """[n, H, Dn] and [n, H or 1, R] -> [n, H, Dn + R]: two copies into one buffer (torch.cat
    with a head-broadcast rope took 178 us per 16k-token MLA layer on an H200)."""
    joined = nope.new_empty(*nope.shape[:2], nope.shape[-1] + rope.shape[-1])
    joined[..., : nope.shape[-1]] = nope
    joined[..., nope.shape[-1] :] = rope
    return joined


def _launch(query, key, value, out, block_tables, cu_seqlens_q, kv_lens, scale, is_paged,
            block_size, max_query_len, is_causal, rope=None, lse=None, backend="auto"):  # fmt: skip
    """rope: None, or (query_rope, key_rope), MLA's rope columns apart from query and key. The
    Gluon kernel reads them where they lie; the Triton kernel gets them joined. lse: None, or
    [T, Hq] float32 that the Triton kernel fills with each row's log-sum-exp (the Gluon kernel
    writes none, so a call that wants it runs the Triton kernel)."""
    qk_dim = query.shape[-1] + (rope[0].shape[-1] if rope else 0)
    # Buckets by qk head dim: MLA's 192/128 tiles need less shared memory than 128/128's.
    params = launch_params("prefill_attention", query.device, qk_dim)
    if is_paged:  # K/V through block tables and pointers: the entry's "paged" tiles, if it has any
        params = {**params, **(params.get("paged") or {})}
    elif (
        lse is None
        and _backend(params, backend) == "gluon_ws"
        and gluon_enabled(GLUON_KERNEL)
        and prefill_attention_hopper.supports(query, key, value, is_causal, *(rope or ()))
    ):
        try:
            return prefill_attention_hopper.prefill_attention_ws(
                query, key, value, cu_seqlens_q, kv_lens, max_query_len, scale, out,
                *(rope or ()),
            )  # fmt: skip
        except GLUON_BUILD_ERRORS as error:  # another Triton's Gluon: the Triton kernel below
            gluon_failed(GLUON_KERNEL, error)
    if rope:
        query, key = join_rope(query, rope[0]), join_rope(key, rope[1])
    num_seqs, num_heads = cu_seqlens_q.shape[0] - 1, query.shape[1]
    dim0, dim1 = split_head_dim(query.shape[-1])
    block_m, block_n = params["BLOCK_M"], params["BLOCK_N"]
    options = _launch_options(params, (query, key, value, out), (dim0,), is_paged)
    num_tiles = triton.cdiv(max(max_query_len, 1), block_m)
    grid = _grid(num_tiles, num_seqs, num_heads, options["HEADS_FASTEST"])
    lse_rows = out if lse is None else lse  # without lse: any tensor, never written
    _prefill_attention_kernel[grid](
        query, key, value, out, lse_rows, block_tables, cu_seqlens_q, kv_lens,
        scale, num_heads // key.shape[1],
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), out.stride(0), out.stride(1),
        lse_rows.stride(0), lse_rows.stride(1), block_tables.stride(0),
        HEAD_DIM0=dim0, HEAD_DIM1=dim1, HEAD_DIM_V=value.shape[-1],
        BLOCK_D0=triton.next_power_of_2(dim0), BLOCK_D1=max(16, triton.next_power_of_2(dim1)),
        BLOCK_DV=triton.next_power_of_2(value.shape[-1]),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        IS_PAGED=is_paged, IS_CAUSAL=is_causal, DOT_PRECISION=dot_precision(query.dtype),
        STORE_LSE=lse is not None, **options, num_warps=params["num_warps"],
        num_stages=params["num_stages"],
        **_register_cap(params, query.device),
    )  # fmt: skip
    return out


def prefill_attention(
    query: torch.Tensor,  # [T, Hq, Dqk]: packed queries of all sequences
    key: torch.Tensor,  # [S, Hkv, Dqk]: packed keys of all sequences' contexts
    value: torch.Tensor,  # [S, Hkv, Dv]
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32: query rows of each sequence
    cu_seqlens_k: torch.Tensor,  # [B + 1] int32: key rows of each sequence (q_len <= kv_len)
    max_query_len: int,
    scale: float,
    is_causal: bool = True,
    query_rope: torch.Tensor | None = None,  # [T, Hq, R]: more query columns, kept apart (MLA)
    key_rope: torch.Tensor | None = None,  # [S, Hkv or 1, R]: their keys (1: shared by heads)
    out: torch.Tensor | None = None,  # [T, Hq, Dv]: written in place when given (float dtype)
    lse: torch.Tensor | None = None,  # [T, Hq] float32: each row's log-sum-exp, written if given
    backend: str = "auto",  # "triton" pins the Triton kernel (KernelBackends.prefill_attention)
) -> torch.Tensor:  # [T, Hq, Dv]
    """Varlen flash attention over contiguous K/V; the queries are each context's last tokens.
    With query_rope and key_rope, scores are query . key + query_rope . key_rope (DeepSeek's
    MLA: 128 nope columns from the kv_b projection, 64 rope columns shared by the heads).
    lse (natural log of the sum of exp(scale x score) over a row's visible keys) lets attention
    over separate parts of one context be merged (layers/mla_context.py). Non-causal calls may
    have more queries than keys; every row must see at least one key."""
    _check(query, key, value, cu_seqlens_q, cu_seqlens_k)
    if lse is not None and (lse.dtype != torch.float32 or lse.shape != query.shape[:2]):
        raise ValueError(f"lse {tuple(lse.shape)} {lse.dtype} must be [T, Hq] float32")
    if (query_rope is None) != (key_rope is None):
        raise ValueError("query_rope and key_rope go together")
    rope = None if query_rope is None else (query_rope, key_rope)
    if out is None:
        out = query.new_empty(query.shape[0], query.shape[1], value.shape[-1])
    elif out.shape != (*query.shape[:2], value.shape[-1]) or out.stride(-1) != 1:
        want = [*query.shape[:2], value.shape[-1]]
        raise ValueError(f"out {tuple(out.shape)} must be [T, Hq, Dv] = {want}, dense in its "
                         "last dim")  # fmt: skip
    no_table = cu_seqlens_q  # unused when not paged; any int32 tensor
    return _launch(query, key, value, out, no_table[None], cu_seqlens_q, cu_seqlens_k, scale,
                   False, 1, max_query_len, is_causal, rope, lse, backend)  # fmt: skip


def paged_prefill_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, Hkv, D]: new tokens already written
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    seq_lens: torch.Tensor,  # [B] int32: context length after this step
    query_start_loc: torch.Tensor,  # [B + 1] int32
    max_query_len: int,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each sequence's new tokens over its whole paged context."""
    if kv_cache.dim() != 5 or kv_cache.shape[2] != 2:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be [blocks, bs, 2, Hkv, D]")
    slots = kv_cache.flatten(0, 1)  # [num_slots, 2, Hkv, D]
    key, value = slots[:, 0], slots[:, 1]  # [num_slots, Hkv, D] views, slot stride 2*Hkv*D
    _check(query, key, value, query_start_loc, seq_lens)
    out = torch.empty_like(query)
    return _launch(query, key, value, out, block_tables, query_start_loc, seq_lens, scale, True,
                   kv_cache.shape[1], max_query_len, True)  # fmt: skip


def reference_lse(query, key, scale: float, is_causal: bool) -> torch.Tensor:
    """One sequence's log-sum-exp [q, Hq] float32: query [q, Hq, D] over key [s, Hkv, D], the
    causal mask aligned bottom-right as the kernels'."""
    group = query.shape[1] // key.shape[1]
    key = key.to(query.dtype).repeat_interleave(group, dim=1)  # [s, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", query.float(), key.float()) * scale  # [Hq, q, s]
    if is_causal:
        query_len, seq_len = query.shape[0], key.shape[0]
        positions = torch.arange(seq_len - query_len, seq_len, device=query.device)  # [q]
        visible = torch.arange(seq_len, device=query.device)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores.logsumexp(-1).transpose(0, 1)  # [q, Hq]


def prefill_attention_reference(query, key, value, cu_seqlens_q, cu_seqlens_k, max_query_len,
                                scale, is_causal=True, lse=None):  # fmt: skip
    """Per-sequence SDPA: same contract as `prefill_attention` (lse [T, Hq] written if given)."""
    out = query.new_empty(query.shape[0], query.shape[1], value.shape[-1])
    q_starts, k_starts = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for seq in range(len(q_starts) - 1):
        rows = slice(q_starts[seq], q_starts[seq + 1])
        keys = slice(k_starts[seq], k_starts[seq + 1])
        if lse is not None:
            lse[rows] = reference_lse(query[rows], key[keys], scale, is_causal)
        if is_causal:
            out[rows] = causal_attention(query[rows], key[keys], value[keys], scale)
        else:
            q, k, v = (t.transpose(0, 1) for t in (query[rows], key[keys], value[keys]))
            sdpa = torch.nn.functional.scaled_dot_product_attention
            gqa = q.shape[0] != k.shape[0]
            out[rows] = sdpa(q, k, v, scale=scale, enable_gqa=gqa).transpose(0, 1)
    return out


def _rows_of(seqs: list[int], query_lens: list[int], starts: list[int], device):
    """The batch rows of these sequences' queries [n] (on the device), their cu_seqlens [k + 1]
    int32 and the longest one's length."""
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs])  # host
    lens = [query_lens[i] for i in seqs]
    cu_seqlens = device_ints([0, *accumulate(lens)], torch.int32, device)
    return device_ints(rows, torch.int64, device), cu_seqlens, max(lens)


def paged_mixed_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 2, Hkv, D]: new tokens already written
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    query_lens: list[int],  # [B] on the host
    scale: float,
    seq_lens_cpu: list[int] | None = None,  # [B] on the host, with new_kv
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # the step's (key, value) [T, Hkv, D]
    backend: str = "auto",  # of the contiguous kernel (KernelBackends.prefill_attention)
) -> torch.Tensor:  # [T, Hq, D]
    """A scheduler batch: its decodes (one query) through the split-K decode kernel, which reads
    each kv head once for its whole query group and splits long contexts over programs; its
    prefill chunks through the varlen kernel. Either kernel alone when the batch is pure.

    With new_kv, the chunks that start their sequence (no cached prefix: a prompt's first chunk,
    the usual prefill) attend to the step's own key/value rows through the contiguous kernel
    instead of reading them back through the block tables: the same values, and on an H200 the
    warp-specialized Gluon kernel (594 TFLOP/s against the paged kernel's 323 at 16k tokens, head
    dim 128). Chunks over a cached prefix take the paged kernel."""
    chunk_seqs = [i for i, n in enumerate(query_lens) if n > 1]
    if not chunk_seqs:
        if query.shape[0] != len(query_lens):  # the decode kernel pairs row i with sequence i
            raise ValueError(f"query_lens {query_lens}: every sequence needs a query token")
        return paged_decode_attention(query, kv_cache, block_tables, seq_lens, scale)
    direct = [i for i in chunk_seqs if new_kv is not None and seq_lens_cpu[i] == query_lens[i]]
    paged = [i for i in chunk_seqs if new_kv is None or seq_lens_cpu[i] != query_lens[i]]
    if len(chunk_seqs) == len(query_lens):  # no decodes: one kernel when the chunks agree
        if not paged:
            return prefill_attention(query, *new_kv, query_start_loc, query_start_loc,
                                     max(query_lens), scale, backend=backend)  # fmt: skip
        if not direct:
            return paged_prefill_attention(query, kv_cache, block_tables, seq_lens,
                                           query_start_loc, max(query_lens), scale)  # fmt: skip
    starts = list(accumulate(query_lens, initial=0))
    device = query.device
    out = torch.empty_like(query)
    decode_seqs = [i for i, n in enumerate(query_lens) if n == 1]
    if decode_seqs:
        decode_idx = device_ints(decode_seqs, torch.int64, device)
        decode_rows = device_ints([starts[i] for i in decode_seqs], torch.int64, device)
        out[decode_rows] = paged_decode_attention(
            query[decode_rows], kv_cache, block_tables[decode_idx], seq_lens[decode_idx], scale
        )
    if direct:
        rows, cu_seqlens, longest = _rows_of(direct, query_lens, starts, device)
        key, value = (t[rows] for t in new_kv)
        out[rows] = prefill_attention(query[rows], key, value, cu_seqlens, cu_seqlens, longest,
                                      scale, backend=backend)  # fmt: skip
    if paged:
        rows, cu_seqlens, longest = _rows_of(paged, query_lens, starts, device)
        paged_idx = device_ints(paged, torch.int64, device)
        out[rows] = paged_prefill_attention(
            query[rows], kv_cache, block_tables[paged_idx], seq_lens[paged_idx], cu_seqlens,
            longest, scale,
        )  # fmt: skip
    return out
