"""The MoE kernels on a GPU at production shapes, against their torch references:

- the one-launch routing kernel (DeepSeek-V2-Lite, DeepSeek-V3 and Qwen3-MoE routers at 1, 64
  and 4,096 tokens): the same experts, best first, and weights within 1e-5;
- the two-launch small-batch fused MoE on DeepSeek-V2-Lite's experts in bf16 against float32,
  no further from it than the general fused MoE it stands in for;
- the all-tokens row kernels in bf16 (the CPU interpreter runs float32/float16 only) at
  DeepSeek-V2-Lite's hidden size and top-6: packed rows and localized ids byte-equal to the
  reference, FP8 rows within one FP8 step on at most 1% of the values.

    python -m pytest -q -m gpu tests/gpu/test_moe_kernels.py
"""

import pytest
import torch

from rayinfer.kernels.moe import moe_pack
from rayinfer.kernels.moe.fused_moe import fused_moe, fused_moe_reference
from rayinfer.kernels.moe.fused_moe_small import fused_moe_small_batch
from rayinfer.kernels.moe.moe_routing import moe_routing_reference
from rayinfer.kernels.moe.moe_routing_kernel import moe_routing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# name -> (experts, top_k, scoring, renormalize, groups, topk_groups, has_bias, scaling)
ROUTERS = {
    "deepseek-v2-lite": (64, 6, "softmax", False, 1, 1, False, 1.0),
    "deepseek-v3": (256, 8, "sigmoid", True, 8, 4, True, 2.5),
    "qwen3-moe": (128, 8, "softmax", True, 1, 1, False, 1.0),
}


@pytest.mark.parametrize("num_tokens", [1, 64, 4096])
@pytest.mark.parametrize("router", list(ROUTERS))
def test_routing_kernel_matches_the_reference(router, num_tokens):
    experts, top_k, scoring, renormalize, groups, topk_groups, has_bias, scaling = ROUTERS[router]
    generator = torch.Generator().manual_seed(num_tokens)
    logits = (torch.randn(num_tokens, experts, generator=generator) * 2).cuda()
    bias = (torch.randn(experts, generator=generator) * 0.3).cuda() if has_bias else None
    args = (logits, top_k, scoring, renormalize, groups, topk_groups, bias, scaling)
    ours, expected = moe_routing(*args), moe_routing_reference(*args)
    assert torch.equal(ours.topk_ids, expected.topk_ids)
    torch.testing.assert_close(ours.topk_weights, expected.topk_weights, rtol=0, atol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 2])
def test_small_batch_moe_is_as_close_to_float32_as_the_general_one(num_tokens):
    generator = torch.Generator().manual_seed(0)
    experts, hidden, inter, top_k = 64, 2048, 1408, 6  # DeepSeek-V2-Lite
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=generator) / hidden**0.5).cuda()
    w2 = (torch.randn(experts, hidden, inter, generator=generator) / inter**0.5).cuda()
    x = torch.randn(num_tokens, hidden, generator=generator).cuda()
    ids = torch.stack(
        [torch.randperm(experts, generator=generator)[:top_k] for _ in range(num_tokens)]
    ).cuda()  # [T, K]
    weights = torch.rand(num_tokens, top_k, generator=generator).cuda()  # [T, K]
    expected = fused_moe_reference(x, w13, w2, weights, ids)  # [T, H] float32
    bf16 = (x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    scale = expected.norm()
    small = ((fused_moe_small_batch(*bf16).float() - expected).norm() / scale).item()
    general = ((fused_moe(*bf16).float() - expected).norm() / scale).item()
    assert small < 1e-2 and small <= 1.2 * general, (small, general)


@pytest.fixture(scope="module")
def routed_tokens():
    """(x [1000, 2048] bf16, topk_ids [1000, 6] of 64 experts, topk_weights [1000, 6])."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 2048, generator=generator).to("cuda", torch.bfloat16)
    ids = torch.rand(1000, 64, generator=generator).argsort(1)[:, :6].cuda()
    weights = torch.rand(1000, 6, generator=generator).cuda()
    return x, ids, weights


def test_bf16_rows_and_localized_ids_match_the_reference(routed_tokens):
    x, ids, weights = routed_tokens
    ids_at, row_bytes = 4096, 4160  # comm.moe.RowLayout(2048, 6, bfloat16, False), 2 ranks
    got = moe_pack.pack_for_every_rank(x, ids, weights, 2, ids_at, row_bytes)
    expected = moe_pack.pack_for_every_rank_reference(x, ids, weights, 2, ids_at, row_bytes)
    assert torch.equal(got, expected)
    local = moe_pack.localize_expert_ids(got, ids_at, 6, 32, 32)
    local_expected = moe_pack.localize_expert_ids_reference(expected, ids_at, 6, 32, 32)
    assert all(torch.equal(a, b) for a, b in zip(local, local_expected, strict=True))


def test_fp8_rows_match_the_reference_within_one_step(routed_tokens):
    """FP8 dispatch rows: values at 0, scale at 2048, ids at 2052, 2112 bytes a row."""
    x, ids, weights = routed_tokens
    args = (x, ids, weights, 2, 2048, 2052, 2112)
    rows = moe_pack.pack_fp8_for_every_rank(*args)
    expected = moe_pack.pack_fp8_for_every_rank_reference(*args)
    assert torch.equal(rows[:, 2048:], expected[:, 2048:])  # scale, ids, weights, padding
    values, want = (r[:, :2048].view(torch.float8_e4m3fn).float() for r in (rows, expected))
    # the kernel rounds onto the e4m3 grid itself: at most one step from torch's cast, and rarely
    assert (values - want).abs().le(want.abs() / 8 + 2**-9).all()
    assert (values != want).sum() <= 0.01 * values.numel()
    unpacked = moe_pack.unpack_fp8_rows(rows, 2048, 2048, torch.bfloat16)
    assert torch.equal(
        unpacked, moe_pack.unpack_fp8_rows_reference(rows, 2048, 2048, torch.bfloat16)
    )
