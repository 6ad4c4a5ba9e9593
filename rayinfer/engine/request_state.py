"""A request's sequence plus what the engine reports about it: detokenized text and deltas."""

from __future__ import annotations

from rayinfer.engine.outputs import GeneratedTokens, RequestOutput
from rayinfer.engine.sequence import Sequence
from rayinfer.engine.stop_checker import (
    find_stop_string,
    finish_reason_after_token,
    streamable_length,
)


class RequestState:
    def __init__(self, seq: Sequence, tokenizer=None):
        self.seq = seq
        self.detokenizer = None
        if tokenizer is not None:
            from rayinfer.engine.detokenizer import IncrementalDetokenizer

            self.detokenizer = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids)
        self.text = ""
        self.finish_reason: str | None = None
        self._num_tokens_reported = 0
        self._num_chars_reported = 0

    def append_token(
        self, token_id: int, eos_token_ids: set[int], max_model_len: int
    ) -> str | None:
        """Add a sampled token; returns why the request ends now, or None."""
        seq = self.seq
        seq.output_token_ids.append(token_id)
        reason = finish_reason_after_token(seq, eos_token_ids, max_model_len)
        if self.detokenizer is None:
            return reason
        searched = len(self.text)
        is_eos = reason == "stop"
        if not is_eos:  # the EOS token's own text is never shown
            self.text += self.detokenizer.add(token_id)
        if reason is not None:
            self.text += self.detokenizer.flush()
        cut = find_stop_string(self.text, seq.params.stop, searched)
        if cut is not None:
            self.text = self.text[:cut]
            return "stop"
        return reason

    def finish(self, reason: str) -> None:
        self.finish_reason = reason

    def take_output(self) -> RequestOutput:
        """The request's state plus what changed since the last call."""
        seq, text = self.seq, self.text
        visible = len(text)
        if self.finish_reason is None and seq.params.stop:  # hold back a stop string's start
            visible = max(streamable_length(text, seq.params.stop), self._num_chars_reported)
        generated = seq.output_token_ids
        so_far = (
            list(generated) if self.finish_reason else GeneratedTokens(generated, len(generated))
        )
        output = RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=so_far,
            text=text if visible == len(text) else text[:visible],
            new_token_ids=generated[self._num_tokens_reported :],
            new_text=text[self._num_chars_reported : visible],
            finish_reason=self.finish_reason,
            num_cached_tokens=seq.num_cached_tokens,
        )
        self._num_tokens_reported = len(generated)
        self._num_chars_reported = visible
        return output
