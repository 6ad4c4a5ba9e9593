"""A request's sequence plus what the engine reports about it: detokenized text and deltas."""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from rayinfer.engine.batch import SampledLogprobs
from rayinfer.engine.outputs import GeneratedTokens, Logprob, RequestOutput, TokenLogprobs
from rayinfer.engine.sequence import Sequence
from rayinfer.engine.stop_checker import (
    find_stop,
    finish_reason_after_token,
    stop_token_reason,
    streamable_length,
)


class RequestState:
    def __init__(self, seq: Sequence, tokenizer=None):
        self.seq = seq
        self.tokenizer = tokenizer
        # one entry per generated token when the request asked for log-probabilities
        self.logprobs: list[TokenLogprobs] | None = None
        if seq.params.logprobs is not None:
            self.logprobs = []
        # one entry per prompt token, filled as prefill chunks run (the first has no logprob)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        if seq.params.prompt_logprobs is not None:
            first = seq.prompt_token_ids[0]
            self.prompt_logprobs = [TokenLogprobs(Logprob(first, None, self._text_of(first)))]
            self.prompt_logprobs += [None] * (seq.num_prompt_tokens - 1)
        self.detokenizer = None
        if tokenizer is not None:
            from rayinfer.engine.detokenizer import IncrementalDetokenizer

            self.detokenizer = IncrementalDetokenizer(
                tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens
            )
        self.text = ""
        self.finish_reason: str | None = None
        # vLLM's: the stop token id or stop string that ended the request, None otherwise
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # why the engine failed the request (finish_reason "error")
        self._num_tokens_reported = 0
        self._num_chars_reported = 0

    def append_token(
        self,
        token_id: int,
        eos_token_ids: AbstractSet[int],
        max_model_len: int,
        logprobs: SampledLogprobs | TokenLogprobs | None = None,
    ) -> str | None:
        """Add a sampled token (with its log-probabilities when the request asked for them: an
        executor's numbers, or a TokenLogprobs already made, as a hand-off's first token's);
        returns why the request ends now, or None. A "stop" sets `stop_reason`."""
        seq = self.seq
        seq.output_token_ids.append(token_id)
        if self.logprobs is not None:
            if not isinstance(logprobs, TokenLogprobs):
                logprobs = self.token_logprobs(token_id, logprobs)
            self.logprobs.append(logprobs)
        reason = finish_reason_after_token(seq, eos_token_ids, max_model_len)
        self.stop_reason = stop_token_reason(seq) if reason == "stop" else None
        if self.detokenizer is None:
            return reason
        params = seq.params
        searched = len(self.text)
        is_stop_token = reason == "stop"
        if not is_stop_token or params.include_stop_str_in_output:  # else its text is not shown
            self.text += self.detokenizer.add(token_id)
        if reason is not None:
            self.text += self.detokenizer.flush()
        if seq.num_output_tokens < params.min_tokens:
            return reason
        found = find_stop(self.text, params.stop, searched)
        if found is not None:  # the text is cut here, even where a stop token came too
            self.text = self.text[: found.end if params.include_stop_str_in_output else found.start]
            self.stop_reason = found.stop
            return "stop"
        return reason

    def token_logprobs(self, token_id: int, sampled: SampledLogprobs | None) -> TokenLogprobs:
        """The executor's numbers with each token's text. An executor always sends them for a
        request that asked; a token without them (none known) records NaN rather than shift
        the list against token_ids."""
        if sampled is None:
            return TokenLogprobs(Logprob(token_id, float("nan"), self._text_of(token_id)))
        top = [
            Logprob(i, value, self._text_of(i))
            for i, value in zip(sampled.top_ids, sampled.top_logprobs)
        ]
        return TokenLogprobs(Logprob(token_id, sampled.logprob, self._text_of(token_id)), top)

    def add_prompt_logprobs(self, start: int, entries: list[SampledLogprobs]) -> None:
        """Entries for prompt positions start + 1.. (a recomputed chunk writes the same again)."""
        prompt = self.seq.prompt_token_ids
        for offset, sampled in enumerate(entries, start + 1):
            self.prompt_logprobs[offset] = self.token_logprobs(prompt[offset], sampled)

    def _text_of(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def mark_reported(self, num_chars: int) -> None:
        """Count every token so far and the first num_chars characters of the text as reported
        (a resumed stream's state: what its client already has, deployments/resume.py)."""
        self._num_tokens_reported = len(self.seq.output_token_ids)
        self._num_chars_reported = num_chars

    def finish(self, reason: str) -> None:
        self.finish_reason = reason

    def fail(self, error: str) -> None:
        self.finish_reason, self.error, self.stop_reason = "error", error, None

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
            stop_reason=self.stop_reason,
            num_cached_tokens=seq.num_cached_tokens,
            error=self.error,
        )
        is_first = self._num_tokens_reported == 0  # the prompt is complete from its first token
        if self.prompt_logprobs is not None and (self.finish_reason or is_first):
            output.prompt_logprobs = list(self.prompt_logprobs)
        if self.logprobs is not None:
            count = len(self.logprobs)
            output.logprobs = (
                list(self.logprobs) if self.finish_reason else GeneratedTokens(self.logprobs, count)
            )
            output.new_logprobs = self.logprobs[self._num_tokens_reported :]
        self._num_tokens_reported = len(generated)
        self._num_chars_reported = visible
        return output
