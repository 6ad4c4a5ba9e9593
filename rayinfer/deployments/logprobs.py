"""OpenAI's two log-probability formats, from the engine's per-token TokenLogprobs.

Chat (`logprobs: true, top_logprobs: k`): {"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}.
Completions (`logprobs: k`): {"tokens": [...], "token_logprobs": [...], "top_logprobs":
[{token: logprob, ...}, ...], "text_offset": [...]}; each top_logprobs dict holds the k most likely
tokens and the sampled one (so up to k + 1 entries, as OpenAI and vLLM answer).
A token without text (a model served without a tokenizer) is written "token_id:<id>". With
`echo`, the prompt's tokens come first; the first of them has null logprob and top_logprobs.
"""

from __future__ import annotations

from typing import Any

from rayinfer.engine.outputs import Logprob, TokenLogprobs


def token_text(entry: Logprob) -> str:
    return entry.token if entry.token is not None else f"token_id:{entry.token_id}"


def _chat_item(entry: Logprob) -> dict[str, Any]:
    text = token_text(entry)
    return {"token": text, "logprob": entry.logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[TokenLogprobs]) -> dict[str, Any]:
    return {
        "content": [
            {**_chat_item(e.chosen), "top_logprobs": [_chat_item(t) for t in e.top]}
            for e in entries
        ]
    }


def completion_logprobs(entries: list[TokenLogprobs], text_offset: int = 0) -> dict[str, Any]:
    """`text_offset`: where the first entry's text starts in the completion (a stream's chunks
    continue from the text already sent)."""
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(text_offset)
        tokens.append(token_text(entry.chosen))
        text_offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [e.chosen.logprob for e in entries],
        "top_logprobs": [
            None
            if e.chosen.logprob is None  # an echoed prompt's first token
            else {token_text(t): t.logprob for t in [*e.top, e.chosen]}
            for e in entries
        ],
        "text_offset": offsets,
    }
