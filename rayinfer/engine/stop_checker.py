"""Decides when a sequence ends and how much of its text is safe to stream."""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import NamedTuple

from rayinfer.engine.sequence import Sequence


class StopMatch(NamedTuple):
    """Where a stop string was found in the text, and which one."""

    start: int
    end: int
    stop: str


def eos_token_ids(model_config, tokenizer=None) -> set[int]:
    """The tokens that end a request: the checkpoint config's (a ModelConfig) and the
    tokenizer's."""
    ids = set(model_config.eos_token_ids)
    return ids | set(tokenizer.eos_token_ids) if tokenizer is not None else ids


def ends_at_stop_token(seq: Sequence, eos_token_ids: AbstractSet[int]) -> bool:
    """Whether the last token is one that ends the request: EOS (unless ignored) or one of its
    stop_token_ids, once min_tokens are generated. Under a grammar, EOS is sampled only where
    the grammar lets the output end: it ends the request always."""
    params, last = seq.params, seq.output_token_ids[-1]
    if params.structured_output is not None and last in eos_token_ids:
        return True
    if seq.num_output_tokens < params.min_tokens:
        return False
    return (not params.ignore_eos and last in eos_token_ids) or last in params.stop_token_ids


def finish_reason_after_token(
    seq: Sequence, eos_token_ids: AbstractSet[int], max_model_len: int
) -> str | None:
    """'stop' on a stop token (ends_at_stop_token), 'length' on max_tokens or the context
    limit, else None."""
    if ends_at_stop_token(seq, eos_token_ids):
        return "stop"
    if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def stop_token_reason(seq: Sequence) -> int | None:
    """vLLM's stop_reason for a request its last token ended ("stop"): the token's id where it
    is one of the request's stop_token_ids (an EOS id listed there too), None for EOS."""
    last = seq.output_token_ids[-1]
    return int(last) if last in seq.params.stop_token_ids else None


def find_stop_string(text: str, stops: tuple[str, ...], search_from: int) -> int | None:
    """Index where the earliest stop string starts in text[search_from:], or None."""
    found = find_stop(text, stops, search_from)
    return found.start if found is not None else None


def find_stop(text: str, stops: tuple[str, ...], search_from: int) -> StopMatch | None:
    """The earliest stop string ending in text[search_from:] (at equal starts, the first
    listed), or None."""
    hits = []
    for stop in stops:
        start = text.find(stop, max(0, search_from - len(stop) + 1))
        if start >= 0:
            hits.append(StopMatch(start, start + len(stop), stop))
    return min(hits, key=lambda hit: hit.start) if hits else None


def streamable_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the prefix of text that no stop string can still start inside."""
    held = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                held = max(held, size)
                break
    return len(text) - held
