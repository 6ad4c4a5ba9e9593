"""Tokenizer against transformers' PreTrainedTokenizerFast on checkpoints built locally."""

import json

import jinja2
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from rayinfer.engine.tokenizer import NoTokenizerError, Tokenizer, TokenizerError

transformers = pytest.importorskip("transformers")

LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today? I am fine, thank you!",
    "Mixture of experts models route every token to a few experts.",
    "Numbers 1234 and 56.78, symbols #@!, and    spaces.",
] * 4

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
# Written over many indented lines: only trim_blocks + lstrip_blocks render it as transformers does.
FEATURE_TEMPLATE = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = 'Year ' + strftime_now('%Y') %}
{%- endif %}
<|im_start|>system
{{ system }}
{% if tools %}
{{ tools | tojson }}
{% endif %}
<|im_end|>
{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message['content'] == 'SKIP' %}
        {% continue %}
    {% endif %}
    {% set ns.count = ns.count + 1 %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant ({{ ns.count }})
{% endif %}
"""
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TEXTS = [
    "Hello world",
    "The quick brown fox.  Two  spaces\tand a tab\nand a newline",
    "naïve café, 你好世界, emoji 🙂👍🏽 and 👨‍👩‍👧",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "<|begin_of_text|>text after bos",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "  What is 2+2?  "},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And in 中文? 🙂"},
    ],
    [{"role": "user", "content": "SKIP"}, {"role": "user", "content": "counted", "name": None}],
]


def train_byte_level_bpe(special_tokens: list[str]) -> BackendTokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return backend


def save_llama3_style(folder, chat_template=LLAMA3_TEMPLATE):
    """Llama-3 layout: bos added by tokenizer.json's post-processor, template in a .jinja file."""
    backend = train_byte_level_bpe(LLAMA3_SPECIALS)
    backend.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[("<|begin_of_text|>", 0)],
            ),
        ]
    )
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        chat_template=chat_template,
    )
    hf.save_pretrained(folder)
    return folder


def save_chatml_style(folder, **config_overrides):
    """Qwen layout: no bos, ByteLevel post-processor, template in tokenizer_config.json."""
    backend = train_byte_level_bpe(CHATML_SPECIALS)
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": {"content": "<|im_end|>", "special": True, "__type": "AddedToken"},
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
    }
    config.update(config_overrides)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def load_both(folder):
    return Tokenizer.from_pretrained(folder), transformers.AutoTokenizer.from_pretrained(folder)


def assert_same_as_transformers(ours: Tokenizer, hf) -> None:
    for text in TEXTS:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == hf.encode(text, add_special_tokens=add_special), (text, add_special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                    ids, skip_special_tokens=skip
                )
    for messages in CONVERSATIONS:
        for add_prompt in (True, False):
            expected = hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_prompt
            )
            assert ours.apply_chat_template(messages, add_generation_prompt=add_prompt) == expected
        expected_ids = hf.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=False
        )
        assert ours.encode_chat(messages) == list(expected_ids)


def test_llama3_style_matches_transformers(tmp_path):
    ours, hf = load_both(save_llama3_style(tmp_path))
    assert_same_as_transformers(ours, hf)
    assert ours.encode("Hi")[0] == ours.bos_token_id == 0
    assert ours.eos_token_ids == {hf.eos_token_id}
    assert ours.all_special_ids == {0, 1, 2, 3, 4}  # every added token marked special


def test_chatml_style_with_dict_tokens_matches_transformers(tmp_path):
    ours, hf = load_both(save_chatml_style(tmp_path))
    assert_same_as_transformers(ours, hf)
    assert ours.bos_token_id is None
    assert ours.eos_token_ids == {hf.convert_tokens_to_ids("<|im_end|>")}


@pytest.mark.parametrize("add_bos, add_eos", [(True, False), (True, True), (False, False)])
def test_add_bos_token_flags_defer_to_tokenizer_json(tmp_path, add_bos, add_eos):
    """transformers 5 drops add_bos_token/add_eos_token when tokenizer.json exists; so do we."""
    folder = save_chatml_style(
        tmp_path, bos_token="<|endoftext|>", add_bos_token=add_bos, add_eos_token=add_eos
    )
    ours, hf = load_both(folder)
    assert_same_as_transformers(ours, hf)
    ids = ours.encode("Hello")
    assert ids[0] != ours.bos_token_id and ids[-1] not in ours.eos_token_ids


