"""MoE dispatch and combine over an all-to-all: each token travels once per destination rank.

Experts are split evenly and contiguously: rank r holds experts
[r * experts_per_rank, (r + 1) * experts_per_rank). One packed row per (token, destination)
carries the activations (bf16, or FP8 plus its scale) with the token's top-k expert ids and
weights.

Two ways to pick the rows, chosen per call:
- deduplicated: a token travels to each rank that holds at least one of its experts. The row
  counts depend on the routing, so dispatch all-gathers them and waits for the device once.
- all tokens: every token travels to every rank (an all-gather of tokens, and combine a
  reduce-scatter of results, as Megatron-LM's "allgather" token dispatcher). The counts are the
  ranks' token counts, known on the host before the step (`tokens_per_rank`), so nothing waits
  for the device and the exchange can be queued ahead of the compute it overlaps. With few
  ranks nearly every token needs every rank anyway: DeepSeek-V2-Lite (64 experts, top-6) on 2
  ranks sends 98.8% of its tokens to the other rank under uniform routing, DeepSeek-V3 (256,
  top-8) on 8 ranks 66%. `dedup=None` takes all tokens when `tokens_per_rank` is given and the
  expected share is at least ALL_TOKENS_MIN_SHARE.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from rayinfer.comm.fp8 import Fp8Rows, dequantize, quantize_per_token
from rayinfer.kernels import ops

# Send every token to every rank when a rank is expected to need at least this share of them.
ALL_TOKENS_MIN_SHARE = 0.9


class AllToAll(Protocol):
    rank: int
    world_size: int

    def all_to_all(self, out, inp, out_splits: list[int], in_splits: list[int], **kw): ...
    def gather_split_matrix(self, in_splits) -> list[list[int]]: ...


@dataclass(frozen=True)
class DispatchHandle:
    """What combine needs to send results back.

    send_token_ids: [S] int64: source token of each row sent, grouped by destination rank.
    split_matrix: [world][world] rows rank i sent to rank j in dispatch.
    row_index: [T, world] int32: row of `send_token_ids` (and of combine's returned rows) for
        each token and destination rank, -1 where the token did not go there.
    """

    send_token_ids: torch.Tensor
    split_matrix: list[list[int]]
    rank: int
    num_tokens: int
    row_index: torch.Tensor

    @property
    def in_splits(self) -> list[int]:
        return self.split_matrix[self.rank]

    @property
    def out_splits(self) -> list[int]:
        return [row[self.rank] for row in self.split_matrix]

    @property
    def combine_matrix(self) -> list[list[int]]:
        return [list(col) for col in zip(*self.split_matrix, strict=True)]


@dataclass(frozen=True)
class DispatchResult:
    """x: [R, H] dtype of the input: tokens that reached this rank, grouped by source rank.
    topk_ids: [R, K] int64: expert id local to this rank for each slot, -1 where the slot's
        expert lives on another rank.
    topk_weights: [R, K] float32: router weight of each slot, 0 where topk_ids is -1.
    handle: pass to combine."""

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    handle: DispatchHandle


def expected_share_per_rank(num_experts: int, top_k: int, world_size: int) -> float:
    """Share of a rank's tokens with at least one of their top-k experts on a given other rank,
    for uniform routing: 1 - C(E - E/n, K) / C(E, K)."""
    others = num_experts - num_experts // world_size
    return 1.0 - math.comb(others, top_k) / math.comb(num_experts, top_k)


def sends_all_tokens(
    num_experts: int, top_k: int, world_size: int, tokens_per_rank, dedup: bool | None
) -> bool:
    """Whether `dispatch` with these options takes the all-tokens exchange (every token to every
    rank: then rank r's rows from rank s are s's tokens in order)."""
    if dedup is None:
        share = expected_share_per_rank(num_experts, top_k, world_size)
        return tokens_per_rank is not None and share >= ALL_TOKENS_MIN_SHARE
    return not dedup


def dispatch(
    comm: AllToAll,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    use_fp8: bool = False,
    tokens_per_rank: list[int] | None = None,
    dedup: bool | None = None,
    on_packed: Callable[[], None] | None = None,
    skip_self: bool = False,
    **a2a_options,
) -> DispatchResult:
    """x: [T, H] bf16/fp32: tokens. topk_ids: [T, K] int: global expert ids.
    topk_weights: [T, K] float: router weights. use_fp8: send activations as e4m3 with one
    scale per token (see fp8.py for the error bound); the result is dequantized to x.dtype.
    tokens_per_rank: [world] every rank's T for this call, if the caller knows it (then the
    all-tokens exchange needs no device sync). dedup: True sends each token only to the ranks
    holding its experts, False sends all tokens (needs tokens_per_rank), None picks (see the
    module docstring). Every rank must pass the same tokens_per_rank and dedup. on_packed: called
    once the rows to send are queued and before the exchange is, so that work it queues on
    another stream (forked from the caller's) runs while the tokens travel and never delays the
    packing. skip_self (all-tokens exchange only): a rank's tokens go to the other ranks alone;
    the caller computes its own experts' share of them itself (and passes it to combine as an
    addend), so no copy of them is packed, exchanged, dequantized or routed here."""
    n = comm.world_size
    if num_experts % n:
        raise ValueError(f"num_experts={num_experts} must be a multiple of world_size={n}")
    if tokens_per_rank is not None and (
        len(tokens_per_rank) != n or tokens_per_rank[comm.rank] != x.shape[0]
    ):
        raise ValueError(
            f"tokens_per_rank={tokens_per_rank} must have one count per rank ({n}) and "
            f"{x.shape[0]} (this rank's tokens) at position {comm.rank}"
        )
    if sends_all_tokens(num_experts, topk_ids.shape[1], n, tokens_per_rank, dedup):
        if tokens_per_rank is None:
            raise ValueError("dedup=False sends every token to every rank: pass tokens_per_rank")
        return _dispatch_all_tokens(
            comm, x, topk_ids, topk_weights, num_experts, use_fp8, tokens_per_rank, on_packed,
            skip_self, a2a_options,
        )  # fmt: skip
    if skip_self:
        raise ValueError("skip_self needs the all-tokens exchange (dedup=False, tokens_per_rank)")
    per_rank = num_experts // n
    dest = topk_ids // per_rank  # [T, K]
    goes_to = torch.zeros(x.shape[0], n, dtype=torch.bool, device=x.device)
    goes_to.scatter_(1, dest.long(), True)  # [T, N]
    counts = goes_to.sum(0)  # [N]
    matrix = comm.gather_split_matrix(counts)  # the one host sync: every size below is known
    in_splits, out_splits = matrix[comm.rank], [row[comm.rank] for row in matrix]
    # [S] rows grouped by destination, ascending tokens within one; the static size needs no
    # second sync (nonzero would wait for the device to learn S).
    pairs = torch.nonzero_static(goes_to.t(), size=sum(in_splits))  # [S, 2] (dest, token)
    dest_ids, token_ids = pairs[:, 0], pairs[:, 1]
    # Row of (token, rank) in the send (and combine's return) order: rank's offset plus the
    # token's rank among that destination's tokens.
    offsets = counts.cumsum(0) - counts  # [N]
    row_index = torch.where(goes_to, goes_to.cumsum(0) - 1 + offsets, -1).to(torch.int32)
    ids = topk_ids[token_ids]  # [S, K]
    on_dest = dest[token_ids] == dest_ids.unsqueeze(1)  # [S, K]
    local_ids = torch.where(on_dest, ids - dest_ids.unsqueeze(1) * per_rank, -1)
    weights = torch.where(on_dest, topk_weights[token_ids].float(), 0.0)
    rows = _pack(x, token_ids, local_ids, weights, use_fp8)  # [S, row_bytes] uint8
    if on_packed is not None:
        on_packed()
    recv = rows.new_empty((sum(out_splits), rows.shape[1]))
    comm.all_to_all(recv, rows, out_splits, in_splits, split_matrix=matrix, **a2a_options)
    recv_x, recv_ids, recv_weights = _unpack(recv, x.shape[1], topk_ids.shape[1], x.dtype, use_fp8)
    handle = DispatchHandle(token_ids, matrix, comm.rank, x.shape[0], row_index)
    return DispatchResult(recv_x, recv_ids, recv_weights, handle)


def _dispatch_all_tokens(
    comm, x, topk_ids, topk_weights, num_experts, use_fp8, tokens_per_rank, on_packed, skip_self,
    a2a_options,
) -> DispatchResult:  # fmt: skip
    """Every token to every rank (to every other rank with skip_self), global expert ids in the
    rows; each rank keeps its experts' slots. No device sync: every size is a token count the
    host already has."""
    n, rank, num_tokens = comm.world_size, comm.rank, x.shape[0]
    per_rank, topk = num_experts // n, topk_ids.shape[1]
    layout = RowLayout(x.shape[1], topk, x.dtype, use_fp8)
    # rank i sends its T_i rows to each j (but itself, with skip_self)
    matrix = [
        [0 if skip_self and i == j else count for j in range(n)]
        for i, count in enumerate(tokens_per_rank)
    ]
    copies = n - 1 if skip_self else n  # the rows are alike for every destination
    if use_fp8:  # one launch: each token quantized once, its row written for every rank
        send = ops.pack_fp8_for_every_rank(
            x, topk_ids, topk_weights, copies, layout.payload_bytes, layout.ids_at,
            layout.row_bytes,
        )  # fmt: skip
    else:  # one launch for all copies
        send = ops.pack_for_every_rank(
            x, topk_ids, topk_weights, copies, layout.ids_at, layout.row_bytes
        )
    if on_packed is not None:
        on_packed()
    out_splits = [row[rank] for row in matrix]
    recv = send.new_empty((sum(out_splits), layout.row_bytes))
    comm.all_to_all(recv, send, out_splits, matrix[rank], split_matrix=matrix, **a2a_options)
    if use_fp8:
        recv_x = ops.unpack_fp8_rows(recv, x.shape[1], layout.payload_bytes, x.dtype)
    else:
        recv_x = layout.columns(recv)[0]
    local_ids, weights = ops.localize_expert_ids(
        recv, layout.ids_at, topk, rank * per_rank, per_rank
    )  # [R, K] each: -1 / 0 where another rank holds the expert
    stream = torch.cuda.current_stream(x.device).stream_id if x.is_cuda else 0
    skipped = rank if skip_self else None
    send_token_ids, row_index = _all_tokens_index(num_tokens, n, skipped, x.device, stream)
    handle = DispatchHandle(send_token_ids, matrix, rank, num_tokens, row_index)
    return DispatchResult(recv_x, local_ids, weights, handle)


@functools.lru_cache(maxsize=64)
def _all_tokens_index(num_tokens: int, world: int, skipped, device: torch.device, stream: int):
    """(send_token_ids [copies * T]: 0..T-1 once per destination; row_index [T, world] int32:
    combine brings back destination d's row for token t at (d's place among the destinations)
    * T + t, -1 for the `skipped` rank (None: none)). Read-only, cached: they depend on the
    sizes alone, and building them took six launches per exchange. Cached per CUDA stream: an
    entry made on one two-batch-overlap lane is only ready in that lane's order."""
    tokens = torch.arange(num_tokens, device=device)
    places = torch.arange(world, device=device)  # no host tensor: this may run in graph capture
    if skipped is not None:
        places = places - (places > skipped).long()
    row_index = tokens.unsqueeze(1) + places * num_tokens
    if skipped is not None:
        row_index[:, skipped] = -1
    copies = world - (skipped is not None)
    return tokens.repeat(copies), row_index.int()


