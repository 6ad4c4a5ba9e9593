"""OpenAI's two log-probability formats, from the engine's per-token TokenLogprobs.

Chat (`logprobs: true, top_logprobs: k`): {"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}.
Completions (`logprobs: k`): {"tokens": [...], "token_logprobs": [...], "top_logprobs":
[{token: logprob, ...}, ...], "text_offset": [...]}; each top_logprobs dict holds the k most likely
tokens and the sampled one (so up to k + 1 entries, as OpenAI and vLLM answer).
A token without text (a model served without a tokenizer) is written "token_id:<id>". With
`echo`, the prompt's tokens come first; the first of them has null logprob and top_logprobs.

`text_offset` is where each token starts in the returned `text`: a token's own text is found
there, so text[offset:] starts with it. A token whose text the reply does not show (BOS, EOS,
the pieces of a character split across tokens) takes the offset of the text that follows, so
`text[offset[i]:offset[i + 1]]` is token i's text, or "" for such a token.
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


def completion_logprobs(
    entries: list[TokenLogprobs], text: str, position: int = 0
) -> tuple[dict[str, Any], int]:
    """The logprobs object of `entries`, whose tokens spell `text` (the reply's text so far) from
    `position` on; and the position after the last one found (where a stream's next chunk's
    tokens continue)."""
    tokens, offsets = [], []
    for entry in entries:
        token = token_text(entry.chosen)
        found = text.find(token, position) if token else -1
        offsets.append(found if found >= 0 else min(position, len(text)))
        if found >= 0:
            position = found + len(token)
        tokens.append(token)
    body = {
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
    return body, position
