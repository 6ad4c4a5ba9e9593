"""vLLM's chat-template fields of a chat request (deployments/chat_template_fields.py): a bad
type or clash answers 400 naming the field, and the served prompt is rendered with them (no
server: the request model and the prompt builder, on the built-in model's tokenizer)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.openai_error import OpenAIError
from rayinfer.deployments.prompts import PromptBuilder
from rayinfer.deployments.protocol import ChatCompletionRequest
from rayinfer.deployments.runtime import ModelSource
from rayinfer.deployments.types import GenerateRequest
from tests.engine.test_chat_template import QWEN3_THINKING_TEMPLATE
from tests.serve.test_protocol import error_for

ASK = [{"role": "user", "content": "Tell me a story."}]
STORY = [*ASK, {"role": "assistant", "content": "Once upon"}]
ASKED = "<|im_start|>user\nTell me a story.<|im_end|>\n"
OPEN_STORY = {"messages": STORY, "add_generation_prompt": False, "continue_final_message": True}


@pytest.fixture(scope="module")
def prompts() -> PromptBuilder:
    return PromptBuilder(ModelSource.resolve(AppConfig(max_model_len=64)))


def chatml(prompts: PromptBuilder, text: str) -> list[int]:
    return prompts.tokenizer.encode(text, add_special_tokens=False)


def built_ids(prompts: PromptBuilder, body: dict) -> list[int]:
    return prompts.build(ChatCompletionRequest.model_validate(body))[0]


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"messages": ASK, "add_generation_prompt": "false"}, "add_generation_prompt", "boolean"),
        ({"messages": ASK, "continue_final_message": 1}, "continue_final_message", "boolean"),
        ({"messages": STORY, "continue_final_message": True}, "continue_final_message",
         "add_generation_prompt true"),
        ({"messages": ASK, "chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs",
         "dictionary"),
        ({"messages": ASK, "chat_template_kwargs": {"x": "\ud800"}}, "chat_template_kwargs.x",
         "surrogate"),
        ({"messages": ASK, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs",
         "'messages' is refused"),
        ({"messages": ASK, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs",
         "request's own tools"),
        ({"messages": ASK, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
         "chat_template_kwargs", "choose the chat template"),
        ({"messages": ASK, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs",
         "'tokenize' is refused"),
        ({"messages": ASK, "chat_template": "{{ 1 }}"}, "chat_template", "cannot choose"),
    ],
)  # fmt: skip
def test_bad_chat_template_fields_answer_400_naming_them(body, param, words):
    error = error_for(ChatCompletionRequest, body)
    assert error.status == 400 and error.param == param
    assert error.message.startswith(f"{param}: ") and words in error.message


def test_the_defaults_prompt_a_new_assistant_turn(prompts):
    request = ChatCompletionRequest.model_validate({"messages": ASK})
    assert (request.add_generation_prompt, request.continue_final_message) == (True, False)
    header = "<|im_start|>assistant\n"
    assert built_ids(prompts, {"messages": ASK}) == chatml(prompts, ASKED + header)
    no_header = {"messages": ASK, "add_generation_prompt": False}
    assert built_ids(prompts, no_header) == chatml(prompts, ASKED)


def test_continue_final_message_serves_the_assistant_message_open(prompts):
    prompt_ids, params = prompts.build(ChatCompletionRequest.model_validate(OPEN_STORY))
    assert prompt_ids == chatml(prompts, ASKED + "<|im_start|>assistant\nOnce upon")
    assert params.max_tokens == 64 - len(prompt_ids)


@pytest.mark.parametrize(
    "messages, template, words",
    [
        (ASK, None, "messages[0] is a user message"),
        (STORY, "{% for m in messages %}{{ m.content[:2] }}{% endfor %}", "drops or changes"),
    ],
    ids=["user-message-last", "template-cuts-the-content"],
)
def test_a_final_message_that_cannot_be_continued_is_400(
    prompts, monkeypatch, messages, template, words
):
    if template is not None:
        monkeypatch.setattr(prompts.tokenizer, "chat_templates", {"default": template})
    with pytest.raises(OpenAIError, match="^continue_final_message: ") as caught:
        built_ids(prompts, {**OPEN_STORY, "messages": messages})
    assert caught.value.status == 400 and caught.value.param == "continue_final_message"
    assert words in caught.value.message


def test_enable_thinking_reaches_a_qwen3_template(prompts, monkeypatch):
    monkeypatch.setattr(prompts.tokenizer, "chat_templates", {"default": QWEN3_THINKING_TEMPLATE})
    header = ASKED + "<|im_start|>assistant\n"
    thinking_off = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    assert built_ids(prompts, thinking_off) == chatml(prompts, header + "<think>\n\n</think>\n\n")
    thinking_on = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": True}}
    assert built_ids(prompts, thinking_on) == chatml(prompts, header)


def test_the_request_fields_win_over_the_same_names_in_chat_template_kwargs(prompts):
    """As vLLM merges them: the request's add_generation_prompt (default true) over
    chat_template_kwargs' false."""
    body = {"messages": ASK, "chat_template_kwargs": {"add_generation_prompt": False}}
    assert built_ids(prompts, body) == built_ids(prompts, {"messages": ASK})


def test_a_template_variable_the_template_cannot_use_is_400(prompts, monkeypatch):
    template = "{{ bos_token + messages[0].content }}"
    monkeypatch.setattr(prompts.tokenizer, "chat_templates", {"default": template})
    expected = chatml(prompts, "<|begin_of_text|>" + ASK[0]["content"])
    assert built_ids(prompts, {"messages": ASK}) == expected
    with pytest.raises(OpenAIError, match="^messages: ") as caught:
        built_ids(prompts, {"messages": ASK, "chat_template_kwargs": {"bos_token": 5}})
    assert caught.value.status == 400


def test_a_handles_messages_take_the_same_fields(prompts, monkeypatch):
    """A Python handle's GenerateRequest renders its messages as the chat request does."""
    handle = GenerateRequest(**OPEN_STORY)
    assert prompts.build(handle)[0] == built_ids(prompts, OPEN_STORY)
    monkeypatch.setattr(prompts.tokenizer, "chat_templates", {"default": QWEN3_THINKING_TEMPLATE})
    thinking_off = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    assert prompts.build(GenerateRequest(**thinking_off))[0] == built_ids(prompts, thinking_off)
    with pytest.raises(ValidationError, match="continue_final_message"):
        GenerateRequest(messages=STORY, continue_final_message=True)  # with the generation prompt
