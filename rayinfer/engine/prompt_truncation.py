"""vLLM's `truncate_prompt_tokens`: keep a prompt's last k tokens.

k = -1 keeps as many as the output leaves room for: max_model_len - max_tokens (as vLLM's
renderer, which counts max_tokens as 0 when the request gives none); a k above that is refused.
Token ids keep their last k; a text keeps the special tokens its tokenizer adds (BOS) around its
last tokens, k in all, as transformers' left truncation does (Tokenizer.encode_last). A chat
prompt is token ids once its template is applied.
"""

from __future__ import annotations

from rayinfer.engine.sampling_params import InvalidRequestError

FIELD = "truncate_prompt_tokens"


def prompt_token_limit(truncate: int | None, max_model_len: int, max_tokens: int) -> int | None:
    """How many prompt tokens to keep (None: all); an InvalidRequestError naming the field when
    k does not fit beside max_tokens."""
    if truncate is None:
        return None
    room = max_model_len - max_tokens
    if room < 1:
        raise InvalidRequestError(
            FIELD,
            f"max_tokens={max_tokens} leaves no prompt token of max_model_len={max_model_len}",
        )
    if truncate > room:
        raise InvalidRequestError(
            FIELD,
            f"{truncate} exceeds max_model_len - max_tokens = {max_model_len} - {max_tokens} = "
            f"{room}; use a smaller truncation size (or -1 for {room})",
        )
    return room if truncate == -1 else truncate


def keep_last(token_ids: list[int], limit: int | None) -> list[int]:
    return token_ids if limit is None or len(token_ids) <= limit else token_ids[-limit:]
