"""Token-mask time per generated token of the two grammar libraries, xgrammar and llguidance,
for one JSON schema, on the CPU: the number rayinfer's choice of library rests on; and
"xgrammar+utf8", xgrammar's mask narrowed to the tokens that keep the output valid UTF-8 as
rayinfer's runner does (workers/runner/utf8_tails.py).

Each library's matcher is driven from its own masks (a seeded pick among the allowed tokens)
until the grammar ends or 256 tokens; the time of the mask computation alone is summed and
divided by the tokens. Vocabularies: the tiny model's (1,000 tokens) and any tokenizer.json
given with --tokenizer (a 100k-token byte-level BPE trained offline was used for RESULTS.md).

    pip install xgrammar llguidance
    python benchmarks/grammar_backends.py [--tokenizer path/to/tokenizer.json] [--runs 10]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
MAX_TOKENS = 256


def allowed_ids(bitmask: torch.Tensor, vocab_size: int) -> list[int]:
    bits = (bitmask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    return bits.flatten()[:vocab_size].nonzero().flatten().tolist()


def run_llguidance(tokenizer_json: str, eos_id: int, vocab_size: int, runs: int) -> dict:
    import llguidance
    import llguidance.torch as llg_torch

    start = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_id)
    setup_s = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}
    )
    bitmask = llg_torch.allocate_token_bitmask(1, vocab_size)

    def new_matcher():
        return llguidance.LLMatcher(tokenizer, grammar)

    def fill(matcher):
        llg_torch.fill_next_token_bitmask(matcher, bitmask, 0)

    def accept(matcher, token):
        assert matcher.consume_token(token), matcher.get_error()

    result = _drive(new_matcher, fill, accept, bitmask, vocab_size, eos_id, runs,
                    lambda m: m.is_stopped())  # fmt: skip
    # llguidance compiles lazily, inside the first mask (first_mask_ms)
    return {"setup_s": setup_s, "compile_ms": 0.0, **result}


def run_xgrammar(
    tokenizer_json: str, eos_id: int, vocab_size: int, runs: int, utf8: bool = False
) -> dict:
    import xgrammar

    from rayinfer.workers.runner.utf8_tails import CLOSED, Utf8Tails

    vocab = json.loads(tokenizer_json)["model"]["vocab"]
    added = {t["id"]: t["content"] for t in json.loads(tokenizer_json)["added_tokens"]}
    encoded = [""] * vocab_size
    for text, token_id in vocab.items():
        encoded[token_id] = text
    for token_id, text in added.items():
        encoded[token_id] = text
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo(
        encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=[eos_id]
    )
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    tails = Utf8Tails(info.decoded_vocab, vocab_size) if utf8 else None
    setup_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    first_row = bitmask.numpy()[0]  # the same memory
    tail = [CLOSED]  # the current matcher's

    def new_matcher():
        tail[0] = CLOSED
        return xgrammar.GrammarMatcher(compiled)

    def fill(matcher):
        matcher.fill_next_token_bitmask(bitmask, 0)
        if tails is not None:
            tails.narrow(first_row, tail[0])

    def accept(matcher, token):
        assert matcher.accept_token(token)
        if tails is not None:
            tail[0] = tails.after(tail[0], token)

    result = _drive(new_matcher, fill, accept, bitmask, vocab_size, eos_id, runs,
                    lambda m: m.is_terminated())  # fmt: skip
    return {"setup_s": setup_s, "compile_ms": 1e3 * compile_s, **result}


def _drive(new_matcher, fill, accept, bitmask, vocab_size, eos_id, runs, is_done) -> dict:
    rng = random.Random(0)
    mask_s, tokens, first_s = 0.0, 0, []
    for _ in range(runs):
        start = time.perf_counter()
        matcher = new_matcher()
        for step in range(MAX_TOKENS):
            begin = time.perf_counter()
            fill(matcher)
            mask_s += time.perf_counter() - begin
            if step == 0:
                first_s.append(time.perf_counter() - start)
            tokens += 1
            choices = allowed_ids(bitmask[0], vocab_size)
            # Prefer ending once the grammar allows it, so the runs finish well under the cap.
            token = eos_id if eos_id in choices else rng.choice(choices)
            accept(matcher, token)
            if is_done(matcher):
                break
    return {
        "mask_us_per_token": 1e6 * mask_s / tokens,
        "first_mask_ms": 1e3 * sum(first_s) / len(first_s),
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", action="append", default=[], help="a tokenizer.json")
    parser.add_argument("--eos-id", type=int, default=1, help="its end-of-text id")
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    from rayinfer.models.tiny import EOS_ID, build_tokenizer

    torch.set_num_threads(1)
    cases = [("tiny", build_tokenizer().to_str(), EOS_ID)]
    cases += [(path, open(path, encoding="utf-8").read(), args.eos_id) for path in args.tokenizer]
    for name, tokenizer_json, eos_id in cases:
        from tokenizers import Tokenizer

        vocab_size = Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
        libraries = (
            ("llguidance", run_llguidance),
            ("xgrammar", run_xgrammar),
            ("xgrammar+utf8", lambda *a: run_xgrammar(*a, utf8=True)),
        )
        for library, run in libraries:
            result = run(tokenizer_json, eos_id, vocab_size, args.runs)
            print(json.dumps({"tokenizer": name, "vocab": vocab_size, "library": library,
                              **{k: round(v, 3) for k, v in result.items()}}))  # fmt: skip


if __name__ == "__main__":
    main()
