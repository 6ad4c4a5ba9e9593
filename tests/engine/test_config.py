"""ModelConfig from config.json: supported families, the values each reads, clear refusals."""

import json
from pathlib import Path

import pytest

from rayinfer.config import SUPPORTED_ARCHITECTURES, ConfigError, ModelConfig, ParallelPlan

V2_LITE = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "deepseek-v2-lite"


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError) as error:
        ModelConfig.from_pretrained(tmp_path)
    assert "GPT2LMHeadModel" in str(error.value)
    assert all(name in str(error.value) for name in SUPPORTED_ARCHITECTURES)


def test_folder_without_config_json_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)


def test_mla_caches_the_latent_and_gqa_caches_heads():
    deepseek = ModelConfig.from_pretrained(V2_LITE)
    assert deepseek.kv_shape_per_token(2) == (512 + 64,)
    assert deepseek.kv_bytes_per_token(2) == 27 * 576 * 2
    assert deepseek.kv_shape_per_token_on_rank(4, 2) == (576,)  # replicated on every TP rank
    llama = ModelConfig.from_hf_dict(
        dict(
            architectures=["LlamaForCausalLM"],
            vocab_size=100,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=96,
        )
    )
    assert llama.kv_shape_per_token(2) == (2, 4, 8)
    assert llama.kv_shape_per_token_on_rank(2, 2) == (2, 2, 8)


def test_parallel_plan_checks_its_own_sizes():
    assert ParallelPlan(tp=2, dp=2, ep=4).num_workers == 4
    with pytest.raises(ConfigError, match="tp=0"):
        ParallelPlan(tp=0)
    with pytest.raises(ConfigError, match=r"valid ep: \[1, 2, 4\]"):
        ParallelPlan(tp=4, ep=3)
