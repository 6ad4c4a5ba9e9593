"""A conversation's prompt ids as offline `LLM.chat` and the server both make them: vLLM's chat
options checked (the field at fault named), template variables, a final message left open, and
tool calls' arguments parsed for the template; on the built-in model's tokenizer."""

import json

import pytest

from rayinfer.engine.chat_prompt import ChatOptions, encode_conversation, template_variables
from rayinfer.engine.sampling_params import InvalidRequestError
from rayinfer.engine.template_messages import template_messages
from rayinfer.engine.tokenizer import Tokenizer
from rayinfer.models.tiny import ensure_tiny_model
from tests.engine.test_chat_template import QWEN3_THINKING_TEMPLATE

STORY = [
    {"role": "user", "content": "Tell me a story."},
    {"role": "assistant", "content": "Once upon"},
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(ensure_tiny_model())


def chatml(text: str, tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_default_options_prompt_a_new_assistant_turn(tokenizer):
    options = ChatOptions.checked()
    assert options == ChatOptions(True, False, {})
    ids = encode_conversation(tokenizer, STORY[:1], options=options)
    assert ids == chatml("<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n",
                         tokenizer)  # fmt: skip
    no_header = ChatOptions.checked(add_generation_prompt=False)
    assert encode_conversation(tokenizer, STORY[:1], options=no_header) == chatml(
        "<|im_start|>user\nTell me a story.<|im_end|>\n", tokenizer
    )


def test_continue_final_message_leaves_the_assistant_message_open(tokenizer):
    options = ChatOptions.checked(add_generation_prompt=False, continue_final_message=True)
    ids = encode_conversation(tokenizer, STORY, options=options)
    expected = "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\nOnce upon"
    assert ids == chatml(expected, tokenizer)
    with pytest.raises(InvalidRequestError, match=r"messages\[0\] is a user message") as caught:
        encode_conversation(tokenizer, STORY[:1], options=options)
    assert caught.value.field == "continue_final_message"


@pytest.mark.parametrize(
    "given, field, reason",
    [
        (dict(continue_final_message=True), "continue_final_message", "add_generation_prompt"),
        (dict(add_generation_prompt="yes"), "add_generation_prompt", "true or false"),
        (dict(continue_final_message=1), "continue_final_message", "true or false"),
        (dict(chat_template_kwargs=["enable_thinking"]), "chat_template_kwargs", "an object"),
        (dict(chat_template_kwargs={1: True}), "chat_template_kwargs", "variable names"),
        (dict(chat_template_kwargs={"messages": []}), "chat_template_kwargs", "'messages'"),
        (dict(chat_template_kwargs={"tools": []}), "chat_template_kwargs", "'tools'"),
        (dict(chat_template_kwargs={"chat_template": "x"}), "chat_template_kwargs", "choose"),
        (dict(chat_template_kwargs={"tokenize": False}), "chat_template_kwargs", "'tokenize'"),
    ],
)
def test_bad_options_name_the_field(given, field, reason):
    with pytest.raises(InvalidRequestError, match=reason) as caught:
        ChatOptions.checked(**given)
    assert caught.value.field == field


def test_the_request_fields_win_over_their_names_in_the_template_variables(tokenizer):
    """As vLLM merges them: chat_template_kwargs' add_generation_prompt and
    continue_final_message are left out for the request's own."""
    given = {"add_generation_prompt": False, "continue_final_message": True, "x": 1}
    assert template_variables(given) == {"x": 1}
    options = ChatOptions.checked(chat_template_kwargs=given)
    assert options.add_generation_prompt and not options.continue_final_message
    assert encode_conversation(tokenizer, STORY[:1], options=options) == encode_conversation(
        tokenizer, STORY[:1]
    )


def test_enable_thinking_reaches_a_qwen3_template(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_templates", {"default": QWEN3_THINKING_TEMPLATE})
    header = "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    messages = [{"role": "user", "content": "2+2?"}]
    for variables, text in [
        (None, header),
        ({"enable_thinking": True}, header),
        ({"enable_thinking": False}, header + "<think>\n\n</think>\n\n"),
    ]:
        options = ChatOptions.checked(chat_template_kwargs=variables)
        assert encode_conversation(tokenizer, messages, options=options) == chatml(text, tokenizer)


def test_template_messages_parse_only_an_assistant_calls_json_object():
    """A handle's messages are not shape-checked: what is not an assistant's call with text
    arguments stays as given, and the given messages stay as they were."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    odd = [
        {"role": "user", "tool_calls": [call]},
        {"role": "assistant", "tool_calls": "x"},
        {"role": "assistant", "tool_calls": [7, {"function": None}, {"function": {"name": "f"}}]},
        {"role": "assistant", "tool_calls": [{"function": {"arguments": {"a": 1}}}]},
    ]
    assert template_messages(odd) == odd
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    parsed = template_messages(messages)[0]["tool_calls"][0]["function"]["arguments"]
    assert parsed == {"a": 1} and str(parsed) == '{"a":1}' and "<" + parsed + ">" == '<{"a":1}>'
    assert json.dumps(parsed) == '{"a": 1}'
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"a":1}'
