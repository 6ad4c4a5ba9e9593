"""How a request wants its tokens chosen and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rayinfer.engine.structured_output import StructuredOutput

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's chat `top_logprobs`
MAX_SEED = 2**63 - 1  # seeds are 0..MAX_SEED, as vLLM's (a torch generator takes 64 bits)
MAX_LOGIT_BIAS = 100.0  # |bias| per token, as OpenAI's logit_bias


class InvalidRequestError(ValueError):
    """A request's value is invalid; `field` names it so the server can answer 400."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message

    def __reduce__(self):  # pickles across Ray with both arguments
        return type(self), (self.field, self.reason)


@dataclass(frozen=True)
class SamplingParams:
    """`temperature=0` is greedy; `top_k=-1` (or 0, as vLLM reads it; stored as -1) and
    `top_p=1` disable those filters."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = field(default=())
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the generated text
    # None: no log-probabilities; k: each generated token's log-probability under the model (the
    # raw logits' log-softmax: before penalties, temperature, top-k/top-p) and the k most likely
    # tokens' (0 <= k <= MAX_LOGPROBS)
    logprobs: int | None = None
    # None, or k: each prompt token's log-probability given the tokens before it (the first has
    # none) and its k alternatives. The prompt is then computed whole: no prefix-cache hits.
    prompt_logprobs: int | None = None
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias; -100 bans
    # a token, +100 all but forces it); the log-probabilities reported stay the model's own
    logit_bias: tuple[tuple[int, float], ...] = ()
    # None, or what the output must match: each sampled token is masked to the tokens its
    # grammar allows, and the request ends ("stop") on the end-of-text token the grammar allows
    # once the output is complete (even with ignore_eos).
    structured_output: StructuredOutput | None = None
    # vLLM's extensions. min_p in [0, 1]: drop tokens whose probability (after temperature) is
    # below min_p times the most likely one's; 0 is off.
    min_p: float = 0.0
    # > 0, 1 is off: every token of the prompt or the output has its logit divided by it where
    # positive, multiplied where not (CTRL's rule), before temperature
    repetition_penalty: float = 1.0
    # EOS and stop_token_ids cannot be sampled, and stop strings are not looked for, until this
    # many tokens are generated (under a grammar, the grammar still decides when EOS may come)
    min_tokens: int = 0
    # token ids that end the request ("stop") besides EOS; their text is not in the output
    stop_token_ids: tuple[int, ...] = ()
    # keep the matched stop string (or stop token's text) at the end of the text
    include_stop_str_in_output: bool = False
    # whether special tokens (<|im_end|>, ...) are left out of the detokenized text
    skip_special_tokens: bool = True
    # None, or the only token ids that may be sampled (duplicates dropped); each must lie in
    # the vocabulary (the engine checks)
    allowed_token_ids: tuple[int, ...] | None = None
    # words the output may not contain: their token sequences are masked (engine/bad_words.py)
    bad_words: tuple[str, ...] = ()
    # bad_words as token sequences, filled from them by the engine (or the server's ingress)
    # with the model's tokenizer, so that a hand-off carries them; None: not tokenized yet.
    # Given directly, they are used as they are (a model without a tokenizer).
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    # None, or keep only the prompt's last k tokens; -1: as many as max_model_len - max_tokens
    # leaves (engine/prompt_truncation.py)
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in bias or ()))
        if isinstance(self.stop_token_ids, (list, tuple, set, frozenset)):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        elif self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", ())
        self._normalize_token_filters()
        self._validate()
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)

    def _normalize_token_filters(self) -> None:
        """Lists to tuples, duplicates dropped (order kept); other types are left for
        _validate_token_filters to refuse."""
        if isinstance(self.allowed_token_ids, (list, tuple, set, frozenset)):
            object.__setattr__(
                self, "allowed_token_ids", tuple(dict.fromkeys(self.allowed_token_ids))
            )
        if self.bad_words is None:
            object.__setattr__(self, "bad_words", ())
        elif isinstance(self.bad_words, (list, tuple)):
            object.__setattr__(self, "bad_words", tuple(dict.fromkeys(self.bad_words)))
        sequences = self.bad_words_token_ids
        if isinstance(sequences, (list, tuple)) and all(
            isinstance(s, (list, tuple)) for s in sequences
        ):
            object.__setattr__(self, "bad_words_token_ids", tuple(map(tuple, sequences)))

    def _validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool):
            raise InvalidRequestError("max_tokens", f"must be an integer, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise InvalidRequestError("max_tokens", f"must be > 0, got {self.max_tokens}")
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise InvalidRequestError(
                "temperature", f"must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise InvalidRequestError(
                "top_k", f"must be -1 or 0 (off) or an integer >= 1, got {self.top_k!r}"
            )
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not 0 <= self.seed <= MAX_SEED
        ):
            raise InvalidRequestError("seed", f"seed={self.seed!r} must be in 0..{MAX_SEED}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise InvalidRequestError(name, f"must be a number in [-2, 2], got {value!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int)
                or isinstance(value, bool)
                or not 0 <= value <= MAX_LOGPROBS
            ):
                raise InvalidRequestError(
                    name, f"must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}"
                )
        if self.structured_output is not None and not isinstance(
            self.structured_output, StructuredOutput
        ):
            raise InvalidRequestError("structured_output", "must be a StructuredOutput or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("stop", "must be a non-empty string or a list of them")
        self._validate_logit_bias()
        self._validate_vllm_extensions()
        self._validate_token_filters()

    def _validate_logit_bias(self) -> None:
        for token_id, bias in self.logit_bias:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise InvalidRequestError(
                    "logit_bias", f"token ids must be integers >= 0, got {token_id!r}"
                )
            if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    "logit_bias",
                    f"token {token_id}: the bias must be a number in "
                    f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias!r}",
                )

    def _validate_vllm_extensions(self) -> None:
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError("min_p", f"must be a number in [0, 1], got {self.min_p!r}")
        penalty = self.repetition_penalty
        if not _is_number(penalty) or not 0 < penalty < math.inf:
            raise InvalidRequestError(
                "repetition_penalty", f"must be a finite number > 0 (1 is off), got {penalty!r}"
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidRequestError(
                "min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}"
            )
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens",
                f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}",
            )
        if not isinstance(self.stop_token_ids, tuple) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidRequestError(
                "stop_token_ids", f"must be a list of integers >= 0, got {self.stop_token_ids!r}"
            )
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(
                    name, f"must be true or false, got {getattr(self, name)!r}"
                )

    def _validate_token_filters(self) -> None:
        allowed = self.allowed_token_ids
        if allowed is not None and not (
            isinstance(allowed, tuple) and all(_is_int(t) and t >= 0 for t in allowed)
        ):
            raise InvalidRequestError(
                "allowed_token_ids", f"must be a list of integers >= 0, got {allowed!r}"
            )
        if allowed == ():
            raise InvalidRequestError(
                "allowed_token_ids", "must not be empty (no token could be sampled); None is off"
            )
        if not isinstance(self.bad_words, tuple) or not all(
            isinstance(w, str) and w for w in self.bad_words
        ):
            raise InvalidRequestError(
                "bad_words", f"must be a list of non-empty strings, got {self.bad_words!r}"
            )
        sequences = self.bad_words_token_ids
        if sequences is not None and not (
            isinstance(sequences, tuple)
            and all(s and all(_is_int(t) and t >= 0 for t in s) for s in sequences)
        ):
            raise InvalidRequestError(
                "bad_words",
                f"bad_words_token_ids must be lists of integers >= 0, got {sequences!r}",
            )
        truncate = self.truncate_prompt_tokens
        if truncate is not None and not (_is_int(truncate) and (truncate >= 1 or truncate == -1)):
            raise InvalidRequestError(
                "truncate_prompt_tokens",
                f"must be an integer >= 1, or -1 (as many as fit), got {truncate!r}",
            )

    def check_vocabulary(self, vocab_size: int) -> None:
        """What the model decides: every token id the params name lies in [0, vocab_size)."""
        for name, ids in (
            ("logit_bias", [token_id for token_id, _ in self.logit_bias]),
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("bad_words", [t for s in self.bad_words_token_ids or () for t in s]),
        ):
            outside = [token_id for token_id in ids if token_id >= vocab_size]
            if outside:
                raise InvalidRequestError(
                    name, f"token id {outside[0]} is outside the vocabulary [0, {vocab_size})"
                )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler needs the generated tokens (presence, frequency or repetition)."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    @property
    def has_additive_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
