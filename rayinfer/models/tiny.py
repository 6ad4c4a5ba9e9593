"""The built-in model "tiny": a small random DeepSeek-V3 checkpoint written on first use.

`ensure_tiny_model()` writes an HF-format folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json) into the user cache and returns its path; from there
it loads through the same loader as any checkpoint. Everything is derived from fixed seeds without
transformers, so two writes give byte-identical files. Change `TINY_VERSION` whenever the bytes
would change, so that stale caches are never reused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from rayinfer import envs

if TYPE_CHECKING:  # torch is imported where the weights are drawn: finding the folder needs none
    import torch

TINY_VERSION = "v1"
SEED = 1234
WEIGHT_STD = 0.1  # logits std ~1.6: greedy text varies (std 0.02 loops on one token more often)
BIAS_STD = 0.1  # e_score_correction_bias: non-zero, so noaux_tc routing is exercised
VOCAB_SIZE = 1000
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(4)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the farmer watches from the gate.
Once upon a time there was a small village by the river, and every morning the people walked
to the market to sell bread, apples, cheese and fresh fish caught before the sun came up.
A language model reads a sequence of tokens and predicts the next token, one step at a time.
Experts in a mixture of experts layer each see only the tokens that the router sends to them.
The cache keeps the keys and values of earlier tokens, so that decoding a new token is cheap.
She opened the window, looked at the mountains and said that the weather would be fine today.
We measured the throughput in tokens per second and the latency of the first token in seconds.
Hello, how are you? I am fine, thank you. What would you like to talk about this evening?
Please write a short story about a cat who learns to play the piano in a great old house.
The students asked their teacher why the sky is blue, and she explained how light scatters.
Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in text about dates, prices and counts.
Water boils at one hundred degrees, and ice melts when the temperature rises above zero.
The library was quiet; only the sound of pages turning could be heard between the shelves.
He planted tomatoes, beans and carrots in the garden, and watered them every single day.
A good engineer writes small functions, clear names, honest tests and short commit messages.
The train leaves the station at nine o'clock and arrives in the city just before noon.
In the winter the children built a snowman, and in the summer they swam in the cold lake.
Music, painting and poetry help people share what they feel when words alone are not enough.
The server answered every request, streamed the reply, and never kept a client waiting.
Rivers carry sand from the high valleys down to the sea, where waves shape long golden beaches.
Our kitchen smells of coffee, warm butter, cinnamon and oranges on quiet Sunday mornings.
Scientists observed distant galaxies through a powerful telescope built on a desert plateau.
Doctors recommend sleeping eight hours, drinking enough water and walking outdoors regularly.
Yesterday my brother fixed his bicycle, painted the fence, and cooked spicy noodles for dinner.
Birds migrate south each autumn, following coastlines, stars and the magnetic field of Earth.
Computers store information as bits; programs transform inputs into outputs using algorithms.
Grandmother knitted woollen sweaters, scarves and gloves for everybody in our large family.
Thunder rolled across the hills, lightning flashed, and heavy rain drummed against the roof.
Question: which planet is closest to the Sun? Answer: Mercury, followed by Venus and Earth.
Friendly neighbours shared vegetables, borrowed ladders, and helped each other move furniture.
Carefully check every result twice, because small mistakes quickly become expensive problems.
"""


