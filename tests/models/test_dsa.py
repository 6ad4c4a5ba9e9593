"""DeepSeek-V3.2 and GLM-5 (MLA + DeepSeek Sparse Attention) against transformers, float32.

index_topk (6) is below most prompts' lengths, so the indexer's choice decides the tokens: a
model attending densely gives other ones (checked). The indexer is wide (16 heads), so that ReLU
scores rarely tie at zero. V3.2 has group-limited routing and a non-zero correction bias; GLM
has full and shared indexer layers.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rayinfer.config import ConfigError, ModelConfig
from rayinfer.models.loader import load_model
from tests.models.harness import (
    DSA_FAMILIES,
    TINY_DSA,
    assert_same_greedy,
    load_rayinfer,
    make_dsa_checkpoint,
    make_prompts,
    run_greedy,
    run_transformers,
)

CASES = {"v32-grouped": "deepseek_v32", "glm-shared": "glm_moe_dsa"}
PROMPT_LENGTHS = (5, 11, 3, 17)  # shorter and longer than index_topk


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    model_type = CASES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    return make_dsa_checkpoint(folder, model_type, **DSA_FAMILIES[model_type])


PROMPTS = make_prompts(TINY_DSA["vocab_size"], lengths=PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' prefill logits and 20 greedy tokens of PROMPTS."""
    return run_transformers(checkpoint, PROMPTS, 20)


def test_prefill_and_greedy_match_transformers(checkpoint, reference):
    model, config = load_rayinfer(checkpoint)
    assert_same_greedy(run_greedy(model, config, PROMPTS, 20), reference)


def test_chunked_prefill_and_mixed_batches_match_transformers(checkpoint, reference):
    # 3-token chunks: a chunk boundary falls inside the selection; late joiners share steps
    # with decodes; block size 3 puts the selected tokens on many blocks.
    model, config = load_rayinfer(checkpoint)
    ours = run_greedy(
        model, config, PROMPTS, 20, chunk_size=3, start_steps=[0, 2, 1, 5], block_size=3
    )
    assert_same_greedy(ours, reference)


def test_the_selection_decides_the_tokens(checkpoint, reference):
    model, config = load_rayinfer(checkpoint)
    for layer in model.model.layers:
        layer.self_attn.index_topk = 64  # more than any context: every query attends to all
    dense = run_greedy(model, config, PROMPTS, 20)
    long_prompts = [i for i, n in enumerate(PROMPT_LENGTHS) if n + 20 > TINY_DSA["index_topk"]]
    assert any(dense.token_ids[i] != reference.token_ids[i] for i in long_prompts)


def test_indexer_layers_and_cache_rows(checkpoint):
    model, config = load_rayinfer(checkpoint)
    kinds = config.indexer_types
    assert [layer.self_attn.indexer is not None for layer in model.model.layers] == [
        kind == "full" for kind in kinds
    ]
    # a row of a layer that runs the indexer: latent, rope key, indexer key; a "shared"
    # layer's: latent and rope key (a hand-off carries the widest for every layer)
    assert config.kv_shape_per_token(4) == (16 + 8 + 16,)
    widths = [40 if kind == "full" else 24 for kind in kinds]
    assert config.kv_shapes_per_layer(4) == tuple((w,) for w in widths)
    assert config.kv_bytes_per_token(2) == sum(widths) * 2
    assert model.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32


def test_glm5_dims_build_and_count_their_cache_bytes():
    # GLM-5's attention dims (qk_nope 192, v 256, q_lora 2048, kv_lora 512, rope 64, 32
    # indexer heads of 128) on a 2-layer model: 512 + 64 + 128 values per token in the full
    # indexer layer, 512 + 64 in the shared one
    hf = dict(
        architectures=["GlmMoeDsaForCausalLM"], vocab_size=64, hidden_size=64,
        intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=2048, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=4,
        num_experts_per_tok=2, index_topk=2048, index_head_dim=128, index_n_heads=32,
        indexer_types=["full", "shared"], mlp_layer_types=["dense", "sparse"],
    )  # fmt: skip
    config = ModelConfig.from_hf_dict(hf)
    assert config.kv_shape_per_token(2) == (704,)
    assert config.kv_bytes_per_token(2) == (704 + 576) * 2
    assert [config.is_moe_layer(i) for i in range(2)] == [False, True]


