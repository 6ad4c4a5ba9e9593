"""OpenAI-compatible request bodies and their validation (responses: response_bodies.py;
the error body: openai_error.py).

Fields OpenAI defines but rayinfer does not implement (best_of > 1,
suffix; n > 1 through Python handles; content parts other than text) are accepted at their
neutral values and refused otherwise, naming the field. Unknown fields are ignored, as the OpenAI
server does. Types are strict where OpenAI's are: `"max_tokens": "3"`, `"stream": "true"` and a
token id `false` are 400, not coerced. Completions take a batch of prompts (a list of strings or
of token-id lists): each prompt is its own engine request, choice `prompt_index * n + i`.
Extensions (vLLM's `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, `ignore_eos`, `allowed_token_ids`,
`bad_words`, `truncate_prompt_tokens`) are marked.
Log-probabilities: chat's `logprobs` / `top_logprobs` (up to 20) and completions' `logprobs`
(up to 5), formatted by deployments/logprobs.py. `n` choices over HTTP: deployments/choices.py.
Structured outputs (response_format, vLLM's structured_outputs / guided_*) and tools:
deployments/structured_fields.py; the messages' tool calls and tool results:
deployments/message_tool_fields.py; how chat renders its messages (vLLM's
add_generation_prompt, continue_final_message, chat_template_kwargs):
deployments/chat_template_fields.py.

Every number is checked here with OpenAI's range (vLLM's for its extensions): a value outside
answers 400 naming the field before anything is tokenized or scheduled.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rayinfer.deployments.chat_template_fields import ChatTemplateFields
from rayinfer.deployments.message_tool_fields import ToolCallsAsSent
from rayinfer.deployments.structured_fields import (
    ChatOutputFields,
    GuidedFields,
    ResponseFormatFields,
)
from rayinfer.deployments.valid_unicode import check_text
from rayinfer.engine.bad_words import MAX_BAD_WORD_SEQUENCES
from rayinfer.engine.sampling_params import MAX_LOGPROBS, MAX_SEED, SamplingParams

# Every HTTP body model: no coercion of strings to numbers or booleans, nor of booleans to ints.
STRICT = ConfigDict(extra="ignore", strict=True)

MAX_CHOICES = 16  # `n`: choices per request over HTTP (deployments/choices.py)
MAX_STOPS = 4  # stop strings per request, as OpenAI's
MAX_STOP_CHARS = 256  # per stop string: a stream holds back up to this many characters
MAX_PROMPTS = 256  # prompts in one batched completions request, each its own engine request
MAX_LOGIT_BIAS_TOKENS = 300  # tokens one request may bias, as OpenAI's
TOOL_MESSAGE_FIELDS = ("tool_calls", "tool_call_id", "name")
# An assistant's reasoning, under vLLM's old and current names; templates that render earlier
# turns' thinking read it (engine/chat_template.py passes it under every name they read)
REASONING_MESSAGE_FIELDS = ("reasoning_content", "reasoning")
# Roles whose messages must carry `content` (an assistant's may be null beside `tool_calls`).
ROLES_WITH_CONTENT = ("system", "user", "developer", "tool")
TEXT_PART_TYPES = ("text", "refusal")  # the content parts a text model reads
TEXT_PART_SHAPE = '{"type": "text", "text": ...}'


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    continuous_usage_stats: bool = Field(
        False,
        description="extension (vLLM's): every chunk carries the usage so far, so a client sees "
        "each token arrive even when its text is empty",
    )


class SamplingFields(GuidedFields):
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

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, body):
        """Every string of the body, nested ones too (deployments/valid_unicode.py)."""
        return check_text(body)

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    # validate_default: a missing content or tool_call_id is checked like an explicit null
    content: str | list[dict[str, Any]] | None = Field(None, validate_default=True)
    tool_calls: ToolCallsAsSent = None  # an assistant's; the template gets them as sent
    tool_call_id: str | None = Field(None, validate_default=True)  # a tool result's call
    name: str | None = None
    reasoning_content: str | None = Field(
        None, description="extension (vLLM's): an assistant's reasoning, for the template"
    )
    reasoning: str | None = Field(None, description="extension (vLLM's): reasoning_content")

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value):
        """One message for any wrong type (the union's errors would name its members)."""
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(f"must be a string or a list of content parts ({TEXT_PART_SHAPE})")
        for index, part in enumerate(value):
            if not isinstance(part, dict):
                raise ValueError(f"part {index} must be an object ({TEXT_PART_SHAPE})")
        return value

    @field_validator("content")
    @classmethod
    def _content_where_required(cls, value, info: ValidationInfo):
        role = info.data.get("role")
        if value is None and role in ROLES_WITH_CONTENT:
            raise ValueError(f"a {role} message needs content (a string or a list of parts)")
        return value

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value):
        """A text model reads text parts; an image or audio part would be silently dropped."""
        for index, part in enumerate(value if isinstance(value, list) else []):
            kind = part.get("type")
            if kind not in TEXT_PART_TYPES:
                raise ValueError(
                    f"part {index} has type {kind!r}; this model reads only text parts "
                    f"(type {' or '.join(map(repr, TEXT_PART_TYPES))})"
                )
            if not isinstance(part.get(kind), str):
                raise ValueError(f"part {index}: a {kind} part needs a string {kind!r} field")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _tool_result_names_its_call(cls, value, info: ValidationInfo):
        if value is None and info.data.get("role") == "tool":
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        return value

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(
                part.get("text", "") for part in self.content if part.get("type") == "text"
            )
        return self.content or ""

    def as_sent(self) -> dict[str, Any]:
        """The message as sent, content as text, the tool fields the client gave beside it,
        and an assistant's reasoning (other roles' is dropped, as vLLM drops it)."""
        fields = TOOL_MESSAGE_FIELDS
        if self.role == "assistant":
            fields += REASONING_MESSAGE_FIELDS
        sent = {k: getattr(self, k) for k in fields if k in self.model_fields_set}
        return {"role": self.role, "content": self.text(), **sent}


