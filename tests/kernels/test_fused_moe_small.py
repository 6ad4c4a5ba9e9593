"""The two-launch fused MoE for a handful of slots (Triton, interpreter on CPU) against the torch
reference of the general fused MoE: one token, two tokens, odd sizes, top-k equal to the number
of experts, the same expert twice in a batch, and slots routed to another rank's experts."""

import pytest
import torch

from rayinfer.kernels.moe.fused_moe import fused_moe_reference
from rayinfer.kernels.moe.fused_moe_small import fits_small_batch, fused_moe_small_batch

TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.float16: (2e-2, 2e-3)}


def _experts(num_experts, hidden, inter, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    return w13, w2, gen


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize(
    "num_tokens, num_experts, top_k, hidden, inter",
    [(1, 8, 2, 64, 32), (2, 8, 8, 48, 40), (1, 16, 6, 130, 70), (3, 4, 2, 32, 16)],
    ids=["one-token", "topk-all-experts", "odd-sizes", "shared-expert-ids"],
)
def test_matches_the_general_reference(dtype, num_tokens, num_experts, top_k, hidden, inter):
    w13, w2, gen = _experts(num_experts, hidden, inter, dtype, seed=hidden)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    ids = torch.stack(
        [torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
    )
    if num_tokens == 3:
        ids[1] = ids[0]  # two tokens on the same experts
    weights = torch.rand(num_tokens, top_k, generator=gen)
    ours = fused_moe_small_batch(x, w13, w2, weights, ids)
    expected = fused_moe_reference(x.float(), w13.float(), w2.float(), weights, ids)
    rtol, atol = TOLERANCES[dtype]
    assert ours.dtype == dtype and ours.shape == x.shape
    torch.testing.assert_close(ours.float(), expected, rtol=rtol, atol=atol)


def test_slots_of_another_ranks_experts_add_nothing():
    w13, w2, gen = _experts(4, 32, 16, torch.float32, seed=1)
    x = torch.randn(2, 32, generator=gen)
    ids = torch.tensor([[0, -1], [5, 3]])  # -1 and 5: experts held elsewhere
    weights = torch.rand(2, 2, generator=gen)
    ours = fused_moe_small_batch(x, w13, w2, weights, ids)
    torch.testing.assert_close(ours, fused_moe_reference(x, w13, w2, weights, ids))
    only = fused_moe_small_batch(x, w13, w2, weights, torch.full((2, 2), -1))
    assert torch.equal(only, torch.zeros_like(x))


def test_which_calls_it_takes():
    x, w13 = torch.zeros(2, 8), torch.zeros(4, 8, 8)
    assert fits_small_batch(torch.zeros(2, 8, dtype=torch.int64), w13, x)
    assert not fits_small_batch(torch.zeros(3, 8, dtype=torch.int64), w13, x)  # 24 slots
    assert not fits_small_batch(torch.zeros(1, 2, dtype=torch.int64), w13.half(), x)  # FP8 etc.
