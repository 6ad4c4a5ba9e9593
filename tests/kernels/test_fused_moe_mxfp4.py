"""The MXFP4 (W4A16) fused MoE (Triton, interpreter on CPU, fp16 activations) against the float32
dequantized reference: one token, token counts off the row tile, experts with no tokens, top-1,
slots of other ranks, K not a multiple of the K tile (and a K of one scale group), the
DeepSeek-V4 swiglu_limit; the dequantization against the format's definition; ops' dispatch and
FusedExperts(weight_format="mxfp4") loading."""

import pytest
import torch

from rayinfer.kernels import ops
from rayinfer.kernels.moe.fused_moe_mxfp4 import (
    dequantize_mxfp4_reference,
    fused_moe_mxfp4,
    fused_moe_mxfp4_reference,
    swap_bit_pairs,
)
from rayinfer.layers.fused_experts import FusedExperts

SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2}
WIDE_K = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 128, "GROUP_M": 1}
# SPLIT: even and odd K values as two dots over de-interleaved activations (exact dequantization
# in float32 bits here; the bf16 asm one runs on GPUs only: benchmarks/compile_moe_kernels.py)
SPLIT = {**SMALL, "SPLIT": True}
SPLIT_WIDE = {**WIDE_K, "SPLIT": True, "ASM": True}  # ASM ignored: fp16 activations
# 4 lanes: 16-bit words, one dot per nibble position (fused_moe_mxfp4_quad.py)
QUAD = {**SMALL, "SPLIT": 4}
QUAD_WIDE = {**WIDE_K, "SPLIT": 4, "ASM": True}
# LUT_REG: the lookup's table in a register (asm only: here the launcher's plumbing of the key)
QUAD_REG = {**WIDE_K, "SPLIT": 4, "ASM": True, "LUT_REG": True}
TILES = {
    "small": {"w13": SMALL, "w2": SMALL},
    "wide_k": {"w13": WIDE_K, "w2": WIDE_K},
    "split": {"w13": SPLIT, "w2": SPLIT},
    "split_wide_k": {"w13": SPLIT_WIDE, "w2": SPLIT_WIDE},
    "quad": {"w13": QUAD, "w2": QUAD},
    "quad_wide_k": {"w13": QUAD_WIDE, "w2": QUAD_WIDE},
    "quad_reg": {"w13": QUAD_REG, "w2": QUAD_REG},
}
CASES = {
    "one_token": dict(T=1, H=64, I=32, E=4, K=2),
    "off_the_tile": dict(T=37, H=96, I=64, E=5, K=3),  # H=96: a partial K tile in gate+up
    "idle_experts": dict(T=6, H=64, I=32, E=12, K=2, E_routed=3),
    "top_1": dict(T=20, H=64, I=32, E=3, K=1),
    "k_of_one_group": dict(T=5, H=32, I=32, E=2, K=2),  # w2's K = I = 32: one scale group
    "foreign_ids": dict(T=9, H=64, I=32, E=6, K=3, foreign=True),
}


