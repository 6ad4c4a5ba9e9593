"""The body fields every generation request shares (chat and completions): sampling, stop
conditions, streaming options and vLLM's extensions, each checked with OpenAI's range (vLLM's for
its extensions) so that a value outside answers 400 naming the field before anything is
tokenized or scheduled. The request bodies themselves: deployments/protocol.py.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from rayinfer.deployments.request_body import STRICT, RequestBody
from rayinfer.deployments.structured_fields import GuidedFields
from rayinfer.engine.bad_words import MAX_BAD_WORD_SEQUENCES
from rayinfer.engine.sampling_params import MAX_SEED, SamplingParams

MAX_STOPS = 4  # stop strings per request, as OpenAI's
MAX_STOP_CHARS = 256  # per stop string: a stream holds back up to this many characters
MAX_LOGIT_BIAS_TOKENS = 300  # tokens one request may bias, as OpenAI's


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = Field(
        False,
        description="extension (vLLM's): every chunk carries the usage so far, so a client sees "
        "each token arrive even when its text is empty",
    )


class SamplingFields(GuidedFields, RequestBody):
    model_config = STRICT

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="extension: -1 or 0 disables")
    min_p: float = Field(
        0.0,
        ge=0,
        le=1,
        description="extension: drop tokens less likely than min_p times the most likely one",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0,
        allow_inf_nan=False,
        description="extension: > 0, 1 is off; the logit of every token in the prompt or the "
        "output is divided by it where positive, multiplied where negative",
    )
    min_tokens: int = Field(
        0, ge=0, description="extension: EOS, stop_token_ids and stop strings wait for these"
    )
    stop_token_ids: list[int] | None = Field(
        None, description="extension: token ids that end the output, like EOS"
    )
    include_stop_str_in_output: bool = Field(
        False, description="extension: keep the matched stop string in the text"
    )
    skip_special_tokens: bool = Field(
        True, description="extension: leave special tokens out of the text"
    )
    allowed_token_ids: list[int] | None = Field(
        None, description="extension: only these token ids may be sampled"
    )
    bad_words: list[str] | None = Field(
        None,
        description="extension: words the output may not contain (the last token of each "
        "word's token sequence is masked where the output ends with the others)",
    )
    truncate_prompt_tokens: int | None = Field(
        None,
        description="extension: keep the prompt's last k tokens; -1 keeps as many as "
        "max_model_len - max_tokens leaves",
    )
    stop: str | list[str] | None = None
    seed: int | None = Field(None, description=f"0..{MAX_SEED}")
    n: int = Field(1, ge=1, le=1, description="only one choice per request")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    ignore_eos: bool = Field(False, description="extension: keep going past EOS (benchmarks)")
    rayinfer_timings: bool = Field(False, description="extension: add hand-off timings")
    logit_bias: dict[str, float] | None = Field(
        None,
        description="token id (as a string) -> bias in [-100, 100] added to its logit before "
        "sampling",
    )

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value):
        if value and len(value) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"{len(value)} tokens; bias at most {MAX_LOGIT_BIAS_TOKENS}")
        for key in value or {}:
            if not key.isdecimal():
                raise ValueError(f"keys are token ids written as decimal strings, got {key!r}")
        return value

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int) -> int:
        if value < -1:
            raise ValueError("must be -1 or 0 (off) or >= 1")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value and min(value) < 0:
            raise ValueError("token ids must be >= 0")
        return value

    @field_validator("allowed_token_ids")
    @classmethod
    def _check_allowed_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and not value:
            raise ValueError("must not be empty (no token could be sampled); null is off")
        if value and min(value) < 0:
            raise ValueError("token ids must be >= 0")
        return value

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, value: list[str] | None) -> list[str] | None:
        if value and not all(value):
            raise ValueError("bad words must not be empty")
        if value and len(value) > MAX_BAD_WORD_SEQUENCES:
            raise ValueError(f"{len(value)} words; send at most {MAX_BAD_WORD_SEQUENCES}")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate_prompt_tokens(cls, value: int | None) -> int | None:
        if value is not None and value < 1 and value != -1:
            raise ValueError("must be an integer >= 1, or -1 (as many as fit)")
        return value

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_SEED:
            raise ValueError(f"seed={value} must be in 0..{MAX_SEED}")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value):
        """One message for any wrong type (the union's errors would name its members)."""
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("must be a string or a list of strings")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value):
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > MAX_STOPS:
            raise ValueError(f"{len(stops)} stop strings; send at most {MAX_STOPS}")
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(
                f"a stop string of {longest} characters; each may have at most {MAX_STOP_CHARS}"
            )
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def include_chunk_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop or (),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=self.requested_logprobs,
            prompt_logprobs=self.requested_prompt_logprobs,
            logit_bias=tuple((int(t), b) for t, b in (self.logit_bias or {}).items()),
            structured_output=self.structured_output(),  # deployments/structured_fields.py
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=tuple(self.bad_words or ()),
            # truncate_prompt_tokens is not passed: PromptBuilder truncates the prompt it sends
        )

    @property
    def requested_logprobs(self) -> int | None:
        """Alternatives per generated token to report, or None for no log-probabilities."""
        return None

    @property
    def max_tokens_field(self) -> str:
        """The field `requested_max_tokens` came from, for its errors."""
        return "max_tokens"

    @property
    def requested_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token to report (completions' echo), or None."""
        return None
