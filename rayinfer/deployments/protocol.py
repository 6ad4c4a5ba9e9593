"""OpenAI-compatible request bodies and their validation (responses: response_bodies.py;
the error body: openai_error.py). The fields both bodies share (sampling, stops, streaming,
vLLM's extensions): deployments/sampling_fields.py; a chat message: deployments/chat_message.py.

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

from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from rayinfer.deployments.chat_message import ChatMessage
from rayinfer.deployments.chat_template_fields import ChatTemplateFields
from rayinfer.deployments.sampling_fields import SamplingFields
from rayinfer.deployments.structured_fields import ChatOutputFields, ResponseFormatFields
from rayinfer.engine.sampling_params import MAX_LOGPROBS

MAX_CHOICES = 16  # `n`: choices per request over HTTP (deployments/choices.py)
MAX_PROMPTS = 256  # prompts in one batched completions request, each its own engine request


class ChatCompletionRequest(SamplingFields, ChatOutputFields, ChatTemplateFields):
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices, each sampled on its own")
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include_reasoning: bool = Field(
        True,
        description="extension (vLLM's): false leaves a thinking model's reasoning out of the "
        "reply (the server's reasoning_parser still splits it off the content)",
    )
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
