"""dispatch's `on_packed` hook: called once, after the rows are packed and before the exchange
(MoE layers start their shared experts there, beside the exchange)."""

import pytest
import torch

from rayinfer.comm import moe


class OneRankLog:
    """A world of one rank that logs its exchanges."""

    rank, world_size = 0, 1

    def __init__(self):
        self.log = []

    def all_to_all(self, out, inp, out_splits, in_splits, **kw):
        self.log.append("exchange")
        out.copy_(inp)

    def gather_split_matrix(self, in_splits):
        return [[int(in_splits[0])]]


@pytest.mark.parametrize("dedup", [False, True])
@pytest.mark.parametrize("use_fp8", [False, True])
def test_on_packed_runs_between_packing_and_exchange(dedup, use_fp8):
    comm = OneRankLog()
    x = torch.randn(5, 16)
    ids = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [1, 0]])
    weights = torch.rand(5, 2)
    arrived = moe.dispatch(
        comm, x, ids, weights, num_experts=4, use_fp8=use_fp8, tokens_per_rank=[5],
        dedup=dedup, on_packed=lambda: comm.log.append("packed"),
    )  # fmt: skip
    assert comm.log == ["packed", "exchange"]
    back = moe.combine(comm, arrived.x, arrived.handle)  # one rank: the tokens themselves
    tolerance = 0.1 if use_fp8 else 0
    assert torch.allclose(back, x, atol=tolerance * x.abs().max().item(), rtol=0)
