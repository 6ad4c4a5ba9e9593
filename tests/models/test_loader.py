"""The safetensors loader: shards, tied embeddings, dtype casting, FP8 block-scaled weights and
errors that name the offending checkpoint tensor."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rayinfer.config import ModelConfig
from rayinfer.models.fp8 import dequantize_block_fp8, quantize_block_fp8
from rayinfer.models.loader import WeightLoadError, load_model
from tests.models.harness import TINY_DENSE, make_hf_checkpoint

MIXTRAL = dict(TINY_DENSE, num_local_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    # intermediate 200: FP8 blocks that are partly filled along both axes
    config = dict(TINY_DENSE, intermediate_size=200)
    return make_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", **config)


def load(path, dtype=torch.float32):
    return load_model(ModelConfig.from_pretrained(path), dtype, "cpu")


def rewrite_checkpoint(source, target, edit):
    """Copy a single-file checkpoint folder, passing its tensors dict through `edit`."""
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    tensors = edit(load_file(source / "model.safetensors"))
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def assert_same_parameters(model, other):
    other_params = dict(other.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, other_params[name]), name


def test_sharded_checkpoint_loads_like_single_file(llama_path, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32)
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2
    assert_same_parameters(load(tmp_path), load(llama_path))


def test_tied_embeddings_share_the_embedding(tmp_path):
    path = make_hf_checkpoint(tmp_path / "tied", "llama", **TINY_DENSE, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = load(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hidden = torch.randn(3, TINY_DENSE["hidden_size"])
    expected = hidden @ load_file(path / "model.safetensors")["model.embed_tokens.weight"].t()
    torch.testing.assert_close(model.compute_logits(hidden), expected)


def test_casts_to_the_requested_dtype(llama_path):
    model = load(llama_path, torch.bfloat16)
    tensors = load_file(llama_path / "model.safetensors")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    embed = model.model.embed_tokens.weight
    assert torch.equal(embed, tensors["model.embed_tokens.weight"].to(torch.bfloat16))


@pytest.mark.parametrize("shape", [(128, 256), (200, 64), (64, 200), (1, 1), (300, 129)])
def test_fp8_dequantize_matches_blockwise_float_reference(shape):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    quantized, scale_inv = quantize_block_fp8(weight)
    assert scale_inv.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    expected = quantized.float()
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            expected[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= scale_inv[i, j]
    assert torch.equal(dequantize_block_fp8(quantized, scale_inv, torch.float32), expected)
    # e4m3 rounds normal values within 2^-4 relative, subnormals within 2^-10 of the block scale
    subnormal_step = weight.abs().max() / torch.finfo(torch.float8_e4m3fn).max * 2**-9
    torch.testing.assert_close(expected, weight, atol=subnormal_step, rtol=2**-4)


def quantize_linear_weights(tensors):
    """DeepSeek-V3 layout: every decoder-layer linear weight in FP8 plus its block scales."""
    out = {}
    for name, tensor in tensors.items():
        if ".layers." in name and name.endswith("proj.weight"):
            out[name], out[name + "_scale_inv"] = quantize_block_fp8(tensor)
        else:
            out[name] = tensor
    return out


def test_fp8_checkpoint_loads_dequantized(llama_path, tmp_path):
    fp8_path = rewrite_checkpoint(llama_path, tmp_path / "fp8", quantize_linear_weights)
    model = load(fp8_path)
    float_model = load(llama_path)
    fp8_tensors = load_file(fp8_path / "model.safetensors")
    up = "model.layers.1.mlp.up_proj.weight"
    assert fp8_tensors[up].dtype == torch.float8_e4m3fn
    loaded_up = model.model.layers[1].mlp.gate_up_proj.weight[200:]
    expected_up = dequantize_block_fp8(
        fp8_tensors[up], fp8_tensors[up + "_scale_inv"], torch.float32
    )
    assert torch.equal(loaded_up, expected_up)
    for name, param in float_model.named_parameters():
        fp8_param = dict(model.named_parameters())[name]
        torch.testing.assert_close(fp8_param, param, atol=1e-5, rtol=2**-4, msg=name)


@pytest.mark.parametrize(
    "model_type,config,missing",
    [
        ("llama", TINY_DENSE, "model.layers.1.self_attn.k_proj.weight"),
        ("llama", TINY_DENSE, "lm_head.weight"),
        ("mixtral", MIXTRAL, "model.layers.0.block_sparse_moe.experts.3.w2.weight"),
    ],
)
def test_missing_tensor_error_names_it(tmp_path, model_type, config, missing):
    path = make_hf_checkpoint(tmp_path / "full", model_type, **config)
    drop = lambda tensors: {n: t for n, t in tensors.items() if n != missing}
    broken = rewrite_checkpoint(path, tmp_path / "broken", drop)
    with pytest.raises(WeightLoadError, match=f"missing tensor.*{missing}"):
        load(broken)


def test_misshaped_tensor_error_names_it(llama_path, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    widen = lambda tensors: {**tensors, name: torch.zeros(201, TINY_DENSE["hidden_size"])}
    broken = rewrite_checkpoint(llama_path, tmp_path / "broken", widen)
    with pytest.raises(WeightLoadError, match=rf"{name}.*\(201, 64\)"):
        load(broken)


def test_folder_without_weights_is_an_error(llama_path, tmp_path):
    (tmp_path / "config.json").write_text((llama_path / "config.json").read_text())
    with pytest.raises(WeightLoadError, match="model.safetensors"):
        load(tmp_path)


def test_float32_parameters_keep_checkpoint_precision_in_bfloat16_models(tmp_path):
    from rayinfer.models.tiny import write_tiny_model

    write_tiny_model(tmp_path)  # DeepSeek-V3 layout with an expert correction bias
    model = load(tmp_path, torch.bfloat16)
    tensors = load_file(tmp_path / "model.safetensors")
    biases = {n: t for n, t in tensors.items() if n.endswith("e_score_correction_bias")}
    assert biases
    params = dict(model.named_parameters())
    for name, bias in biases.items():
        assert params[name].dtype == torch.float32
        assert not torch.equal(bias.to(torch.bfloat16).float(), bias), "bias must need float32"
        assert torch.equal(params[name], bias), name


def test_unknown_tensor_error_names_it(llama_path, tmp_path):
    name = "model.layers.0.self_attn.rotary_proj.weight"
    extra = lambda tensors: {**tensors, name: torch.zeros(4, 4)}
    broken = rewrite_checkpoint(llama_path, tmp_path / "broken", extra)
    with pytest.raises(WeightLoadError, match=f"{name}.*matches no parameter"):
        load(broken)
