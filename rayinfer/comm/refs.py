"""Plain reference versions of the comm operations, computed in one process for tests."""

import torch

from rayinfer.comm.layout import offsets


def all_to_all_ref(inputs: list[torch.Tensor], split_matrix: list[list[int]]) -> list[torch.Tensor]:
    """inputs[i]: [sum(split_matrix[i]), ...]: rank i's rows, blocks in destination order.
    Returns outputs[j]: [sum_i split_matrix[i][j], ...]: rows from every rank, in source order."""
    n = len(inputs)
    starts = [offsets(row) for row in split_matrix]
    return [
        torch.cat([inputs[i][starts[i][j] : starts[i][j + 1]] for i in range(n)]) for j in range(n)
    ]


def moe_identity_ref(x: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """What dispatch -> identity experts -> combine returns: x [T, H] times each token's total
    weight, [T, K] -> [T, 1]."""
    return (x.float() * topk_weights.float().sum(1, keepdim=True)).to(x.dtype)


def identity_experts(recv_x: torch.Tensor, recv_weights: torch.Tensor) -> torch.Tensor:
    """Expert output when every expert is the identity: each row times the sum of its local
    slots' weights. recv_x [R, H], recv_weights [R, K] (0 on other ranks' slots) -> [R, H]."""
    return (recv_x.float() * recv_weights.sum(1, keepdim=True)).to(recv_x.dtype)


def random_split_matrix(
    world_size: int, max_rows: int, generator: torch.Generator
) -> list[list[int]]:
    """[world][world] random rows i -> j in [0, max_rows], with about a quarter zeros."""
    rows = torch.randint(0, max_rows + 1, (world_size, world_size), generator=generator)
    zeros = torch.rand(world_size, world_size, generator=generator) < 0.25
    return rows.masked_fill(zeros, 0).tolist()
