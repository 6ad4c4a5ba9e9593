"""vLLM's chat-template fields of a request that holds a conversation (chat completions, and
/tokenize's chat form): how its messages are rendered. Their types and their clashes answer 400
naming the field here; engine/chat_prompt.py renders with them, as offline `LLM.chat` does.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from rayinfer.deployments.request_body import STRICT
from rayinfer.engine.chat_prompt import ChatOptions, template_variables
from rayinfer.engine.sampling_params import InvalidRequestError


class ChatTemplateFields(BaseModel):
    model_config = STRICT

    add_generation_prompt: bool = Field(
        True,
        description="extension (vLLM's): end the prompt with the template's header of a new "
        "assistant turn",
    )
    continue_final_message: bool = Field(
        False,
        description="extension (vLLM's): end the prompt inside the last message, an "
        "assistant's, for the model to continue it; needs add_generation_prompt false",
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None,
        description="extension (vLLM's): more variables for the chat template, e.g. "
        '{"enable_thinking": false}; messages, tools, chat_template and tokenize are refused, '
        "add_generation_prompt and continue_final_message are the request's own fields",
    )
    chat_template: str | None = Field(
        None, description="extension (vLLM's): not supported; the checkpoint's template renders"
    )

    @field_validator("chat_template")
    @classmethod
    def _no_request_template(cls, value):
        """vLLM too refuses a request's template unless its server trusts them."""
        if value is not None:
            raise ValueError("a request cannot choose the chat template; leave it out")
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _not_with_generation_prompt(cls, value: bool, info: ValidationInfo) -> bool:
        adds_prompt = info.data.get("add_generation_prompt", True)
        _as_value_error(ChatOptions.checked, adds_prompt, value)
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value):
        _as_value_error(template_variables, value)
        return value

    def chat_options(self) -> ChatOptions:
        return ChatOptions.checked(
            self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs
        )


def _as_value_error(check, *args) -> None:
    """The engine's check, its reason as pydantic's ValueError (pydantic names the field)."""
    try:
        check(*args)
    except InvalidRequestError as error:
        raise ValueError(error.reason) from None
