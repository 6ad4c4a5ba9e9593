"""MoE dispatch and combine over an all-to-all: each token travels once per destination rank.

Experts are split evenly and contiguously: rank r holds experts
[r * experts_per_rank, (r + 1) * experts_per_rank). One packed row per (token, destination)
carries the activations (bf16, or FP8 plus its scale) with the token's top-k expert ids and
weights, so dispatch is one all-gather of counts plus one all-to-all.
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from rayinfer.comm.fp8 import Fp8Rows, dequantize, quantize_per_token


class AllToAll(Protocol):
    rank: int
    world_size: int

    def all_to_all(self, out, inp, out_splits: list[int], in_splits: list[int], **kw): ...
    def gather_split_matrix(self, in_splits: list[int]) -> list[list[int]]: ...


@dataclass(frozen=True)
class DispatchHandle:
    """What combine needs to send results back.

    send_token_ids: [S] int64: source token of each row sent, grouped by destination rank.
    split_matrix: [world][world] rows rank i sent to rank j in dispatch.
    """

    send_token_ids: torch.Tensor
    split_matrix: list[list[int]]
    rank: int
    num_tokens: int

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


def dispatch(
    comm: AllToAll,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    use_fp8: bool = False,
    **a2a_options,
) -> DispatchResult:
    """x: [T, H] bf16/fp32: tokens. topk_ids: [T, K] int: global expert ids.
    topk_weights: [T, K] float: router weights. use_fp8: send activations as e4m3 with one
    scale per token (see fp8.py for the error bound); the result is dequantized to x.dtype."""
    n = comm.world_size
    if num_experts % n:
        raise ValueError(f"num_experts={num_experts} must be a multiple of world_size={n}")
    per_rank = num_experts // n
    dest = topk_ids.long() // per_rank  # [T, K]
    goes_to = torch.zeros(x.shape[0], n, dtype=torch.bool, device=x.device)
    goes_to.scatter_(1, dest, True)  # [T, N]
    dest_ids, token_ids = goes_to.t().nonzero(as_tuple=True)  # [S], grouped by destination
    matrix = comm.gather_split_matrix(goes_to.sum(0).tolist())
    in_splits, out_splits = matrix[comm.rank], [row[comm.rank] for row in matrix]
    on_dest = dest[token_ids] == dest_ids.unsqueeze(1)  # [S, K]
    local_ids = torch.where(
        on_dest, topk_ids[token_ids].long() - dest_ids.unsqueeze(1) * per_rank, -1
    )
    weights = torch.where(on_dest, topk_weights[token_ids].float(), 0.0)
    rows = _pack(x[token_ids], local_ids, weights, use_fp8)  # [S, row_bytes] uint8
    recv = rows.new_empty((sum(out_splits), rows.shape[1]))
    comm.all_to_all(recv, rows, out_splits, in_splits, split_matrix=matrix, **a2a_options)
    recv_x, recv_ids, recv_weights = _unpack(recv, x.shape[1], topk_ids.shape[1], x.dtype, use_fp8)
    handle = DispatchHandle(token_ids, matrix, comm.rank, x.shape[0])
    return DispatchResult(recv_x, recv_ids, recv_weights, handle)


def combine(
    comm: AllToAll, expert_out: torch.Tensor, handle: DispatchHandle, **a2a_options
) -> torch.Tensor:
    """expert_out: [R, H]: for each row dispatch delivered here, the weighted sum of its local
    experts' outputs. Returns [T, H] expert_out.dtype: per source token, the sum over ranks,
    in the original token order (summed in float32)."""
    back = expert_out.new_empty((sum(handle.in_splits), expert_out.shape[1]))
    comm.all_to_all(
        back,
        expert_out.contiguous(),
        handle.in_splits,
        handle.out_splits,
        split_matrix=handle.combine_matrix,
        **a2a_options,
    )
    out = torch.zeros(
        handle.num_tokens, expert_out.shape[1], dtype=torch.float32, device=back.device
    )
    out.index_add_(0, handle.send_token_ids, back.float())
    return out.to(expert_out.dtype)


def _pack(x, local_ids, weights, use_fp8: bool) -> torch.Tensor:
    """-> [S, row_bytes] uint8: payload | (fp8: scale f32) | ids int32 [K] | weights f32 [K] |
    zeros up to a multiple of 64 bytes."""
    if use_fp8:
        q = quantize_per_token(x)
        payload = [q.values.view(torch.uint8), q.scales.unsqueeze(1).view(torch.uint8)]
    else:
        payload = [x.contiguous().view(torch.uint8)]
    meta = [local_ids.int().view(torch.uint8), weights.contiguous().view(torch.uint8)]
    row_bytes = sum(p.shape[1] for p in payload + meta)
    # Rows padded to 64 bytes: an FP8 row of 7236 bytes made NCCL's all-to-all 1.75x slower
    # than the bf16 rows twice its size (2x H200, NCCL_P2P_DISABLE=1, 16k tokens).
    pad = [local_ids.new_zeros((x.shape[0], -row_bytes % 64), dtype=torch.uint8)]
    return torch.cat(payload + meta + pad, dim=1)


def _unpack(rows, hidden: int, k: int, dtype, use_fp8: bool):
    payload_bytes = hidden if use_fp8 else hidden * torch.empty(0, dtype=dtype).element_size()
    at = payload_bytes + (4 if use_fp8 else 0)
    if use_fp8:
        values = rows[:, :hidden].contiguous().view(torch.float8_e4m3fn)
        scales = rows[:, hidden:at].contiguous().view(torch.float32).squeeze(1)
        x = dequantize(Fp8Rows(values, scales), dtype)
    else:
        x = rows[:, :at].contiguous().view(dtype)
    ids = rows[:, at : at + 4 * k].contiguous().view(torch.int32).long()
    weights = rows[:, at + 4 * k : at + 8 * k].contiguous().view(torch.float32)
    return x, ids, weights
