"""The W4A8 MXFP4 fused MoE on a GPU with FP8 tensor cores: its PTX lookup makes the same e4m3
bytes as the integer arithmetic the interpreter tests check (outputs bit-identical), and both
match float32 over the dequantized experts with activations quantized as the kernel quantizes
them, at 1 to 600 tokens (row tiles of 16 and 64).

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/gpu/test_mxfp4_w4a8.py
"""

import pytest
import torch

from rayinfer.bench.moe_cases import MoeShape, random_routing
from rayinfer.kernels.backends import KernelBackends
from rayinfer.kernels.moe.fused_moe import fused_moe_fp8_reference
from rayinfer.kernels.moe.fused_moe_mxfp4 import dequantize_mxfp4_reference
from rayinfer.kernels.moe.fused_moe_mxfp4_w4a8 import fits_w4a8, fused_moe_mxfp4_w4a8, to_octets
from rayinfer.layers.fused_experts import FusedExperts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA GPU with FP8 tensor cores (sm_89+)",
    ),
]

SHAPE = MoeShape(num_experts=16, hidden=1024, intermediate=512, top_k=6)
LIMIT = 10.0
TILES = {
    16: {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4,
         "num_stages": 3},
    64: {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4,
         "num_stages": 3},
}  # fmt: skip


def _experts(gen):
    e, h, i = SHAPE.num_experts, SHAPE.hidden, SHAPE.intermediate

    def part(rows, cols):
        packed = torch.randint(0, 256, (e, rows, cols // 2), generator=gen, device="cuda")
        scale = torch.randint(112, 124, (e, rows, cols // 32), generator=gen, device="cuda")
        return packed.to(torch.uint8), scale.to(torch.uint8)

    return part(2 * i, h) + part(h, i)


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("num_tokens", [1, 128, 600])
def test_the_lookup_matches_integer_bits_and_float32(num_tokens, block_m):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens + block_m)
    w13, w13_scale, w2, w2_scale = _experts(gen)
    assert fits_w4a8(w13_scale, w2_scale)
    x = torch.randn(num_tokens, SHAPE.hidden, device="cuda", generator=gen)
    weights, ids = random_routing(num_tokens, SHAPE, "cuda", seed=num_tokens)
    config = {"w13": TILES[block_m], "w2": TILES[block_m]}
    args = (to_octets(w13), to_octets(w2), weights, ids, w13_scale, w2_scale, config)
    out = fused_moe_mxfp4_w4a8(x, *args, swiglu_limit=LIMIT)
    exact = fused_moe_mxfp4_w4a8(x, *args, swiglu_limit=LIMIT, exact_bits=True)
    assert torch.equal(out, exact)
    w13_full = dequantize_mxfp4_reference(w13, w13_scale)
    w2_full = dequantize_mxfp4_reference(w2, w2_scale)
    ones = lambda w: torch.ones(w.shape[0], w.shape[1] // 128, w.shape[2] // 128,  # noqa: E731
                                device="cuda")  # fmt: skip
    expected = fused_moe_fp8_reference(x, w13_full, w2_full, weights, ids, ones(w13_full),
                                       ones(w2_full), LIMIT)  # fmt: skip
    scale = expected.abs().max().item()
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3 * scale)
    bf16 = fused_moe_mxfp4_w4a8(x.bfloat16(), *args, swiglu_limit=LIMIT)
    assert bf16.dtype == torch.bfloat16
    assert (bf16.float() - expected).norm() / expected.norm() < 2e-2


def test_experts_asked_for_w4a8_keep_octets_and_run_the_w4a8_kernel():
    gen = torch.Generator(device="cuda").manual_seed(11)
    w13, w13_scale, w2, w2_scale = _experts(gen)
    with torch.device("cuda"):
        layer = FusedExperts(SHAPE.num_experts, SHAPE.hidden, SHAPE.intermediate,
                             weight_format="mxfp4", swiglu_limit=LIMIT)  # fmt: skip
    for name, t in (("w13", w13), ("w2", w2), ("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        getattr(layer, name).data.copy_(t)
    layer.mxfp4_layout = "shipped"  # copied in as shipped, past load_expert_weight
    layer.kernels = KernelBackends(mxfp4_moe="w4a8")
    assert layer.mxfp4_layout == "octets" and torch.equal(layer.w13, to_octets(w13))
    x = torch.randn(64, SHAPE.hidden, device="cuda", generator=gen).bfloat16()
    weights, ids = random_routing(64, SHAPE, "cuda", seed=3)
    direct = fused_moe_mxfp4_w4a8(x, layer.w13, layer.w2, weights, ids, w13_scale, w2_scale,
                                  swiglu_limit=LIMIT)  # fmt: skip
    assert torch.equal(layer(x, weights, ids), direct)
    layer.kernels = KernelBackends()  # auto: W4A16 over swapped bit pairs
    assert layer.mxfp4_layout == "swapped"
    assert (layer(x, weights, ids).float() - direct.float()).norm() / direct.float().norm() < 3e-2