def _packed_experts(num_experts, rows, cols, gen):
    """Random e2m1 bytes [E, rows, cols/2] and UE8M0 scales 2^-6..2^-3 [E, rows, cols/32]."""
    packed = torch.randint(0, 256, (num_experts, rows, cols // 2), generator=gen)
    scale = torch.randint(121, 125, (num_experts, rows, cols // 32), generator=gen)
    return packed.to(torch.uint8), scale.to(torch.uint8)


def _problem(case, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_tokens, hidden, inter, experts, top_k = (case[k] for k in ("T", "H", "I", "E", "K"))
    x = torch.randn(num_tokens, hidden, generator=gen).half()
    w13, w13_scale = _packed_experts(experts, 2 * inter, hidden, gen)
    w2, w2_scale = _packed_experts(experts, hidden, inter, gen)
    routed = case.get("E_routed", experts)
    ids = torch.stack([torch.randperm(routed, generator=gen)[:top_k] for _ in range(num_tokens)])
    if case.get("foreign"):  # held by other ranks, below and above this one's: add nothing
        ids[::2, 0] = -1
        ids[1::3, -1] = experts + 2
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return x, w13, w2, weights, ids, w13_scale, w2_scale


def _assert_near(out, expected):
    """fp16 activations, and act rounded to fp16 between the GEMMs as in the bf16 path."""
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=3e-3 * scale)


@pytest.mark.parametrize("tiles", list(TILES))
@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_dequantized_reference(name, tiles):
    x, w13, w2, weights, ids, w13_scale, w2_scale = _problem(CASES[name], seed=len(name))
    out = fused_moe_mxfp4(x, w13, w2, weights, ids, w13_scale, w2_scale, config=TILES[tiles])
    expected = fused_moe_mxfp4_reference(x.float(), w13, w2, weights, ids, w13_scale, w2_scale)
    assert out.dtype == torch.float16 and out.shape == x.shape
    _assert_near(out, expected)


def test_swiglu_limit():
    x, w13, w2, weights, ids, w13_scale, w2_scale = _problem(CASES["off_the_tile"], seed=3)
    args = (x, w13, w2, weights, ids, w13_scale, w2_scale)
    expected = fused_moe_mxfp4_reference(x.float(), *args[1:], swiglu_limit=1.5)
    for tiles in ("small", "split"):
        _assert_near(fused_moe_mxfp4(*args, config=TILES[tiles], swiglu_limit=1.5), expected)
    unclamped = fused_moe_mxfp4_reference(x.float(), *args[1:])
    assert (unclamped - expected).abs().max() > 0.1 * expected.abs().max()  # the limit bites


def test_dequantization_follows_the_format():
    """Byte 0x2F: value 0 is the low nibble 0xF (-6), value 1 the high nibble 0x2 (+1); byte
    0x93: 1.5 then -0.5. Scale byte 128 is 2^1, 125 is 2^-2."""
    packed = torch.tensor([[0x2F] * 16 + [0x93] * 16], dtype=torch.uint8)  # [1, 32]: K=64
    scale = torch.tensor([[128, 125]], dtype=torch.uint8)
    values = dequantize_mxfp4_reference(packed, scale)[0]
    assert values[:4].tolist() == [-12.0, 2.0, -12.0, 2.0]
    assert values[32:34].tolist() == [1.5 / 4, -0.5 / 4]
    as_stored = dequantize_mxfp4_reference(
        packed.view(torch.int8), scale.view(torch.float8_e8m0fnu)
    )
    assert torch.equal(as_stored, dequantize_mxfp4_reference(packed, scale))


def test_swap_bit_pairs_orders_a_byte_for_the_lookup_and_undoes_itself():
    """High nibble (s e1 e0 m) = 1011, low (s' e1' e0' m') = 0110: s e1 s' e1' e0 m e0' m'."""
    packed = torch.tensor([0b1011_0110, 0x00, 0xFF, 0x2F], dtype=torch.uint8)
    swapped = swap_bit_pairs(packed)
    assert swapped.tolist() == [0b10_01_11_10, 0x00, 0xFF, 0b00_11_10_11]
    every_byte = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(swap_bit_pairs(swap_bit_pairs(every_byte)), every_byte)
    assert swap_bit_pairs(every_byte).unique().numel() == 256


@pytest.mark.parametrize("tiles", ["quad", "quad_wide_k"])
@pytest.mark.parametrize("name", ["off_the_tile", "k_of_one_group"])
def test_the_four_lane_kernel_reads_swapped_bit_pairs(name, tiles):
    x, w13, w2, weights, ids, w13_scale, w2_scale = _problem(CASES[name], seed=7)
    out = fused_moe_mxfp4(x, swap_bit_pairs(w13), swap_bit_pairs(w2), weights, ids, w13_scale,
                          w2_scale, config=TILES[tiles], bits_swapped=True)  # fmt: skip
    expected = fused_moe_mxfp4_reference(x.float(), w13, w2, weights, ids, w13_scale, w2_scale)
    _assert_near(out, expected)


def test_swapped_bit_pairs_need_four_lane_tiles():
    x, w13, w2, weights, ids, w13_scale, w2_scale = _problem(CASES["one_token"])
    for tiles in ("small", "split"):
        with pytest.raises(ValueError, match='"SPLIT": 4'):
            fused_moe_mxfp4(x, w13, w2, weights, ids, w13_scale, w2_scale, config=TILES[tiles],
                            bits_swapped=True)  # fmt: skip


def test_ops_dispatch_on_the_weight_dtypes():
    """On CPU ops.fused_moe takes MXFP4 experts (as stored: int8 and float8_e8m0fnu) to the
    dequantized reference."""
    x, w13, w2, weights, ids, w13_scale, w2_scale = _problem(CASES["top_1"], seed=1)
    expected = fused_moe_mxfp4_reference(x.float(), w13, w2, weights, ids, w13_scale, w2_scale)
    stored = (w13.view(torch.int8), w2.view(torch.int8))
    scales = (w13_scale.view(torch.float8_e8m0fnu), w2_scale.view(torch.float8_e8m0fnu))
    out = ops.fused_moe(x.float(), *stored, weights, ids, *scales)
    torch.testing.assert_close(out, expected)


def test_fused_experts_load_and_run_mxfp4():
    case = CASES["foreign_ids"]
    x, w13, w2, weights, ids, w13_scale, w2_scale = _problem(case, seed=4)
    hidden, inter = case["H"], case["I"]
    experts = FusedExperts(case["E"], hidden, inter, weight_format="mxfp4", swiglu_limit=2.0)
    assert experts.w13.shape == (case["E"], 2 * inter, hidden // 2)
    assert experts.w2_scale.shape == (case["E"], hidden, inter // 32)
    for e in range(case["E"]):
        for part, rows in (("gate", slice(0, inter)), ("up", slice(inter, None))):
            experts.load_expert_weight(e, part, w13[e, rows].view(torch.int8))
            experts.load_expert_weight(e, part, w13_scale[e, rows], is_scale=True)
        experts.load_expert_weight(e, "down", w2[e])
        experts.load_expert_weight(e, "down", w2_scale[e].view(torch.float8_e8m0fnu), True)
    args = (x.float(), w13, w2, weights, ids, w13_scale, w2_scale)
    expected = fused_moe_mxfp4_reference(*args, swiglu_limit=2.0)
    torch.testing.assert_close(experts(x.float(), weights, ids), expected)


def test_fused_experts_in_the_gpu_layout_run_the_same_experts():
    """What a GPU's experts may hold (kernels/moe/mxfp4_layouts.py), run where the float32
    reference takes them (CPU): the same result as the bytes as shipped; loads after the
    change of layout convert what they copy."""
    case = CASES["off_the_tile"]
    x, w13, w2, weights, ids, w13_scale, w2_scale = _problem(case, seed=5)
    experts = FusedExperts(case["E"], case["H"], case["I"], weight_format="mxfp4")
    for name, t in (("w13", w13), ("w2", w2), ("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        getattr(experts, name).data.copy_(t)
    expected = experts(x.float(), weights, ids)
    assert experts.mxfp4_layout == "shipped"  # made on a CPU
    experts.use_mxfp4_layout("swapped")
    assert not torch.equal(experts.w13, w13)
    torch.testing.assert_close(experts(x.float(), weights, ids), expected, rtol=0, atol=0)
    experts.load_expert_weight(1, "down", w2[1])
    torch.testing.assert_close(experts(x.float(), weights, ids), expected, rtol=0, atol=0)
    experts.use_mxfp4_layout("shipped")
    assert torch.equal(experts.w13, w13) and torch.equal(experts.w2, w2)


def test_fused_experts_read_whether_every_scale_is_at_most_two():
    """The kernel's one-multiply lookup needs every scale byte <= 128; a load reads it again."""
    experts = FusedExperts(2, 64, 32, weight_format="mxfp4")
    experts.w13_scale.fill_(121)
    experts.w2_scale.fill_(128)  # 2.0: still one factor
    assert experts.mxfp4_small_scales()
    experts.load_expert_weight(1, "down", torch.full((64, 1), 129, dtype=torch.uint8), True)
    assert not experts.mxfp4_small_scales()
    assert not FusedExperts(2, 64, 32).mxfp4_small_scales()  # bf16 experts: no scales


def test_a_tile_with_an_unknown_kernel_names_the_key():
    x, w13, w2, weights, ids, w13_scale, w2_scale = _problem(CASES["one_token"])
    tiles = {"w13": {**SMALL, "SPLIT": 3}, "w2": {**SMALL, "SPLIT": 3}}
    with pytest.raises(ValueError, match='tile "SPLIT": 3'):
        fused_moe_mxfp4(x, w13, w2, weights, ids, w13_scale, w2_scale, config=tiles)


def test_fused_experts_name_wrong_mxfp4_shapes():
    experts = FusedExperts(2, 64, 32, weight_format="mxfp4")
    with pytest.raises(ValueError, match=r"expert 1 MXFP4 gate .*\(32, 64\).*\(32, 32\)"):
        experts.load_expert_weight(1, "gate", torch.zeros(32, 64, dtype=torch.uint8))  # unpacked
    with pytest.raises(ValueError, match=r"expert 0 MXFP4 down scale.*\(64, 2\).*\(64, 1\)"):
        experts.load_expert_weight(0, "down", torch.zeros(64, 2, dtype=torch.uint8), True)
    with pytest.raises(ValueError, match="expert 0 MXFP4 up.*bfloat16"):
        experts.load_expert_weight(0, "up", torch.zeros(32, 32, dtype=torch.bfloat16))


def test_kernel_names_mismatched_shapes():
    x, w13, w2, weights, ids, w13_scale, w2_scale = _problem(CASES["one_token"])
    with pytest.raises(ValueError, match=r"w2_scale \(4, 64, 2\), expected \(4, 64, 1\)"):
        fused_moe_mxfp4(
            x, w13, w2, weights, ids, w13_scale, torch.zeros(4, 64, 2, dtype=torch.uint8)
        )


def test_lut_reg_reaches_the_four_lane_kernel_only():
    """ "LUT_REG" picks the four-lane lookup's register-table form; other kernels never see it."""
    from rayinfer.kernels.moe import fused_moe_mxfp4 as mxfp4

    kernel, params = mxfp4._kernel_and_params(QUAD_REG, torch.bfloat16, True)
    assert kernel is mxfp4.moe_mxfp4_quad_kernel
    assert params["LUT_REG"] and params["USE_ASM"] and params["FOLD"]
    assert not mxfp4._kernel_and_params(QUAD_WIDE, torch.bfloat16, False)[1]["LUT_REG"]
    for tile in ({**SPLIT_WIDE, "LUT_REG": True}, {**WIDE_K, "LUT_REG": True}):
        assert "LUT_REG" not in mxfp4._kernel_and_params(tile, torch.bfloat16, False)[1]
