"""The W4A8 MXFP4 fused MoE (Triton interpreter on CPU: the exact e4m3 bits the GPU's lookup
makes, by integer arithmetic) against float32 over the dequantized experts with activations
quantized per token and 128 channels: one token, off the row tile, idle experts, slots of other
ranks, scales spread over 11 binades in a block, the swiglu limit; the octet layout and the
spread check."""

import pytest
import torch

from rayinfer.kernels.moe.fused_moe import fused_moe_fp8_reference
from rayinfer.kernels.moe.fused_moe_mxfp4 import dequantize_mxfp4_reference
from rayinfer.kernels.moe.fused_moe_mxfp4_w4a8 import (
    fits_w4a8,
    from_octets,
    fused_moe_mxfp4_w4a8,
    octet_lanes,
    to_octets,
)

TILES = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 2, "num_warps": 4,
         "num_stages": 2}  # fmt: skip
CASES = {
    "one_token": dict(T=1, H=128, I=128, E=3, K=2),
    "off_the_tile": dict(T=21, H=256, I=128, E=4, K=3),  # two K blocks in gate+up
    "idle_experts": dict(T=6, H=128, I=128, E=12, K=2, E_routed=3),
    "foreign_ids": dict(T=9, H=128, I=128, E=6, K=3, foreign=True),
    "spread_of_11": dict(T=11, H=256, I=128, E=3, K=2, spread=11),
}


def _packed(num_experts, rows, cols, gen, spread):
    """Random e2m1 bytes [E, rows, cols/2] and UE8M0 scales [E, rows, cols/32]: around 2^-5,
    each row's spanning `spread` binades when given."""
    packed = torch.randint(0, 256, (num_experts, rows, cols // 2), generator=gen)
    scale = torch.randint(120, 124, (num_experts, rows, cols // 32), generator=gen)
    if spread:
        scale[..., 0::4] = 128
        scale[..., 3::4] = 128 - spread
    return packed.to(torch.uint8), scale.to(torch.uint8)


def _problem(case, seed):
    gen = torch.Generator().manual_seed(seed)
    num_tokens, hidden, inter, experts, top_k = (case[k] for k in ("T", "H", "I", "E", "K"))
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13, w13_scale = _packed(experts, 2 * inter, hidden, gen, case.get("spread"))
    w2, w2_scale = _packed(experts, hidden, inter, gen, case.get("spread"))
    routed = case.get("E_routed", experts)
    ids = torch.stack([torch.randperm(routed, generator=gen)[:top_k] for _ in range(num_tokens)])
    if case.get("foreign"):
        ids[::2, 0] = -1
        ids[1::3, -1] = experts + 2
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return x, w13, w2, weights, ids, w13_scale, w2_scale


def _reference(x, w13, w2, weights, ids, w13_scale, w2_scale, swiglu_limit=None):
    """float32 over the dequantized experts, x and act quantized as the kernel quantizes them
    (fused_moe_fp8_reference with unit block scales over the exact float32 weights)."""
    w13_full = dequantize_mxfp4_reference(w13, w13_scale)
    w2_full = dequantize_mxfp4_reference(w2, w2_scale)
    ones = lambda w: torch.ones(w.shape[0], w.shape[1] // 128, w.shape[2] // 128)  # noqa: E731
    return fused_moe_fp8_reference(x, w13_full, w2_full, weights, ids, ones(w13_full),
                                   ones(w2_full), swiglu_limit)  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_matches_float32_over_fp8_activations(name):
    x, w13, w2, weights, ids, w13_scale, w2_scale = _problem(CASES[name], seed=len(name))
    config = {"w13": TILES, "w2": TILES}
    out = fused_moe_mxfp4_w4a8(x, to_octets(w13), to_octets(w2), weights, ids, w13_scale,
                               w2_scale, config)  # fmt: skip
    expected = _reference(x, w13, w2, weights, ids, w13_scale, w2_scale)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_swiglu_limit_and_half_activations():
    x, w13, w2, weights, ids, w13_scale, w2_scale = _problem(CASES["foreign_ids"], seed=3)
    config = {"w13": TILES, "w2": TILES}
    octets = (to_octets(w13), to_octets(w2))
    out = fused_moe_mxfp4_w4a8(x.half(), *octets, weights, ids, w13_scale, w2_scale, config,
                               swiglu_limit=0.5)  # fmt: skip
    expected = _reference(x.half().float(), w13, w2, weights, ids, w13_scale, w2_scale, 0.5)
    assert out.dtype == torch.float16
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * scale)
    unclamped = _reference(x, w13, w2, weights, ids, w13_scale, w2_scale)
    assert (unclamped - expected).abs().max() > 0.1 * scale  # the limit bites


def test_octets_carry_magnitudes_in_place_and_signs_for_the_lookup():
    """Values v0..v7 = +0.5, -1, +1.5, -2, -3, +4, -6, +0 (codes 1, 10, 3, 12, 13, 6, 15, 0)."""
    codes = [1, 10, 3, 12, 13, 6, 15, 0]
    shipped = torch.tensor([[codes[2 * j] | codes[2 * j + 1] << 4 for j in range(4)]],
                           dtype=torch.uint8)  # fmt: skip
    word = int.from_bytes(bytes(to_octets(shipped)[0].tolist()), "little")
    nibbles = [(word >> (4 * i)) & 15 for i in range(8)]
    assert [n & 7 for n in nibbles] == [c & 7 for c in codes]
    signs = [c >> 3 for c in codes]
    assert [n >> 3 for n in nibbles] == [signs[i] for i in (4, 0, 5, 1, 6, 2, 7, 3)]
    every_word = torch.randint(0, 256, (64, 4096), generator=torch.Generator().manual_seed(0))
    every_word = every_word.to(torch.uint8)
    assert torch.equal(from_octets(to_octets(every_word)), every_word)


def test_octet_lanes_split_each_eight_values_in_halves():
    q = torch.arange(16.0).view(1, 16)
    assert octet_lanes(q).tolist() == [[[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]]


def test_fits_w4a8_allows_eleven_binades_in_a_row():
    scale = torch.full((2, 4, 8), 120, dtype=torch.uint8)
    assert fits_w4a8(scale)
    scale[1, 2, 5] = 131  # row 2 of expert 1: 120..131
    scale[0, 3, 0] = 109  # row 3 of expert 0: 109..120
    assert fits_w4a8(scale)
    scale[1, 2, 0] = 119
    assert not fits_w4a8(scale)
    assert not fits_w4a8(torch.full((2, 4, 6), 120, dtype=torch.uint8))  # K = 192: no blocks
