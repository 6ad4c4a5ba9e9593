"""The requests a serving benchmark sends: random lengths (vllm bench's random dataset) or the
first exchange of each ShareGPT conversation. `bench serve` and `bench throughput` build them
from the same flags and seed, so the offline engine and the server see the same prompts.

Lengths are in tokens where a tokenizer is at hand (`--tokenizer`, or `--model` when it names
'tiny' or a local folder): random prompts are then token ids drawn uniformly from the vocabulary
(special tokens left out), exact in length, or, for an endpoint that takes only text, random
words cut at the length by that tokenizer. Without one, a random prompt is random words, as many
as the length times the server's words per token (measured on the warm-up request), and a
ShareGPT text counts one token per 4 characters (OpenAI's rule of thumb for English).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

WORDS = (
    "river mountain garden window teacher market bread apple cheese music letter light engine "
    "cloud winter summer forest library station train city ocean silver paper story number "
    "people morning evening kitchen coffee butter orange planet galaxy telescope desert village"
).split()
CHARS_PER_TOKEN = 4  # without a tokenizer: a ShareGPT text's token count is its length / 4


@dataclass(frozen=True)
class SampleRequest:
    prompt: str | list[int]  # text, or token ids
    prompt_len: int  # tokens: exact from token ids, else the client's estimate
    output_len: int  # tokens to generate (ignore_eos)


def add_dataset_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", choices=["random", "sharegpt"], default="random")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128, help="random: tokens per prompt")
    parser.add_argument("--output-len", type=int, default=32, help="random: tokens per reply")
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random: lengths drawn uniformly from [len*(1-r), len*(1+r)], 0 <= r < 1",
    )
    parser.add_argument(
        "--sharegpt-output-len", type=int, default=None, help="default: each reply's own length"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer", default=None, help="'tiny' or a tokenizer.json folder (default: --model)"
    )


def check_dataset_args(args) -> None:
    if not 0 <= args.range_ratio < 1:
        raise SystemExit(f"--range-ratio={args.range_ratio} must lie in [0, 1)")
    if args.dataset == "sharegpt" and not args.dataset_path:
        raise SystemExit("--dataset sharegpt needs --dataset-path FILE.json")


def load_tokenizer(name: str | None):
    """rayinfer's Tokenizer for 'tiny' or a local checkpoint folder; None for anything else
    (a hub name, a server-side path that is not here)."""
    from rayinfer.engine.tokenizer import Tokenizer, TokenizerError

    if name is None or (name != "tiny" and not (Path(name) / "tokenizer.json").is_file()):
        return None
    if name == "tiny":
        from rayinfer.engine.model_source import resolve_model_path

        name = str(resolve_model_path("tiny"))
    try:
        return Tokenizer.from_pretrained(name)
    except (TokenizerError, OSError):
        return None


def sample_length(rng: random.Random, length: int, range_ratio: float) -> int:
    """Uniform over [length*(1-r), length*(1+r)] (both ends included), at least 1."""
    low = max(int(length * (1 - range_ratio)), 1)
    return rng.randint(low, max(int(length * (1 + range_ratio)), low))


def random_requests(
    args, seed: int, tokenizer=None, as_text: bool = False, words_per_token: float = 1.0
) -> list[SampleRequest]:
    """as_text: the endpoint takes text only (chat, or a server without token-id prompts)."""
    rng = random.Random(seed)
    lengths = [
        (sample_length(rng, args.input_len, args.range_ratio),
         sample_length(rng, args.output_len, args.range_ratio))
        for _ in range(args.num_prompts)
    ]  # fmt: skip
    if tokenizer is not None and not as_text:
        special = tokenizer.all_special_ids
        vocab = [i for i in range(tokenizer.vocab_size) if i not in special]
        return [SampleRequest(rng.choices(vocab, k=n), n, m) for n, m in lengths]
    requests = []
    for num_tokens, output_len in lengths:
        num_words = max(1, round(num_tokens * words_per_token))
        text = " ".join(rng.choices(WORDS, k=num_words))
        if tokenizer is not None:  # cut at num_tokens (each word is at least one token)
            text = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:num_tokens])
        requests.append(SampleRequest(text, num_tokens, output_len))
    return requests


def first_exchange(conversation: dict) -> tuple[str, str] | None:
    """The first human turn and the gpt reply after it, or None."""
    turns = conversation.get("conversations") or []
    for turn, reply in zip(turns, turns[1:]):
        if turn.get("from") == "human" and reply.get("from") == "gpt":
            return turn.get("value") or "", reply.get("value") or ""
    return None


def count_tokens(text: str, tokenizer) -> int:
    if tokenizer is None:
        return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))
    return len(tokenizer.encode(text, add_special_tokens=False))


def sharegpt_requests(args, seed: int, tokenizer=None) -> list[SampleRequest]:
    """--num-prompts exchanges drawn with the seed; those under 4 tokens either way are skipped
    (as vllm bench does)."""
    with open(args.dataset_path) as file:
        exchanges = [pair for c in json.load(file) if (pair := first_exchange(c)) is not None]
    random.Random(seed).shuffle(exchanges)
    requests = []
    for prompt, reply in exchanges:
        prompt_len = count_tokens(prompt, tokenizer)
        output_len = args.sharegpt_output_len or count_tokens(reply, tokenizer)
        if prompt_len >= 4 and output_len >= 4:
            requests.append(SampleRequest(prompt, prompt_len, output_len))
        if len(requests) == args.num_prompts:
            return requests
    raise SystemExit(
        f"{args.dataset_path} has {len(requests)} usable conversations (a human turn then a gpt "
        f"reply, 4 tokens or more each); ask for --num-prompts <= {len(requests)}"
    )


def build_requests(args, seed: int, tokenizer=None, as_text=False, words_per_token=1.0):
    if args.dataset == "sharegpt":
        return sharegpt_requests(args, seed, tokenizer)
    return random_requests(args, seed, tokenizer, as_text, words_per_token)