def tiny_config(vocab_size: int = VOCAB_SIZE) -> dict:
    """config.json as transformers 5 writes DeepseekV3Config, plus the classic DeepSeek keys."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "first_k_dense_replace": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "q_lora_rank": 128,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "qk_head_dim": 48,
        "head_dim": 16,
        "v_head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "rope_interleave": True,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "initializer_range": 0.02,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": None,
        "use_cache": True,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE trained on the built-in corpus; adds <|begin_of_text|> like Llama-3."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    bos = SPECIAL_TOKENS[BOS_ID]
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, BOS_ID)]
            ),
        ]
    )
    return tokenizer


def tokenizer_config() -> dict:
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHATML_TEMPLATE,
    }


def generation_config() -> dict:
    return {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "do_sample": False}


def random_weights(config: dict, seed: int = SEED) -> dict[str, torch.Tensor]:
    """Checkpoint tensors with the names transformers 5 `save_pretrained` gives DeepseekV3."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float = WEIGHT_STD) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32) * std

    hidden, vocab = config["hidden_size"], config["vocab_size"]
    weights = {"model.embed_tokens.weight": normal(vocab, hidden, std=1.0)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        weights[f"{prefix}.input_layernorm.weight"] = torch.ones(hidden)
        weights[f"{prefix}.post_attention_layernorm.weight"] = torch.ones(hidden)
        weights.update(_attention_weights(config, f"{prefix}.self_attn", normal))
        weights.update(_mlp_weights(config, layer, f"{prefix}.mlp", normal))
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = normal(vocab, hidden)
    return weights


def _attention_weights(config: dict, prefix: str, normal) -> dict[str, torch.Tensor]:
    import torch

    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    q_rank, kv_rank = config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    return {
        f"{prefix}.q_a_proj.weight": normal(q_rank, hidden),
        f"{prefix}.q_a_layernorm.weight": torch.ones(q_rank),
        f"{prefix}.q_b_proj.weight": normal(heads * (nope + rope), q_rank),
        f"{prefix}.kv_a_proj_with_mqa.weight": normal(kv_rank + rope, hidden),
        f"{prefix}.kv_a_layernorm.weight": torch.ones(kv_rank),
        f"{prefix}.kv_b_proj.weight": normal(heads * (nope + v), kv_rank),
        f"{prefix}.o_proj.weight": normal(hidden, heads * v),
    }


def _mlp_weights(config: dict, layer: int, prefix: str, normal) -> dict[str, torch.Tensor]:
    hidden = config["hidden_size"]
    if layer < config["first_k_dense_replace"]:
        return _ffn_weights(prefix, hidden, config["intermediate_size"], normal)
    num_experts, inter = config["n_routed_experts"], config["moe_intermediate_size"]
    weights = {
        f"{prefix}.gate.weight": normal(num_experts, hidden),
        f"{prefix}.gate.e_score_correction_bias": normal(num_experts, std=BIAS_STD),
    }
    for expert in range(num_experts):
        weights.update(_ffn_weights(f"{prefix}.experts.{expert}", hidden, inter, normal))
    shared_inter = inter * config["n_shared_experts"]
    weights.update(_ffn_weights(f"{prefix}.shared_experts", hidden, shared_inter, normal))
    return weights


def _ffn_weights(prefix: str, hidden: int, inter: int, normal) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.gate_proj.weight": normal(inter, hidden),
        f"{prefix}.up_proj.weight": normal(inter, hidden),
        f"{prefix}.down_proj.weight": normal(hidden, inter),
    }


def write_tiny_model(folder: str | Path) -> None:
    from safetensors.torch import save_file

    """Write every file of the tiny checkpoint into `folder` (which must exist)."""
    folder = Path(folder)
    tokenizer = build_tokenizer()
    config = tiny_config(vocab_size=tokenizer.get_vocab_size(with_added_tokens=True))
    tokenizer.save(str(folder / "tokenizer.json"))
    _write_json(folder / "config.json", config)
    _write_json(folder / "tokenizer_config.json", tokenizer_config())
    _write_json(folder / "generation_config.json", generation_config())
    save_file(random_weights(config), str(folder / "model.safetensors"), metadata={"format": "pt"})
    for path in folder.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; the cache may be shared


def tiny_model_dir() -> Path:
    """`$RAYINFER_CACHE/tiny-<version>`, or `~/.cache/rayinfer/tiny-<version>`."""
    return envs.cache_dir() / f"tiny-{TINY_VERSION}"


def ensure_tiny_model() -> Path:
    """The tiny checkpoint's folder, written on first use.

    Files go into a temporary folder beside the target that is renamed into place, so a reader never
    sees a half-written checkpoint and concurrent first uses are safe: one rename wins, the others
    discard their copy.
    """
    target = tiny_model_dir()
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)
    try:
        write_tiny_model(staging)
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
