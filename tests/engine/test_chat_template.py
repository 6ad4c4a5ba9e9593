"""Chat template rendering against transformers' `apply_chat_template` on checkpoints built
locally: a final message left open (`continue_final_message`) and template variables
(`chat_template_kwargs`, Qwen3's `enable_thinking`)."""

import copy

import pytest

from rayinfer.engine.sampling_params import InvalidRequestError
from tests.engine.test_tokenizer import (
    CHATML_TEMPLATE,
    load_both,
    save_chatml_style,
    save_llama3_style,
)

transformers = pytest.importorskip("transformers")

# The end of Qwen3's template: the generation prompt, and an empty thinking block when the
# caller turns thinking off (`enable_thinking` false).
QWEN3_THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
PARTS_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{% for part in m.content %}{{ part.text }}"
    "{% endfor %}</{{ m.role }}>{% endfor %}"
)
UNFINISHED = [
    [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once"}],
    # trailing space: a template that trims content (Llama 3's) trims the open end too
    [{"role": "user", "content": "Say 4"}, {"role": "assistant", "content": "4 is four, "}],
    [
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "4?"},
        {"role": "assistant", "content": "4"},
    ],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}],
]


@pytest.fixture(params=["chatml", "llama3-trims-content"])
def both(request, tmp_path):
    save = save_chatml_style if request.param == "chatml" else save_llama3_style
    return load_both(save(tmp_path))


@pytest.mark.parametrize("messages", UNFINISHED)
def test_continue_final_message_matches_transformers(both, messages):
    ours, hf = both
    given = copy.deepcopy(messages)
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    rendered = ours.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert rendered == expected
    assert rendered.rstrip().endswith(messages[-1]["content"].rstrip())
    ids = ours.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert ids == ours.encode(expected, add_special_tokens=False)
    assert messages == given


def test_continue_final_message_ends_in_the_last_text_part(tmp_path):
    ours, hf = load_both(save_chatml_style(tmp_path, chat_template=PARTS_TEMPLATE))
    parts = [{"type": "text", "text": "Once"}, {"type": "image"}, {"type": "text", "text": " up"}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "go"}]},
                {"role": "assistant", "content": parts}]  # fmt: skip
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert expected == "<user>go</user><assistant>Once up"
    assert ours.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True
    ) == expected  # fmt: skip


@pytest.mark.parametrize(
    "template, messages, add_prompt, reason",
    [
        (CHATML_TEMPLATE, UNFINISHED[0], True, "add_generation_prompt"),
        (CHATML_TEMPLATE, [], False, "no message to continue"),
        (CHATML_TEMPLATE, [{"role": "assistant", "content": None, "tool_calls": [{}]}], False,
         "no content"),
        ("{% for m in messages %}{{ m.role }}{% endfor %}", UNFINISHED[0], False,
         "never reads"),
        ("{% for m in messages %}{{ m.content[:2] }}{% endfor %}", UNFINISHED[0], False,
         "drops or changes"),
    ],
    ids=["with-generation-prompt", "empty", "no-content", "content-unread", "content-cut"],
)  # fmt: skip
def test_a_final_message_that_cannot_be_left_open_is_refused_as_transformers_does(
    tmp_path, template, messages, add_prompt, reason
):
    ours, hf = load_both(save_chatml_style(tmp_path, chat_template=template))
    with pytest.raises(ValueError):
        hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_prompt, continue_final_message=True
        )
    with pytest.raises(InvalidRequestError, match=reason) as caught:
        ours.apply_chat_template(
            messages, add_generation_prompt=add_prompt, continue_final_message=True
        )
    assert caught.value.field == "continue_final_message"


@pytest.mark.parametrize(
    "variables",
    [{}, {"enable_thinking": False}, {"enable_thinking": True}, {"unread": [1, {"x": None}]}],
)
def test_template_variables_reach_the_template_as_in_transformers(tmp_path, variables):
    ours, hf = load_both(save_chatml_style(tmp_path, chat_template=QWEN3_THINKING_TEMPLATE))
    messages = [{"role": "user", "content": "2+2?"}]
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **variables
    )
    assert ours.apply_chat_template(messages, **variables) == expected
    thinks_not = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert expected.endswith(thinks_not) == (variables.get("enable_thinking") is False)
    ids = ours.encode_chat(messages, template_kwargs=variables)
    assert ids == ours.encode(expected, add_special_tokens=False)


def test_template_variables_override_special_tokens_and_documents(tmp_path):
    template = "{{ bos_token }}|{{ documents | tojson }}|{{ messages[0].content }}"
    ours, hf = load_both(save_llama3_style(tmp_path, chat_template=template))
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == "<|begin_of_text|>|null|hi"
    variables = {"bos_token": "<s>", "documents": [{"title": "t", "text": "x"}]}
    expected = hf.apply_chat_template(messages, tokenize=False, bos_token="<s>")
    assert expected == "<s>|null|hi"  # transformers takes documents as its own argument
    assert ours.apply_chat_template(messages, **variables) == (
        '<s>|[{"title": "t", "text": "x"}]|hi'
    )
    assert ours.encode_chat(messages, add_special_tokens=True)[0] == ours.bos_token_id