class ChatCompletionRequest(SamplingFields, ChatOutputFields, ChatTemplateFields):
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices, each sampled on its own")
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # response_format, tools, tool_choice: ChatOutputFields (deployments/structured_fields.py)
    # add_generation_prompt, continue_final_message, chat_template_kwargs: ChatTemplateFields

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs=true")
        return value

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The field `requested_max_tokens` came from, for its errors."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as sent, content as text: a tool call's and a tool result's own fields
        (tool_calls, tool_call_id, name) kept beside it. The chat template gets them through
        engine/template_messages.py, which parses tool calls' arguments."""
        return [m.as_sent() for m in self.messages]


class CompletionRequest(SamplingFields, ResponseFormatFields):
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices, each sampled on its own")
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a text, token ids, or a batch of texts or of token-id lists (each prompt "
        f"its own request, up to {MAX_PROMPTS})"
    )
    echo: bool = Field(False, description="the prompt before the completion (and its logprobs)")
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1, le=1, description="only one candidate per request")
    suffix: str | None = Field(None, description="only none is supported")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("is not supported")
        return value

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def requested_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value):
        """One message for every wrong shape (the union's four errors would name its members)."""
        if is_batch(value):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"{len(value)} prompts; send at most {MAX_PROMPTS} per request")
            texts = isinstance(value[0], str)  # a batch holds texts or token-id lists, not both
            for index, prompt in enumerate(value):
                _check_one_prompt(prompt, f"entry {index} ", texts=texts)
        else:
            _check_one_prompt(value, "", texts=isinstance(value, str))
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or the batch's."""
        return list(self.prompt) if is_batch(self.prompt) else [self.prompt]

    def for_prompt(self, prompt: str | list[int]) -> CompletionRequest:
        """This request with one of its prompts (the fields already validated)."""
        return self.model_copy(update={"prompt": prompt})

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


def is_batch(prompt) -> bool:
    """A list of prompts (texts or token-id lists), not one prompt's token ids."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_one_prompt(prompt, where: str, texts: bool) -> None:
    """texts: whether the prompt must be a string (else token ids)."""
    if texts and isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{where}must not be empty")
        return
    if texts or not isinstance(prompt, list) or not all(map(_is_token_id, prompt)):
        kinds = "a string, a list of token ids (integers), or a list of either"
        raise ValueError(f"{where}must be {kinds}; a batch holds one kind")
    if not prompt:
        raise ValueError(f"{where}must not be empty")
