"""The weight codecs DeepSeek-V4 checkpoints need, as pure functions: e2m1 nibbles, MXFP4
(packed FP4 + one UE8M0 scale per 32), FP8 blocks with UE8M0 scales, and what config.json
declares. Where transformers has the same code (integrations/finegrained_fp8.py) the results
must be equal to its, bit for bit."""

from types import SimpleNamespace

import pytest
import torch

from rayinfer.config import ConfigError
from rayinfer.models.checkpoint_format import CheckpointFormat, scale_names
from rayinfer.models.fp8 import decode_scales, dequantize_block_fp8, quantize_block_fp8
from rayinfer.models.mxfp4 import (
    E2M1_VALUES,
    check_mxfp4_shapes,
    dequantize_mxfp4,
    quantize_mxfp4,
    unpack_e2m1,
)


def e2m1_from_bits(code: int) -> float:
    """Sign bit 3, exponent bits 2-1 (bias 1, 0 = subnormal), mantissa bit 0."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return sign * magnitude


def random_mxfp4(rows, cols, seed=0):
    generator = torch.Generator().manual_seed(seed)
    packed = torch.randint(-128, 128, (rows, cols // 2), dtype=torch.int8, generator=generator)
    exponents = torch.randint(110, 140, (rows, cols // 32), dtype=torch.uint8, generator=generator)
    return packed, exponents.view(torch.float8_e8m0fnu)


def transformers_dequantize(weight, scale):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(hf_quantizer=None)._dequantize_one(weight, scale, torch.float32)


def test_e2m1_table_is_the_bit_definition_and_transformers_table():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    from transformers.integrations.mxfp4 import FP4_VALUES

    by_bits = [e2m1_from_bits(code) for code in range(16)]
    assert list(E2M1_VALUES) == by_bits == list(Fp8Dequantize._FP4_E2M1_LUT) == FP4_VALUES
    every_byte = torch.arange(256, dtype=torch.uint8)[None]  # [1, 256]
    expected = [[by_bits[b & 0xF], by_bits[b >> 4]] for b in range(256)]
    assert unpack_e2m1(every_byte).tolist() == [sum(expected, [])]  # low nibble first


@pytest.mark.parametrize("shape", [(1, 32), (3, 64), (7, 96), (64, 256), (2, 2048)])
def test_mxfp4_dequantize_equals_transformers(shape):
    packed, scale = random_mxfp4(*shape)
    expected = transformers_dequantize(packed, scale)
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.float32), expected)
    # the same bytes as uint8 and float4_e2m1fn_x2, scales as uint8 exponents
    for weight in (packed.view(torch.uint8), packed.view(torch.float4_e2m1fn_x2)):
        dequantized = dequantize_mxfp4(weight, scale.view(torch.uint8), torch.float32)
        assert torch.equal(dequantized, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantize_is_value_times_power_of_two(dtype):
    packed = torch.tensor([[0x21, 0xF7] + [0] * 14], dtype=torch.uint8)  # 0.5 1, 6 -6, zeros
    scale = torch.tensor([[130]], dtype=torch.uint8)  # 2^3
    expected = torch.tensor([[4.0, 8.0, 48.0, -48.0] + [0.0] * 28], dtype=dtype)
    assert torch.equal(dequantize_mxfp4(packed, scale, dtype), expected)


@pytest.mark.parametrize("shape", [(128, 256), (256, 128), (64, 32), (384, 512)])
def test_fp8_with_ue8m0_scales_equals_transformers(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    quantized, scale = quantize_block_fp8(weight, scale_fmt="ue8m0")
    assert scale.dtype == torch.float8_e8m0fnu
    expected = transformers_dequantize(quantized, scale)
    assert torch.equal(dequantize_block_fp8(quantized, scale, torch.float32), expected)
    as_bytes = scale.view(torch.uint8)
    assert torch.equal(dequantize_block_fp8(quantized, as_bytes, torch.float32), expected)


@pytest.mark.parametrize("shape", [(200, 64), (64, 200), (300, 129), (1, 1)])
def test_fp8_with_ue8m0_scales_in_partial_blocks(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    quantized, scale = quantize_block_fp8(weight, scale_fmt="ue8m0")
    powers = decode_scales(scale)
    assert torch.equal(powers, torch.exp2(torch.log2(powers).round()))  # powers of two
    expected = quantized.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            expected[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= powers[i, j]
    assert torch.equal(dequantize_block_fp8(quantized, scale, torch.float32), expected)
    # a power-of-two scale at most doubles the float scale: e4m3 steps of 2^-3 relative
    subnormal_step = weight.abs().max() / 448 * 2 * 2**-9
    torch.testing.assert_close(expected, weight, atol=subnormal_step, rtol=2**-3)


def test_fp8_ue8m0_quantization_equals_transformers_quantizer():
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    weight = torch.randn(256, 384, generator=torch.Generator().manual_seed(0))
    config = SimpleNamespace(scale_fmt="ue8m0", weight_block_size=(128, 128))
    theirs = Fp8Quantize(SimpleNamespace(quantization_config=config))._quantize_one(
        "w.weight", weight
    )
    quantized, scale = quantize_block_fp8(weight, scale_fmt="ue8m0")
    assert torch.equal(quantized.view(torch.uint8), theirs["w.weight"].view(torch.uint8))
    assert torch.equal(scale.view(torch.uint8), theirs["w.weight_scale_inv"].view(torch.uint8))


def test_mxfp4_quantization_rounds_to_nearest_with_ties_to_even():
    # amax 6 gives scale 1: the midpoints between e2m1 magnitudes go to the even code
    row = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 0.3, 5.1, 100.0 / 17]
    weight = torch.tensor([row + [0.0] * (32 - len(row))])
    packed, scale = quantize_mxfp4(weight)
    assert packed.dtype == torch.int8 and scale.dtype == torch.float8_e8m0fnu
    assert scale.float().item() == 1.0
    expected = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 0.5, 6.0, 6.0]
    assert dequantize_mxfp4(packed, scale, torch.float32)[0, : len(row)].tolist() == expected


def test_mxfp4_quantization_keeps_representable_values_and_bounds_the_rest():
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (8, 64), generator=generator)
    powers = torch.exp2(torch.randint(-8, 8, (8, 2, 1), generator=generator).float())
    values = torch.tensor(E2M1_VALUES)[codes].view(8, 2, 32)
    values[..., 0] = 6.0  # every group's amax is 6 times its power of two
    exact = (values * powers).view(8, 64)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(exact), torch.float32), exact)
    weight = torch.randn(16, 128, generator=generator)
    packed, scale = quantize_mxfp4(weight)
    error = (dequantize_mxfp4(packed, scale, torch.float32) - weight).abs().view(16, 4, 32)
    assert (error <= decode_scales(scale)[..., None]).all()  # half of the widest gap, 4 to 6


def test_mxfp4_shape_errors_name_both_tensors():
    packed, scale = random_mxfp4(4, 64)
    names = ("layers.1.ffn.experts.2.w1.weight", "layers.1.ffn.experts.2.w1.scale")
    with pytest.raises(ValueError, match=r"w1\.weight \(4, 32\).*w1\.scale of shape \(4, 2\).*"
                       r"it has \(4, 3\)"):  # fmt: skip
        check_mxfp4_shapes(packed, torch.zeros(4, 3, dtype=torch.uint8), names)
    with pytest.raises(ValueError, match=r"w1\.weight \(4, 31\).*it has \(4, 2\), which fits"):
        dequantize_mxfp4(packed[:, :31], scale, torch.float32, names)
    with pytest.raises(ValueError, match=r"w1\.scale of shape \(4, 2\).*it has \(3, 2\)"):
        check_mxfp4_shapes(packed, scale[:3], names)


def test_fp8_scale_shape_error_names_both_tensors():
    quantized, scale = quantize_block_fp8(torch.randn(200, 64), scale_fmt="ue8m0")
    names = ("layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale")
    with pytest.raises(ValueError, match=r"wq_a\.scale shape \(1, 1\).*wq_a\.weight \(200, 64\)"
                       r".*expected \(2, 1\)"):  # fmt: skip
        dequantize_block_fp8(quantized, scale[:1], torch.float32, names=names)


V4_FLASH_CONFIG = {  # as deepseek-ai/DeepSeek-V4-Flash's config.json writes them
    "expert_dtype": "fp4",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
}


def test_format_from_config():
    assert CheckpointFormat.from_hf({}) == CheckpointFormat()
    v4 = CheckpointFormat.from_hf(V4_FLASH_CONFIG)
    assert v4 == CheckpointFormat("fp8", block_size=128, scale_fmt="ue8m0", expert_dtype="fp4")
    folded = {
        "quantization_config": {**V4_FLASH_CONFIG["quantization_config"], "expert_dtype": "fp4"}
    }
    assert CheckpointFormat.from_hf(folded) == v4  # transformers moves expert_dtype in there
    v3 = CheckpointFormat.from_hf({"quantization_config": {"quant_method": "fp8"}})
    assert (v3.scale_fmt, v3.expert_dtype) == ("float", "fp8")


@pytest.mark.parametrize(
    "quantization, match",
    [
        ({"quant_method": "awq"}, "quant_method='awq' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [1, 128]}, "weight_block_size"),
        ({"quant_method": "fp8", "scale_fmt": "e5m2"}, "scale_fmt='e5m2'"),
        ({"quant_method": "fp8", "expert_dtype": "int4"}, "expert_dtype='int4'"),
    ],
)
def test_unsupported_format_is_a_config_error_naming_the_key(quantization, match):
    with pytest.raises(ConfigError, match=match):
        CheckpointFormat.from_hf({"quantization_config": quantization})


def test_scales_pair_with_their_weights_in_both_namings():
    names = [
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.up_proj.weight_scale_inv",  # DeepSeek-V3
        "layers.0.attn.wq_a.weight",
        "layers.0.attn.wq_a.scale",  # DeepSeek-V4
        "layers.0.hc_attn_scale",  # mHC, not a weight scale
        "layers.0.attn_norm.weight",
    ]
    assert scale_names(names) == {
        "model.layers.0.mlp.up_proj.weight": "model.layers.0.mlp.up_proj.weight_scale_inv",
        "layers.0.attn.wq_a.weight": "layers.0.attn.wq_a.scale",
    }
