"""The built-in "tiny" checkpoint: deterministic bytes, transformers 5 format, varied output."""

import hashlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import rayinfer
from rayinfer.config import ModelConfig
from rayinfer.engine.tokenizer import Tokenizer
from rayinfer.models.tiny import TINY_VERSION, ensure_tiny_model

transformers = pytest.importorskip("transformers")

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}
PROMPTS = ["The quick brown fox", "Hello, how are you?", "Water boils at"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAYINFER_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield ensure_tiny_model()


def file_hashes(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_two_writes_are_byte_identical(tiny_dir, tmp_path):
    """Written again in a fresh process (its own hash seeds, threads and RNG state)."""
    code = f"from rayinfer.models.tiny import write_tiny_model; write_tiny_model({str(tmp_path)!r})"
    repo_root = Path(rayinfer.__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], cwd=repo_root, check=True)
    assert set(file_hashes(tmp_path)) == EXPECTED_FILES
    assert file_hashes(tmp_path) == file_hashes(tiny_dir)


def test_concurrent_first_use_gives_one_complete_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYINFER_CACHE", str(tmp_path))
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = list(pool.map(lambda _: ensure_tiny_model(), range(3)))
    assert paths == [tmp_path / f"tiny-{TINY_VERSION}"] * 3
    assert [p.name for p in tmp_path.iterdir()] == [f"tiny-{TINY_VERSION}"]  # no staging left
    assert set(file_hashes(paths[0])) == EXPECTED_FILES
    mtime = (paths[0] / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model() == paths[0]  # cached: not written again
    assert (paths[0] / "model.safetensors").stat().st_mtime_ns == mtime


def test_checkpoint_names_and_shapes_match_transformers_save_pretrained(tiny_dir, tmp_path):
    hf_config = transformers.AutoConfig.from_pretrained(tiny_dir)
    transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(tmp_path)
    assert shapes(tiny_dir / "model.safetensors") == shapes(tmp_path / "model.safetensors")


def shapes(path) -> dict[str, tuple[int, ...]]:
    with safe_open(path, "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}


def test_transformers_loads_it_and_greedy_text_varies(tiny_dir):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        assert ids == hf_tokenizer.encode(prompt) and ids[0] == 0  # <|begin_of_text|>
        output = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        new_ids = output[0, len(ids) :].tolist()
        assert len(set(new_ids)) >= 5, (prompt, new_ids)


def test_model_config_and_tokenizer_read_it(tiny_dir):
    config = ModelConfig.from_pretrained(tiny_dir)
    assert config.architecture == "DeepseekV3ForCausalLM" and config.is_mla and config.is_moe
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (4, 256, 1000)
    assert (config.num_experts, config.num_experts_per_tok, config.num_shared_experts) == (8, 2, 1)
    assert config.kv_shape_per_token(4) == (64 + 16,)
    assert config.hf["first_k_dense_replace"] == 1 and config.hf["n_group"] == 2
    assert config.torch_dtype == "float32" and config.rope_scaling is None
    tokenizer = Tokenizer.from_pretrained(tiny_dir)
    assert tokenizer.vocab_size == config.vocab_size
    assert tokenizer.eos_token_ids == {1, 3}  # <|end_of_text|>, <|im_end|>
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode_chat([{"role": "user", "content": "Hi"}])[0] == 2  # <|im_start|>