def combine(
    comm: AllToAll,
    expert_out: torch.Tensor,
    handle: DispatchHandle,
    addends: tuple[torch.Tensor, ...] = (),
    **a2a_options,
) -> torch.Tensor:
    """expert_out: [R, H]: for each row dispatch delivered here, the weighted sum of its local
    experts' outputs. addends: up to two [T, H] added in the same pass (dispatch's skip_self
    leaves this rank's own experts' share of its tokens to the caller: pass it here). Returns
    [T, H] expert_out.dtype: per source token, the sum over ranks (and addends), in the
    original token order (summed in float32)."""
    back = expert_out.new_empty((sum(handle.in_splits), expert_out.shape[1]))
    comm.all_to_all(
        back,
        expert_out.contiguous(),
        handle.in_splits,
        handle.out_splits,
        split_matrix=handle.combine_matrix,
        **a2a_options,
    )
    # One gather-and-sum per token (float32, rank order), written in expert_out's dtype.
    return ops.moe_combine(back, handle.row_index, expert_out.dtype, addends)


@dataclass(frozen=True)
class RowLayout:
    """Byte layout of one dispatched row: payload (bf16, or e4m3 then a float32 scale),
    topk ids int32 [K], topk weights float32 [K], zero padding to a multiple of 64 bytes.
    Column views of this layout are strided tensors, not copies: copying uint8 columns byte by
    byte made bf16 dispatch of 16k tokens 6x slower than its all-to-all (2x H200)."""

    hidden: int
    topk: int
    dtype: torch.dtype
    use_fp8: bool

    @property
    def payload_bytes(self) -> int:
        size = self.hidden * (1 if self.use_fp8 else self.dtype.itemsize)
        return -(-size // 4) * 4

    @property
    def ids_at(self) -> int:
        return self.payload_bytes + (4 if self.use_fp8 else 0)

    @property
    def row_bytes(self) -> int:
        return -(-(self.ids_at + 8 * self.topk) // 64) * 64

    def columns(self, rows: torch.Tensor):
        """rows [S, row_bytes] uint8 -> views (payload, scale or None, ids, weights)."""
        h, at, k = self.hidden, self.ids_at, self.topk
        if self.use_fp8:
            payload = rows[:, :h].view(torch.float8_e4m3fn)
            scale = rows[:, self.payload_bytes : at].view(torch.float32)
        else:
            payload, scale = rows[:, : h * self.dtype.itemsize].view(self.dtype), None
        ids = rows[:, at : at + 4 * k].view(torch.int32)
        weights = rows[:, at + 4 * k : at + 8 * k].view(torch.float32)
        return payload, scale, ids, weights


def _pack(x, token_ids, local_ids, weights, use_fp8: bool) -> torch.Tensor:
    """x [T, H], token_ids [S] (None: every token in order, S = T), local_ids [S, K], weights
    [S, K] -> [S, row_bytes] uint8: row s carries x[token_ids[s]] (see RowLayout). The payload is
    gathered straight into the layout."""
    layout = RowLayout(x.shape[1], local_ids.shape[1], x.dtype, use_fp8)
    num_rows = x.shape[0] if token_ids is None else token_ids.shape[0]
    rows = torch.empty(num_rows, layout.row_bytes, dtype=torch.uint8, device=x.device)
    rows[:, layout.ids_at + 8 * layout.topk :].zero_()
    if use_fp8:
        rows[:, layout.hidden : layout.payload_bytes].zero_()
    payload, scale, ids, w = layout.columns(rows)
    if use_fp8:  # quantize each token once (the scale is per token), then gather its rows
        q = quantize_per_token(x)
        _gather_rows(q.values.view(torch.uint8), token_ids, payload.view(torch.uint8))
        _gather_rows(q.scales, token_ids, scale.squeeze(1))
    else:
        _gather_rows(x, token_ids, payload)
    ids.copy_(local_ids)
    w.copy_(weights)
    return rows


def _gather_rows(src: torch.Tensor, index: torch.Tensor | None, out: torch.Tensor) -> None:
    """out[i] = src[index[i]] (index None: out = src), written into the (strided) view `out`."""
    if index is None:
        out.copy_(src)
        return
    result = torch.index_select(src, 0, index, out=out)
    if result.data_ptr() != out.data_ptr():  # an implementation that could not write in place
        out.copy_(result)


def _unpack(rows, hidden: int, k: int, dtype, use_fp8: bool):
    """-> x [R, H] dtype (a strided view of `rows` for bf16), ids [R, K] int64, weights [R, K]."""
    payload, scale, ids, weights = RowLayout(hidden, k, dtype, use_fp8).columns(rows)
    x = dequantize(Fp8Rows(payload, scale.squeeze(1)), dtype) if use_fp8 else payload
    return x, ids.long(), weights.float()
