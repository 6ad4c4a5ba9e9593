"""Kernel wrappers take their small parameter tensors in any layout (a strided view, a broadcast)
and give what the dense copies give; inputs a kernel cannot serve are refused with a message
naming the limit instead of giving wrong numbers."""

import pytest
import torch

from rayinfer.kernels.elementwise.rms_norm import rms_norm, rms_norm_reference
from rayinfer.kernels.elementwise.rotary import rotary_embedding, rotary_embedding_reference
from rayinfer.kernels.fp8.fp8_quant import fp8_quant_reference
from rayinfer.kernels.moe import moe_pack
from rayinfer.kernels.moe.fused_moe import fused_moe
from rayinfer.kernels.moe.fused_moe_small import MAX_TOP_K, fused_moe_small_batch
from rayinfer.kernels.moe.moe_routing import moe_routing_reference
from rayinfer.kernels.moe.moe_routing_kernel import moe_routing


def strided(values: torch.Tensor) -> torch.Tensor:
    """The same values as a view with stride 2."""
    return torch.stack([values, torch.full_like(values, -7)], 1)[:, 0]


def test_rms_norm_weight_in_any_layout():
    x, weight = torch.randn(3, 64), torch.randn(64)
    expected = rms_norm_reference(x, weight, 1e-6)
    torch.testing.assert_close(rms_norm(x, strided(weight), 1e-6), expected)
    ones = torch.ones(1).expand(64)
    torch.testing.assert_close(rms_norm(x, ones, 1e-6), rms_norm_reference(x, ones, 1e-6))


def test_routing_correction_bias_in_any_layout():
    logits, bias = torch.randn(5, 16), torch.randn(16) * 0.3
    args = (4, "sigmoid", True, 4, 2)
    expected = moe_routing_reference(logits, *args, bias)
    assert torch.equal(moe_routing(logits, *args, strided(bias)).topk_ids, expected.topk_ids)
    zeros = torch.zeros(1).expand(16)
    assert torch.equal(
        moe_routing(logits, *args, zeros).topk_ids,
        moe_routing_reference(logits, *args, zeros).topk_ids,
    )


def test_rotary_positions_and_frequencies_in_any_layout():
    query, key = torch.randn(4, 2, 16), torch.randn(4, 1, 16)
    positions, inv_freq = torch.tensor([0, 3, 7, 100]), torch.rand(8)
    expected = rotary_embedding_reference(positions, query, key, inv_freq)
    ours = rotary_embedding(strided(positions), query, key, strided(inv_freq))
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want)


def test_localize_refuses_rows_too_short_for_the_ids():
    with pytest.raises(ValueError, match="cannot hold 2 ids and weights at byte 56"):
        moe_pack.localize_expert_ids(torch.zeros(3, 64, dtype=torch.uint8), 56, 2, 0, 4)


def test_small_batch_moe_refuses_more_slots_than_its_dot_columns():
    experts = top_k = MAX_TOP_K + 1
    x, w13, w2 = torch.randn(1, 32), torch.randn(experts, 32, 32), torch.randn(experts, 32, 16)
    ids, weights = torch.randperm(experts)[None], torch.rand(1, top_k)
    with pytest.raises(ValueError, match=f"top_k={top_k}: .* at most {MAX_TOP_K}"):
        fused_moe_small_batch(x, w13, w2, weights, ids)


def test_fp8_moe_refuses_a_k_tile_past_the_scale_block():
    w13 = torch.zeros(2, 256, 256).to(torch.float8_e4m3fn)
    w2 = torch.zeros(2, 256, 128).to(torch.float8_e4m3fn)
    tile = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "GROUP_M": 1}
    with pytest.raises(ValueError, match="config w13: BLOCK_K=256 must divide the FP8 scale"):
        fused_moe(
            torch.randn(4, 256), w13, w2, torch.rand(4, 1), torch.zeros(4, 1, dtype=torch.int64),
            torch.ones(2, 2, 2), torch.ones(2, 2, 1), config={"w13": tile, "w2": tile},
        )  # fmt: skip


def test_fp8_quant_reference_of_no_rows():
    q, scale = fp8_quant_reference(torch.randn(0, 130))
    assert q.shape == (0, 130) and scale.shape == (0, 2)


def test_prefill_attention_refuses_an_output_it_cannot_write_densely():
    from rayinfer.kernels.attention.prefill_attention import prefill_attention

    q, k, v = torch.randn(5, 2, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    bounds = torch.tensor([0, 5], dtype=torch.int32)
    out = torch.empty(16, 2, 5).permute(2, 1, 0)  # [T, H, D] with a column stride of 10
    with pytest.raises(ValueError, match="dense in its last dim"):
        prefill_attention(q, k, v, bounds, bounds, 5, 0.25, out=out)


def test_mixed_attention_refuses_a_sequence_without_query_tokens():
    from rayinfer.kernels.attention.prefill_attention import paged_mixed_attention

    query, cache = torch.randn(1, 2, 16), torch.randn(2, 4, 2, 1, 16)
    tables = torch.tensor([[0], [1]], dtype=torch.int32)
    seq_lens, starts = torch.tensor([3, 2], dtype=torch.int32), torch.tensor([0, 0, 1])
    with pytest.raises(ValueError, match=r"query_lens \[0, 1\]: every sequence needs"):
        paged_mixed_attention(query, cache, tables, seq_lens, starts.int(), [0, 1], 0.25)