def test_helpers_and_whitespace_control_match_transformers(tmp_path):
    ours, hf = load_both(save_llama3_style(tmp_path, chat_template=FEATURE_TEMPLATE))
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {}}}]
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(messages, tools=tools, tokenize=False)
        assert ours.apply_chat_template(messages, add_generation_prompt=False, tools=tools) == (
            expected
        )
        assert ours.apply_chat_template(messages) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    assert "météo" in ours.apply_chat_template(CONVERSATIONS[0], tools=tools)  # no \\u escapes
    bad_role = [{"role": "robot", "content": "beep"}]
    with pytest.raises(jinja2.TemplateError, match="unknown role robot"):
        ours.apply_chat_template(bad_role)


def test_reasoning_fields_are_aliased_as_in_transformers(tmp_path):
    template = (
        "{% for m in messages %}[{{ m.reasoning_content }}|{{ m.thinking }}]{{ m.content }}"
        "{% endfor %}"
    )
    ours, hf = load_both(save_chatml_style(tmp_path, chat_template=template))
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning": "because", "tool_calls": None},
    ]
    expected = hf.apply_chat_template(messages, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == expected
    assert expected == "[|]q[because|because]a"


def test_named_templates_in_tokenizer_config(tmp_path):
    templates = [
        {"name": "default", "template": CHATML_TEMPLATE},
        {"name": "tool_use", "template": "TOOLS {{ tools | length }}"},
    ]
    ours, hf = load_both(save_chatml_style(tmp_path, chat_template=templates))
    messages = CONVERSATIONS[1]
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(messages, tools=tools) == "TOOLS 1"
    assert ours.apply_chat_template(messages, chat_template="tool_use", tools=[]) == "TOOLS 0"


def test_template_files_win_over_tokenizer_config(tmp_path):
    folder = save_chatml_style(tmp_path)
    (folder / "chat_template.jinja").write_text("FILE {{ messages | length }}")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "short.jinja").write_text("SHORT")
    ours, hf = load_both(folder)
    messages = CONVERSATIONS[1]
    assert ours.apply_chat_template(messages) == "FILE 4"
    assert ours.apply_chat_template(messages, chat_template="short") == "SHORT"
    assert hf.apply_chat_template(messages, tokenize=False, chat_template="short") == "SHORT"


def test_several_templates_without_default_name_them(tmp_path):
    templates = [{"name": "a", "template": "A"}, {"name": "b", "template": "B"}]
    ours = Tokenizer.from_pretrained(save_chatml_style(tmp_path, chat_template=templates))
    with pytest.raises(TokenizerError, match=r"chat_template= one of \['a', 'b'\]"):
        ours.apply_chat_template(CONVERSATIONS[0])


def test_eos_ids_come_from_all_checkpoint_files(tmp_path):
    folder = save_chatml_style(tmp_path)
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    assert Tokenizer.from_pretrained(folder).eos_token_ids == {0, 1, 2}


def test_missing_tokenizer_json_names_the_fix(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(NoTokenizerError, match="has no tokenizer.json; pass token ids"):
        Tokenizer.from_pretrained(tmp_path)


def test_missing_chat_template_names_the_fix(tmp_path):
    ours = Tokenizer.from_pretrained(save_chatml_style(tmp_path, chat_template=None))
    assert ours.encode("Hello")  # plain prompts still work
    with pytest.raises(TokenizerError, match="has no chat template"):
        ours.apply_chat_template(CONVERSATIONS[0])


def test_tokens_only_in_tokenizer_config_are_added(tmp_path):
    added = {
        "990": {"content": "<tool_call>", "special": False, "normalized": False},
        "991": {"content": "<|secret|>", "special": True, "normalized": False},
    }
    ours, hf = load_both(save_chatml_style(tmp_path, added_tokens_decoder=added))
    text = "call <tool_call> then <|secret|> done"
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert (
        ours.decode(ids)
        == hf.decode(ids, skip_special_tokens=True)
        == "call <tool_call> then  done"
    )


@pytest.mark.parametrize("save", [save_llama3_style, save_chatml_style])
def test_encode_last_matches_transformers_left_truncation(tmp_path, save):
    ours, hf = load_both(save(tmp_path))
    hf.truncation_side = "left"
    for text in TEXTS:
        for max_tokens in (1, 3, 8, 1000):
            expected = hf(text, truncation=True, max_length=max_tokens)["input_ids"]
            assert ours.encode_last(text, max_tokens) == expected, (text, max_tokens)