@pytest.mark.parametrize(
    "indexer_types, message",
    [
        (["full", "shared"], r"indexer_types has 2 entries; it needs one per layer"),
        (["full", "sparse", "full"], r"indexer_types\[1\]='sparse' is unknown.*full, shared"),
        (["shared", "full", "full"], r"indexer_types\[0\] must be 'full'"),
    ],
)
def test_bad_indexer_types_fail_naming_the_key(indexer_types, message):
    hf = dict(TINY_DSA, architectures=["GlmMoeDsaForCausalLM"], indexer_types=indexer_types)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(hf)


def test_missing_indexer_sizes_fail_naming_the_key():
    hf = dict(TINY_DSA, architectures=["DeepseekV32ForCausalLM"])
    del hf["index_head_dim"]
    with pytest.raises(ConfigError, match="index_head_dim=None must be a positive integer"):
        ModelConfig.from_hf_dict(hf)
    hf = dict(TINY_DSA, architectures=["DeepseekV32ForCausalLM"], q_lora_rank=None)
    with pytest.raises(ConfigError, match="q_lora_rank must be set"):
        ModelConfig.from_hf_dict(hf)


def _rewritten(checkpoint: Path, folder: Path, change) -> ModelConfig:
    """A copy of the checkpoint whose tensors `change` edited in place (a dict)."""
    state = load_file(checkpoint / "model.safetensors")
    change(state)
    folder.mkdir()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text((checkpoint / "config.json").read_text())
    return ModelConfig.from_pretrained(folder)


def test_missing_or_misshaped_indexer_tensors_fail_naming_the_tensor(checkpoint, tmp_path):
    name = "model.layers.0.self_attn.indexer.wk.weight"
    config = _rewritten(checkpoint, tmp_path / "missing", lambda state: state.pop(name))
    with pytest.raises(ValueError, match=name):
        load_model(config, torch.float32)

    def misshape(state):
        state[name] = torch.zeros(3, state[name].shape[1])

    config = _rewritten(checkpoint, tmp_path / "misshaped", misshape)
    with pytest.raises(ValueError, match=rf"{name}.*checkpoint shape \(3, 64\)"):
        load_model(config, torch.float32)


def test_config_json_names_the_families(checkpoint):
    hf = json.loads((checkpoint / "config.json").read_text())
    assert hf["architectures"][0] in ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")


def test_fp8_checkpoint_loads_like_its_dequantized_twin(tmp_path):
    """DeepSeek-V3.2 as shipped: decoder linears (the indexer's included) in float8_e4m3fn with
    128x128 block scales. Dequantized at load, it equals a checkpoint of the dequantized values;
    with fp8_weights=True the attention projections stay FP8 and it still generates."""
    import rayinfer
    from rayinfer.models.fp8 import dequantize_block_fp8
    from tests.models.test_fp8_weights import FP8_SHAPES, quantize_like_deepseek_v3
    from tests.models.test_loader import rewrite_checkpoint

    shapes = dict(FP8_SHAPES, n_group=4, topk_group=2, index_head_dim=64)
    source = make_dsa_checkpoint(tmp_path / "bf16", "deepseek_v32", **shapes)
    fp8 = rewrite_checkpoint(source, tmp_path / "fp8", quantize_like_deepseek_v3)

    def dequantize(tensors):
        out = {}
        for name, tensor in tensors.items():
            if name.endswith("_scale_inv"):
                continue
            scale = tensors.get(name + "_scale_inv")
            if scale is not None:
                tensor = dequantize_block_fp8(tensor, scale, torch.float32)
            out[name] = tensor
        return out

    twin = rewrite_checkpoint(fp8, tmp_path / "twin", dequantize)
    stored = load_file(fp8 / "model.safetensors")
    assert stored["model.layers.0.self_attn.indexer.wq_b.weight"].dtype == torch.float8_e4m3fn
    model, config = load_rayinfer(fp8)
    twin_model, _ = load_rayinfer(twin)
    prompts = make_prompts(config.vocab_size, lengths=(9, 14))
    ours, theirs = run_greedy(model, config, prompts, 8), run_greedy(twin_model, config, prompts, 8)
    assert ours.token_ids == theirs.token_ids
    for mine, other in zip(ours.prompt_logits, theirs.prompt_logits):
        torch.testing.assert_close(mine, other, rtol=0, atol=0)
    llm = rayinfer.LLM(str(fp8), device="cpu", fp8_weights=True, max_model_len=64)
    layer = llm.engine.executor.runner.model.model.layers[1]
    assert layer.self_attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    params = rayinfer.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert len(llm.generate([list(range(2, 20))], params)[0].token_ids) == 12
