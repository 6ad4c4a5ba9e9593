"""Decides when a sequence ends and how much of its text is safe to stream."""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from rayinfer.engine.sequence import Sequence


def eos_token_ids(model_config, tokenizer=None) -> set[int]:
    """The tokens that end a request: the checkpoint config's (a ModelConfig) and the
    tokenizer's."""
    ids = set(model_config.eos_token_ids)
    return ids | set(tokenizer.eos_token_ids) if tokenizer is not None else ids


def finish_reason_after_token(
    seq: Sequence, eos_token_ids: AbstractSet[int], max_model_len: int
) -> str | None:
    """'stop' on EOS, 'length' on max_tokens or the context limit, else None. Under a grammar,
    EOS is sampled only where the grammar lets the output end: it ends the request always."""
    params = seq.params
    stops_at_eos = not params.ignore_eos or params.structured_output is not None
    if stops_at_eos and seq.output_token_ids[-1] in eos_token_ids:
        return "stop"
    if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def find_stop_string(text: str, stops: tuple[str, ...], search_from: int) -> int | None:
    """Index where the earliest stop string starts in text[search_from:], or None."""
    hits = [text.find(stop, max(0, search_from - len(stop) + 1)) for stop in stops]
    hits = [h for h in hits if h >= 0]
    return min(hits) if hits else None


def streamable_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the prefix of text that no stop string can still start inside."""
    held = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                held = max(held, size)
                break
    return len(text) - held
