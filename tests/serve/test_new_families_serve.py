"""`serve run rayinfer.app:build model=<folder>` on CPU for the newest families: tiny random
checkpoints made by transformers, with the built-in model's tokenizer and chat template beside
them; the openai client's answers equal the offline engine's on the same folder, whole and
streamed.
- GLM-5: DeepSeek Sparse Attention with full and shared indexer layers, index_topk below the
  prompts;
- DeepSeek-V4: sliding-window, CSA and HCA layers with a window and compression rates the
  prompts cross, and a hash-routed MoE layer.
Each folder's chat template shows the tools in the family's call format (GLM's <arg_key> tags,
V4's DSML), so the server reads `auto` calls in it: a call a regex makes the model write comes
back as `tool_calls`, and streams its name first, then its arguments as they are written."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

import rayinfer
from rayinfer.engine.tokenizer import Tokenizer
from rayinfer.models.tiny import VOCAB_SIZE, ensure_tiny_model
from tests.models.harness import make_dsa_checkpoint, make_v4_checkpoint
from tests.serve.streamed_calls import read_stream

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Once upon a time"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
MAX_MODEL_LEN = 512  # room for a DSML call written about a token a character
# The family's call format, as its template would teach it; then the tiny model's own template.
TOOLS_SHOWN = {
    "glm5": "<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>",
    "deepseek_v4": '<｜DSML｜tool_calls><｜DSML｜invoke name="NAME"><｜DSML｜parameter name="KEY" '
    'string="true|false">VALUE</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>',
}
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nCall a function as FORMAT. Functions: {%- for tool in "
    "tools %} {{ tool.function.name }}{%- endfor %}<|im_end|>\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
}}}  # fmt: skip
# A call in the family's format after some text, for the grammar to make the model write
AUTO_CALLS = {
    "glm5": r"Let me check\.<tool_call>get_weather<arg_key>city</arg_key><arg_value>[a-z]{3,6}"
    r"</arg_value><arg_key>days</arg_key><arg_value>[1-9]</arg_value></tool_call>",
    "deepseek_v4": "Let me check\\.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke "
    'name="get_weather">\n<｜DSML｜parameter name="city" string="true">[a-z]{3,6}'
    '</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">[1-9]'
    "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
}


@pytest.fixture(scope="module", params=["glm5", "deepseek_v4"])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def folder(family, tmp_path_factory):
    folder = tmp_path_factory.mktemp(family)
    if family == "glm5":
        make_dsa_checkpoint(
            folder,
            "glm_moe_dsa",
            vocab_size=VOCAB_SIZE,
            indexer_types=["full", "shared", "full"],
            max_position_embeddings=MAX_MODEL_LEN,
        )
    else:
        make_v4_checkpoint(folder, vocab_size=VOCAB_SIZE)
    for name in TOKENIZER_FILES:
        shutil.copy(ensure_tiny_model() / name, folder / name)
    tiny_template = Tokenizer.from_pretrained(ensure_tiny_model()).chat_templates["default"]
    shown = TEMPLATE.replace("FORMAT", TOOLS_SHOWN[family])
    (folder / "chat_template.jinja").write_text(shown + tiny_template, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def client(folder, serve_app):
    """Each family's app is a new `serve run` on the cluster shared through
    tests/serve/conftest.py."""
    app_args = [f"model={folder}", "served_model_name=tiny-new", f"max_model_len={MAX_MODEL_LEN}"]
    cluster = serve_app(app_args)
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", timeout=120)


def test_completions_equal_the_offline_engine(client, folder):
    offline = rayinfer.LLM(str(folder), device="cpu", max_model_len=MAX_MODEL_LEN)
    params = rayinfer.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for prompt, expected in zip(PROMPTS, offline.generate(PROMPTS, params)):
        reply = client.completions.create(
            model="tiny-new",
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].text == expected.text
        assert reply.usage.completion_tokens == 12


def test_chat_streams_what_it_answers_whole(client):
    question = dict(
        model="tiny-new",
        messages=[{"role": "user", "content": "Tell me about the river and the mountains."}],
        max_tokens=10,
        temperature=0,
    )
    whole = client.chat.completions.create(**question)
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(**question, stream=True)
        if chunk.choices
    )
    assert whole.usage.prompt_tokens > 6  # the selection matters: more tokens than index_topk
    assert streamed == whole.choices[0].message.content


def test_an_auto_call_in_the_familys_format_comes_back_as_tool_calls(client, family):
    question = dict(
        model="tiny-new",
        messages=[{"role": "user", "content": "The weather in a city, please."}],
        tools=[WEATHER],
        seed=3,
        extra_body={"structured_outputs": {"regex": AUTO_CALLS[family]}},
    )
    whole = client.chat.completions.create(**question).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    (call,) = whole.message.tool_calls
    arguments = json.loads(call.function.arguments)  # city typed string, days a number
    assert call.function.name == "get_weather" and sorted(arguments) == ["city", "days"]
    assert isinstance(arguments["city"], str) and isinstance(arguments["days"], int)
    streamed = read_stream(client.chat.completions.create(**question, stream=True))
    assert streamed.content == "Let me check." and streamed.finish_reasons == ["tool_calls"]
    (streamed_call,) = streamed.calls
    assert (streamed_call.name, streamed_call.arguments) == ("get_weather", call.function.arguments)
    assert max(streamed.content_chunks) < streamed_call.head_chunk
    assert streamed_call.head_chunk < streamed_call.argument_chunks[0]
    # several fragments (fewer than tokens where a loaded server coalesces a stream's tokens)
    assert len(streamed_call.argument_chunks) >= 2
