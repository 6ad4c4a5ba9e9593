"""vLLM's `/tokenize` and `/detokenize`: a prompt's token ids without generating, and token ids
back to text. The ingress answers both with its tokenizer alone, no engine.

/tokenize takes a text (`prompt`, `add_special_tokens` default true) or a conversation
(`messages`, rendered as a chat completion renders it, with its `tools`,
`add_generation_prompt`, `continue_final_message` and `chat_template_kwargs`;
`add_special_tokens` default false, the template writing its own), never both. It answers
`{"count", "max_model_len", "tokens", "token_strs"}`: `token_strs` are the tokens' vocabulary
strings with `return_token_strs` true, else null. No length limit applies: it counts what a
prompt would be. /detokenize answers `{"prompt": text}` for `tokens`, special tokens kept in the
text, as vLLM's.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from rayinfer.deployments.chat_message import ChatMessage
from rayinfer.deployments.chat_template_fields import ChatTemplateFields
from rayinfer.deployments.openai_error import OpenAIError
from rayinfer.deployments.prompts import PromptBuilder
from rayinfer.deployments.request_body import STRICT, RequestBody
from rayinfer.deployments.structured_fields import ChatTool


class TokenizeRequest(ChatTemplateFields, RequestBody):
    model_config = STRICT

    model: str | None = None
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="a conversation, rendered as chat's; or prompt"
    )
    prompt: str | None = Field(
        None, validate_default=True, description="a text; or messages, not both"
    )
    tools: list[ChatTool] | None = Field(
        None, description="with messages: the functions the chat template shows"
    )
    add_special_tokens: bool | None = Field(
        None,
        description="the tokenizer's special tokens (a bos) on the text: by default true for "
        "prompt, false for messages (the chat template writes its own)",
    )
    return_token_strs: bool = Field(False, description="also the tokens' vocabulary strings")

    @field_validator("prompt")
    @classmethod
    def _prompt_or_messages(cls, value, info: ValidationInfo):
        if "messages" not in info.data:  # the messages were refused: their error is reported
            return value
        has_messages = info.data["messages"] is not None
        if value is None and not has_messages:
            raise ValueError("field required: send prompt (a text) or messages (a conversation)")
        if value is not None and has_messages:
            raise ValueError("send prompt or messages, not both")
        return value


class TokenizeResponse(BaseModel):
    count: int = Field(description="the number of tokens")
    max_model_len: int = Field(description="the model's context length, in tokens")
    tokens: list[int]
    token_strs: list[str] | None = Field(None, description="with return_token_strs")


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int] = Field(description="token ids, each in the vocabulary")


class DetokenizeResponse(BaseModel):
    prompt: str = Field(description="the tokens' text, special tokens included")


def tokenize(prompts: PromptBuilder, request: TokenizeRequest) -> TokenizeResponse:
    """The ids of the request's text or conversation; an OpenAIError (400) naming the field."""
    if request.messages is not None:
        tokenizer = _tokenizer(prompts, "messages")
        messages = [message.as_sent() for message in request.messages]
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools or ()]
        options = request.chat_options()
        add_special = bool(request.add_special_tokens)
        tokens = prompts.encode_chat(messages, tools or None, options, add_special)
    else:
        tokenizer = _tokenizer(prompts, "prompt")
        add_special = request.add_special_tokens is not False
        tokens = tokenizer.encode(request.prompt, add_special_tokens=add_special)
    return TokenizeResponse(
        count=len(tokens),
        max_model_len=prompts.max_model_len,
        tokens=tokens,
        token_strs=tokenizer.token_strings(tokens) if request.return_token_strs else None,
    )


def detokenize(prompts: PromptBuilder, request: DetokenizeRequest) -> DetokenizeResponse:
    """The text of the request's tokens; an OpenAIError (400) for an id outside the vocabulary."""
    tokenizer = _tokenizer(prompts, "tokens")
    vocab_size = tokenizer.vocab_size
    for index, token_id in enumerate(request.tokens):
        if not 0 <= token_id < vocab_size:
            raise OpenAIError(
                400,
                f"tokens: token ids must lie in [0, {vocab_size}); tokens[{index}] is {token_id}",
                param="tokens",
            )
    return DetokenizeResponse(prompt=tokenizer.decode(request.tokens, skip_special_tokens=False))


def _tokenizer(prompts: PromptBuilder, field: str):
    if prompts.tokenizer is None:
        raise OpenAIError(400, f"{field}: this model has no tokenizer", param=field)
    return prompts.tokenizer
