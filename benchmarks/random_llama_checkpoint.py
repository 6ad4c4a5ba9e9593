"""A Llama-shaped checkpoint with random bf16 weights and the built-in tiny tokenizer (1,000
tokens), saved by transformers: the folder both `transformers serve` and rayinfer load for the
side-by-side of issue 28 (transformers' continuous batching does not run DeepSeek's MLA).

    python benchmarks/random_llama_checkpoint.py /tmp/llama-1b-random
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rayinfer.engine.model_source import resolve_model_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    config = LlamaConfig(
        vocab_size=1000, hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden_size // 128,
        num_key_value_heads=max(1, args.hidden_size // 512), max_position_embeddings=8192,
        torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(args.out)
    tiny = resolve_model_path("tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, args.out / name)
    print(f"{args.out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")


if __name__ == "__main__":
    main()
