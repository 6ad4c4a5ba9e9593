"""Streaming detokenization that never emits a broken UTF-8 character.

Byte-level BPE splits one character into several tokens (an emoji is often 2-4 tokens), and decoding
a partial character gives U+FFFD. `IncrementalDetokenizer` keeps two offsets into the token ids, as
vLLM does: text up to `read_offset` has been emitted; a new token's text is decoded in the window
`[prefix_offset:]` (a few tokens of context, so SentencePiece-style decoders keep their leading
space) and held back while it ends in U+FFFD. The concatenation of all deltas plus `flush()` equals
`tokenizer.decode(ids)`.

Where the `tokenizers` library has `DecodeStream` (0.22 and later: one call per token in Rust,
seeded with the same prompt context), `add` uses it: two Python-side decodes per token were ~40%
of the engine's host time per decode step. `flush` and older libraries take the window path.
"""

from __future__ import annotations

from collections.abc import Sequence

from rayinfer.engine.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded as context before the first generated token


class IncrementalDetokenizer:
    """Feed generated token ids one at a time with `add`; each call returns the new text."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = _whole_characters(tokenizer, prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.token_ids: list[int] = context  # context tokens, then every generated token
        self.prefix_offset = 0  # start of the decoding window
        self.read_offset = len(context)  # tokens before this one are emitted
        self.text = ""  # everything emitted so far
        self._stream = _decode_stream(tokenizer, context, skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; returns the text it completes ("" while a character is unfinished)."""
        self.token_ids.append(token_id)
        if self._stream is None:
            return self._emit(is_final=False)
        delta = self._stream.step(self.tokenizer.backend, token_id)
        if not delta:  # None: a character is unfinished (or the token has no text)
            return ""
        self.prefix_offset = self.read_offset  # as _emit moves the window
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Text held back at the end of the stream (with U+FFFD if a character never ended)."""
        return self._emit(is_final=True)

    def _emit(self, is_final: bool) -> str:
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        window_text = self._decode(self.prefix_offset, len(self.token_ids))
        is_complete = not window_text.endswith(REPLACEMENT_CHAR)
        if len(window_text) <= len(prefix_text) or not (is_complete or is_final):
            return ""
        delta = window_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        ids = self.token_ids[start:end]
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def _whole_characters(tokenizer: Tokenizer, context: Sequence[int]) -> list[int]:
    """The context without the trailing tokens of a character the prompt leaves unfinished: seeded
    with those, the first generated token's text would carry the context's text with it (and the
    generated text would no longer be decode(generated ids))."""
    context = list(context)
    while context and tokenizer.decode(context).endswith(REPLACEMENT_CHAR):
        context.pop()
    return context


def _decode_stream(tokenizer: Tokenizer, context: list[int], skip_special_tokens: bool):
    """A `tokenizers.decoders.DecodeStream` seeded with the context ids, or None where the
    library (or the tokenizer) has none."""
    backend = getattr(tokenizer, "backend", None)
    try:
        from tokenizers import Tokenizer as BackendTokenizer
        from tokenizers.decoders import DecodeStream

        if not isinstance(backend, BackendTokenizer):
            return None
        return DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
    except (ImportError, TypeError):  # before tokenizers 0.22: no DecodeStream, or no `ids`
        return None
