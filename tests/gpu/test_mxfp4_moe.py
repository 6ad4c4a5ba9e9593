"""The MXFP4 fused MoE's GPU kernels in bf16 against float32 over the dequantized experts (the
CPU interpreter runs only their exact fp16 form): tl.dot_scaled, the two-lane split kernel and
the four-lane word kernel, with scales of at most 2 (the lookup's one multiply) and past 2 (its
two), at 1 to 600 tokens (row tiles of 16 and 128, K tails included). Each is held to the bf16
fused MoE's own error on the same bf16-exact experts.

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/gpu/test_mxfp4_moe.py
"""

import pytest
import torch

from rayinfer.bench.kernels_moe_mxfp4 import dequantized_bf16, float32_reference
from rayinfer.bench.moe_cases import MoeShape, random_routing, relative_error
from rayinfer.kernels.backends import DEFAULT_BACKENDS
from rayinfer.kernels.moe.fused_moe import fused_moe
from rayinfer.kernels.moe.fused_moe_mxfp4 import fused_moe_mxfp4, swap_bit_pairs
from rayinfer.layers.fused_experts import FusedExperts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPE = MoeShape(num_experts=32, hidden=1056, intermediate=544, top_k=6)  # K tails at BK 128
LIMIT = 10.0
KERNELS = {  # name -> tile (the same for both GEMMs)
    "dot_scaled": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
    "split": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3,
              "SPLIT": True, "ASM": True},
    "quad": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3,
             "SPLIT": 4, "ASM": True},
    "quad_reg": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3,
                 "SPLIT": 4, "ASM": True, "LUT_REG": True},
    "quad_reg_mma_sync": {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 2, "num_stages": 3,
                          "SPLIT": 4, "ASM": True, "LUT_REG": True},  # mma.sync on Hopper
}  # fmt: skip
SWAPPED = ("quad_reg", "quad_reg_mma_sync")  # also run over bytes with swapped bit pairs


def experts_with_scales(low: int, high: int) -> dict:
    """Random e2m1 bytes with scale bytes in [low, high] (128 is 2.0)."""
    gen = torch.Generator(device="cuda").manual_seed(low * 1000 + high)
    e, h, i = SHAPE.num_experts, SHAPE.hidden, SHAPE.intermediate

    def part(rows, cols):
        packed = torch.randint(0, 256, (e, rows, cols // 2), generator=gen, device="cuda")
        scale = torch.randint(low, high + 1, (e, rows, cols // 32), generator=gen, device="cuda")
        return packed.to(torch.uint8), scale.to(torch.uint8)

    (w13, w13_scale), (w2, w2_scale) = part(2 * i, h), part(h, i)
    return dict(w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale)


@pytest.mark.parametrize("scales", [(116, 120), (124, 131)], ids=["fold", "two_factors"])
@pytest.mark.parametrize("num_tokens", [1, 128, 600])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_mxfp4_kernel_is_as_close_to_float32_as_bf16_experts(kernel, num_tokens, scales):
    experts = experts_with_scales(*scales)
    w13_bf16, w2_bf16 = dequantized_bf16(experts)  # exact: e2m1 times a power of two
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    magnitude = 2.0 ** -(scales[1] - 120)  # keeps act's values in bf16's comfortable range
    x = torch.randn(num_tokens, SHAPE.hidden, device="cuda", generator=gen) * magnitude
    x = x.to(torch.bfloat16)
    weights, ids = random_routing(num_tokens, SHAPE, "cuda", seed=num_tokens)
    ref = float32_reference(x, w13_bf16, w2_bf16, weights, ids, LIMIT)
    block_m = 16 if num_tokens <= 128 else 128
    tile = {"BLOCK_M": block_m, "GROUP_M": 1 if block_m == 16 else 8, **KERNELS[kernel]}
    out = fused_moe_mxfp4(
        x, experts["w13"], experts["w2"], weights, ids, experts["w13_scale"],
        experts["w2_scale"], {"w13": tile, "w2": tile}, swiglu_limit=LIMIT,
        small_scales=scales[1] <= 128,
    )  # fmt: skip
    bf16 = fused_moe(x, w13_bf16, w2_bf16, weights, ids, swiglu_limit=LIMIT)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert relative_error(out, ref) <= 1.5 * relative_error(bf16, ref) + 1e-3
    if kernel in SWAPPED:  # the shorter lookup over swapped bytes: the same values, bit for bit
        swapped = fused_moe_mxfp4(
            x, swap_bit_pairs(experts["w13"]), swap_bit_pairs(experts["w2"]), weights, ids,
            experts["w13_scale"], experts["w2_scale"], {"w13": tile, "w2": tile},
            swiglu_limit=LIMIT, small_scales=scales[1] <= 128, bits_swapped=True,
        )  # fmt: skip
        assert torch.equal(swapped, out)


def test_experts_loaded_into_the_gpu_keep_the_kernels_layout_and_run_as_shipped():
    """FusedExperts made on a GPU keeps its packed bytes swapped for the W4A16 kernel as it
    loads them (and keeps them when its kernels are set); the kernel (bf16) and the float32
    reference (float32 activations) read them as the bytes shipped."""
    experts = experts_with_scales(116, 120)
    with torch.device("cuda"):
        layer = FusedExperts(SHAPE.num_experts, SHAPE.hidden, SHAPE.intermediate,
                             weight_format="mxfp4", swiglu_limit=LIMIT)  # fmt: skip
    inter = SHAPE.intermediate
    for e in range(SHAPE.num_experts):
        for part, rows in (("gate", slice(0, inter)), ("up", slice(inter, None))):
            layer.load_expert_weight(e, part, experts["w13"][e, rows].cpu())
            layer.load_expert_weight(e, part, experts["w13_scale"][e, rows].cpu(), True)
        layer.load_expert_weight(e, "down", experts["w2"][e].cpu())
        layer.load_expert_weight(e, "down", experts["w2_scale"][e].cpu(), True)
    assert layer.mxfp4_layout == "swapped"
    assert torch.equal(layer.w13, swap_bit_pairs(experts["w13"]))
    num_tokens = 96
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(num_tokens, SHAPE.hidden, device="cuda", generator=gen).to(torch.bfloat16)
    weights, ids = random_routing(num_tokens, SHAPE, "cuda", seed=5)
    shipped = fused_moe_mxfp4(x, experts["w13"], experts["w2"], weights, ids,
                              experts["w13_scale"], experts["w2_scale"], swiglu_limit=LIMIT,
                              small_scales=True)  # fmt: skip
    assert torch.equal(layer(x, weights, ids), shipped)
    w13_bf16, w2_bf16 = dequantized_bf16(experts)
    ref = float32_reference(x, w13_bf16, w2_bf16, weights, ids, LIMIT)
    torch.testing.assert_close(layer(x.float(), weights, ids), ref, rtol=1e-4, atol=1e-4)
    layer.kernels = DEFAULT_BACKENDS  # as configure_layers sets them: already in its layout
    assert layer.mxfp4_layout == "swapped"
    assert torch.equal(layer(x, weights, ids), shipped)
