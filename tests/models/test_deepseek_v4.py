"""DeepSeek-V4 against transformers, float32: sliding-window, CSA and HCA layers, mHC streams and
a hash-routed MoE layer (TINY_V4: window 8, CSA every 4 tokens with 3 indexer picks, HCA every
8), over the paged cache.

Prompts run from shorter than one compression group (3) to many groups (30), so the window, the
pooled entries and the indexer's choice all decide tokens (checked: a model attending to every
entry gives other ones)."""

import json

import pytest
import torch

from rayinfer.config import ConfigError, ModelConfig
from rayinfer.config_v4 import V4Config
from rayinfer.models.loader import WeightLoadError, load_model
from tests.models.harness import (
    TINY_V4,
    assert_same_greedy,
    load_rayinfer,
    make_prompts,
    make_v4_checkpoint,
    relative_errors,
    run_greedy,
    run_transformers,
)

PROMPT_LENGTHS = (5, 11, 3, 17, 30)
PROMPTS = make_prompts(TINY_V4["vocab_size"], lengths=PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_v4_checkpoint(tmp_path_factory.mktemp("v4"))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' prefill logits and 20 greedy tokens of PROMPTS."""
    return run_transformers(checkpoint, PROMPTS, 20)


def test_prefill_and_greedy_match_transformers(checkpoint, reference):
    model, config = load_rayinfer(checkpoint)
    assert_same_greedy(run_greedy(model, config, PROMPTS, 20), reference)


@pytest.mark.parametrize("chunk_size, block_size", [(4, 3), (3, 8), (5, 2)])
def test_chunked_prefill_and_mixed_batches_match_transformers(
    checkpoint, reference, chunk_size, block_size
):
    # 4-token chunks end where CSA groups end; 3- and 5-token ones cut groups and windows;
    # late joiners share steps with decodes; small blocks spread a window over many blocks
    model, config = load_rayinfer(checkpoint)
    ours = run_greedy(
        model, config, PROMPTS, 20, chunk_size=chunk_size, start_steps=[0, 2, 1, 5, 3],
        block_size=block_size,
    )  # fmt: skip
    assert_same_greedy(ours, reference)


def test_the_pooled_entries_and_the_selection_decide_the_tokens(checkpoint, reference):
    model, config = load_rayinfer(checkpoint)
    for layer in model.layers:
        if layer.attn.indexer is not None:
            layer.attn.indexer.topk = 64  # more than any context has: attend to every entry
    every_entry = run_greedy(model, config, PROMPTS, 20)
    assert every_entry.token_ids != reference.token_ids
    model, config = load_rayinfer(checkpoint)
    for layer in model.layers:
        layer.attn.window = 1_000  # no window: every raw token
    no_window = run_greedy(model, config, PROMPTS, 20)
    assert no_window.token_ids != reference.token_ids


@torch.no_grad()
def test_bf16_prefill_logits_err_no_more_than_transformers_bf16(checkpoint, reference):
    """bf16 (the torch reference ops) against transformers' own bf16, as the GPU tests judge
    (tests/gpu/test_dsa_parity.py): per prompt, rayinfer's median relative error from the
    float32 logits is at most 1.5x (+0.01) transformers'."""
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    model, config = load_rayinfer(checkpoint, dtype=torch.bfloat16)
    ours = run_greedy(model, config, PROMPTS, 1, block_size=4, chunk_size=8).prompt_logits
    for i, prompt in enumerate(PROMPTS):
        expected = reference.prompt_logits[i]
        their_error = relative_errors(theirs(torch.tensor([prompt])).logits[0], expected).median()
        assert relative_errors(ours[i], expected).median() <= 1.5 * their_error + 0.01


def test_layers_cache_rows_and_hash_routing(checkpoint):
    model, config = load_rayinfer(checkpoint)
    kinds = [layer.attn.kind for layer in model.layers]
    assert kinds == TINY_V4["layer_types"]
    assert [layer.ffn.tid2eid is not None for layer in model.layers] == [True, False, False, False]
    v4 = V4Config.from_hf(config.hf)
    # window pool: kv 32 | CSA pool kv and gate 2 x 64 | indexer pool kv and gate 2 x 32
    window = v4.window_row
    assert (window.pool_kv, window.pool_gate, window.index_kv, window.width) == (32, 96, 160, 224)
    assert config.window_row_width == 224 and config.window_span == 8  # window 8, 2 x CSA's 4
    # paged cache: a token's share of its CSA entry (32 / 4), of the indexer's (16 / 4) after it
    entries = v4.entry_row
    assert (entries.entries("compressed_sparse_attention").share, entries.index_col) == (8, 8)
    assert entries.entries("heavily_compressed_attention").share == 4  # 32 / 8
    assert config.kv_shape_per_token(4) == (entries.width,) == (12,)
    assert config.kv_shape_per_token_on_rank(2, 4) == (12,)  # one head: replicated


def _config(**overrides) -> dict:
    from transformers import AutoConfig

    hf = AutoConfig.for_model("deepseek_v4", **TINY_V4).to_dict()
    hf["architectures"] = ["DeepseekV4ForCausalLM"]
    hf.update(overrides)
    return hf


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(layer_types=["sliding_attention"] * 3), "layer_types has 3 entries"),
        (dict(layer_types=["sliding_attention"] * 3 + ["dense"]), "layer_types[3]='dense'"),
        (dict(mlp_layer_types=["moe"] * 3 + ["sparse"]), "mlp_layer_types[3]='sparse'"),
        (dict(compress_rates={"compressed_sparse_attention": 0}), "compress_rates"),
        (dict(index_topk=0), "index_topk"),
        (dict(scoring_func="relu"), "scoring_func"),
        (dict(o_groups=3), "o_groups"),
        (dict(sliding_window=None), "sliding_window"),
    ],
)
def test_a_bad_v4_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        ModelConfig.from_hf_dict(_config(**overrides))


def test_a_missing_or_misshaped_tensor_names_it(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    weights = load_file(checkpoint / "model.safetensors")
    config = json.loads((checkpoint / "config.json").read_text())
    name = "model.layers.1.attn.indexer.compressor.ape"
    for broken, message in (
        ({k: v for k, v in weights.items() if k != name}, "layers.1.attn.indexer.compressor.ape"),
        ({**weights, name: torch.zeros(3, 32)}, name),
    ):
        folder = tmp_path / f"broken{len(broken)}"
        folder.mkdir()
        save_file(broken, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(WeightLoadError, match=message):
            load_model(ModelConfig.from_pretrained(folder), torch.float32)
