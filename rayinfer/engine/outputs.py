"""What the engine reports about a request after each step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


class RequestFailedError(RuntimeError):
    """The engine could not go on with one request (its seed, NaN logits); the others went on."""

    def __init__(self, request_id: str, reason: str):
        super().__init__(f"request {request_id!r} failed: {reason}")
        self.request_id = request_id
        self.reason = reason

    def __reduce__(self):  # pickles across Ray with both arguments
        return type(self), (self.request_id, self.reason)


class GeneratedTokens(Sequence):
    """The first `count` tokens of a request's generated list, read when used: a running
    request's output holds this instead of a copy, since copying every generated token into every
    step's output made a long generation quadratic. The list only ever grows, so the prefix
    stays what it was. Compares equal to a list of the same tokens; pickles as a plain list."""

    __slots__ = ("_tokens", "_count")

    def __init__(self, tokens: list[int], count: int):
        self._tokens, self._count = tokens, count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._tokens[: self._count][index]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError("generated token index out of range")
        return self._tokens[index]

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, GeneratedTokens)):
            return len(other) == self._count and list(other) == self._tokens[: self._count]
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self._tokens[: self._count])

    def __reduce__(self):
        return list, (self._tokens[: self._count],)


@dataclass
class Logprob:
    token_id: int
    # natural log of the model's probability (raw logits' log-softmax); None for a prompt's
    # first token, which has no context to be predicted from
    logprob: float | None
    token: str | None = None  # the token's text on its own; None without a tokenizer


@dataclass
class TokenLogprobs:
    """One generated token's log-probability and the request's k most likely alternatives
    (SamplingParams.logprobs = k), most likely first."""

    chosen: Logprob
    top: list[Logprob] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    # every generated token so far (a list once finished; a GeneratedTokens view while running)
    token_ids: list[int] | GeneratedTokens = field(default_factory=list)
    text: str = ""  # detokenized generated text so far (stop string cut off)
    new_token_ids: list[int] = field(default_factory=list)  # generated in the last step
    new_text: str = ""  # text added in the last step (safe to stream)
    # "stop", "length", "abort", "error" (the engine failed this request alone: see `error`) or
    # None while running
    finish_reason: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With SamplingParams.logprobs: one entry per generated token (like token_ids: a list once
    # finished, a view while running) and the last step's; None otherwise.
    logprobs: list[TokenLogprobs] | GeneratedTokens | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    # With SamplingParams.prompt_logprobs, on the output of the first generated token and once
    # the request ends (a prefill-only one included): one entry per prompt token, the first's
    # logprob None.
    prompt_logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # with finish_reason "error": why, in a sentence
    # vLLM's: with finish_reason "stop", the stop_token_ids entry (int) or the stop string (str)
    # that ended the request; None for EOS, a grammar's end, "length" and while running
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
