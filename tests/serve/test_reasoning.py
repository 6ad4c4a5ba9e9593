"""vLLM's reasoning parsers: the splitter over texts cut at every position (tags split across
pieces), where each parser starts a reply, the structured outputs refused beside reasoning, the
whole and streamed chat bodies (tool calls read after the reasoning), an assistant's reasoning
reaching the template, and chats through the ingress over a real engine loop on CPU, without Ray."""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import replace

import pytest

import rayinfer
from rayinfer.deployments.chat_reasoning import ChatReasoning, reply_start
from rayinfer.deployments.choices import ChoiceLimit
from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.engine import Engine
from rayinfer.deployments.ingress import Ingress
from rayinfer.deployments.openai_error import OpenAIError
from rayinfer.deployments.pipeline import ColocatedPipeline
from rayinfer.deployments.prompts import PromptBuilder
from rayinfer.deployments.protocol import ChatCompletionRequest, CompletionRequest
from rayinfer.deployments.reasoning import AT_TAG, IN_REASONING, NO_REASONING, ReasoningSplitter
from rayinfer.deployments.replies import HttpReply
from rayinfer.deployments.runtime import ModelSource
from rayinfer.deployments.types import Delta, Timings
from rayinfer.engine.structured_output import StructuredOutput
from tests.serve.test_colocated_pipeline import Metrics
from tests.serve.test_engine_loop import new_loop
from tests.serve.test_protocol import collect_events, error_for, rendered_chat
from tests.serve.test_stop_reason import Handle, Stream, replica

USER = [{"role": "user", "content": "x"}]
IngressClass = Ingress.func_or_class.__mro__[1]  # the class under Serve's wrapper

# start, reply text, (reasoning, content) of the whole reply
SPLITS = [
    (IN_REASONING, "<think>Why? Because.</think>Yes", ("Why? Because.", "Yes")),
    (IN_REASONING, "Why? Because.</think>\n\nYes", ("Why? Because.", "\n\nYes")),
    (IN_REASONING, "\n <think>Why</think>Yes", ("Why", "Yes")),
    (IN_REASONING, "Why? Still thinking <", ("Why? Still thinking <", None)),  # no end tag
    (IN_REASONING, "Why</think>", ("Why", None)),
    (IN_REASONING, "<think></think>Yes", ("", "Yes")),
    (IN_REASONING, "a <think> b</think><think>c", ("a <think> b", "<think>c")),
    (IN_REASONING, "</thinker></think>Yes</think>", ("</thinker>", "Yes</think>")),
    (IN_REASONING, "<thi", ("<thi", None)),
    (IN_REASONING, "", ("", None)),
    (AT_TAG, "<think>Why</think>Yes", ("Why", "Yes")),
    (AT_TAG, "  <think>\nWhy</think>", ("\nWhy", None)),
    (AT_TAG, "<think>Why, cut off by max_tokens", ("Why, cut off by max_tokens", None)),
    (AT_TAG, "Yes</think> no <think>", (None, "Yes</think> no <think>")),
    (AT_TAG, "<thin", (None, "<thin")),
    (AT_TAG, "  ", (None, "  ")),
    (AT_TAG, "", (None, "")),
    (NO_REASONING, "<think>Why</think>Yes", (None, "<think>Why</think>Yes")),
]


def streamed(start: str, pieces) -> tuple[str, str]:
    splitter = ReasoningSplitter(start)
    parts = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
    return "".join(r for r, _ in parts), "".join(c for _, c in parts)


@pytest.mark.parametrize("start, text, expected", SPLITS)
def test_a_whole_reply_splits_as_vllms_message(start, text, expected):
    assert ReasoningSplitter(start).split(text) == expected


@pytest.mark.parametrize("start, text, expected", SPLITS)
def test_a_stream_cut_anywhere_splits_as_the_whole_reply(start, text, expected):
    whole = tuple(part or "" for part in expected)
    for cuts in itertools.combinations(range(len(text) + 1), 2):  # every one or two cuts
        pieces = [text[: cuts[0]], text[cuts[0] : cuts[1]], text[cuts[1] :]]
        assert streamed(start, pieces) == whole, pieces
    assert streamed(start, list(text)) == whole  # a character at a time


def test_a_stream_holds_back_only_what_may_still_be_a_tag():
    splitter = ReasoningSplitter(IN_REASONING)
    assert splitter.feed(" ") == ("", "")  # may still be whitespace before <think>
    assert splitter.feed("<th") == ("", "")
    assert splitter.feed("ink>Why <") == ("Why ", "")  # "<" may open </think>
    assert splitter.feed("b>") == ("<b>", "")
    assert splitter.feed("</thi") == ("", "")
    assert splitter.feed("nk>Ye") == ("", "Ye")
    assert splitter.feed("s <think>") == ("", "s <think>")  # content passes as it comes
    splitter = ReasoningSplitter(AT_TAG)
    assert splitter.feed("Sure") == ("", "Sure")
    assert splitter.finish() == ("", "")


@pytest.mark.parametrize(
    "parser, kwargs, tail, expected",
    [
        ("deepseek_r1", None, "<｜Assistant｜>", IN_REASONING),
        ("deepseek_r1", {"enable_thinking": False}, "<｜Assistant｜>", IN_REASONING),
        ("deepseek_v3", None, "<｜Assistant｜></think>", NO_REASONING),
        ("deepseek_v3", {"thinking": True}, "<｜Assistant｜><think>", IN_REASONING),
        ("deepseek_v3", {"enable_thinking": True}, "<｜Assistant｜>", IN_REASONING),
        ("deepseek_v3", None, "<｜Assistant｜><think>", IN_REASONING),  # the template opened it
        ("qwen3", None, "<|im_start|>assistant\n", AT_TAG),
        ("qwen3", {"enable_thinking": True}, "<|im_start|>assistant\n<think>\n", IN_REASONING),
        ("qwen3", {"enable_thinking": False}, "assistant\n<think>\n\n</think>\n\n", NO_REASONING),
        ("glm45", None, "<|assistant|><think>", IN_REASONING),  # GLM-4.7, GLM-5
        ("glm45", None, "<|assistant|>", AT_TAG),  # GLM-4.5
        ("glm45", {"enable_thinking": False}, "<|assistant|></think>", NO_REASONING),
    ],
)
def test_where_each_parser_starts_a_reply(parser, kwargs, tail, expected):
    assert reply_start(parser, kwargs, tail) == expected


@pytest.fixture(scope="module")
def prompts() -> PromptBuilder:
    return PromptBuilder(ModelSource.resolve(AppConfig(max_model_len=256)))


def start_for(prompts, parser: str, **fields) -> str:
    request = ChatCompletionRequest(**{"messages": USER, **fields})
    prompt_ids, _ = prompts.build(request)
    return ChatReasoning(parser, prompts.tokenizer).start_of(request, prompt_ids)


def test_the_rendered_prompt_tells_whether_the_template_opened_the_reasoning(prompts):
    assert start_for(prompts, "qwen3") == AT_TAG  # the tiny template ends "assistant\n"
    opened = [*USER, {"role": "assistant", "content": "<think>\n"}]
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    assert start_for(prompts, "qwen3", **{**continued, "messages": opened}) == IN_REASONING


SCHEMA = {"type": "object"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format",
        ),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
        ({"guided_choice": ["yes", "no"]}, "guided_choice"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": NAMED}, "tool_choice"),
    ],
)
def test_a_grammar_beside_reasoning_is_a_400_naming_its_field(prompts, fields, param):
    with pytest.raises(OpenAIError) as error:
        start_for(prompts, "qwen3", **fields)
    assert (error.value.status, error.value.param) == (400, param)
    assert error.value.message.startswith(f"{param}: cannot constrain a reply")
    assert '{"enable_thinking": false}' in error.value.message
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert start_for(prompts, "qwen3", **fields, **off) == NO_REASONING  # constrained from token 0
    assert start_for(prompts, "deepseek_v3", **fields) == NO_REASONING  # V3's default: no thinking


def test_free_replies_and_tools_auto_are_not_refused(prompts):
    assert start_for(prompts, "deepseek_r1", response_format={"type": "text"}) == IN_REASONING
    assert start_for(prompts, "deepseek_r1", tools=[WEATHER]) == IN_REASONING


# --- the reply bodies ------------------------------------------------------------------------
def reply(start: str | None, stream: bool, **fields) -> HttpReply:
    request = ChatCompletionRequest(**{"messages": USER, "stream": stream, **fields})
    return HttpReply("chatcmpl-1", "tiny", True, request, 3, reasoning_start=start)


async def pieces_of(text: str, cuts, finish_reason: str = "stop"):
    """The reply's text in pieces cut at `cuts`, one token each, the last with the finish."""
    bounds = [0, *cuts, len(text)]
    for i, (begin, end) in enumerate(itertools.pairwise(bounds)):
        last = i == len(bounds) - 2
        yield Delta(text[begin:end], [i], finish_reason if last else None)


def whole_message(reply: HttpReply, deltas) -> tuple[dict, str]:
    body = json.loads(json.dumps(asyncio.run(reply.whole(deltas, Timings()))))
    return body["choices"][0]["message"], body["choices"][0]["finish_reason"]


def stream_chunks(reply: HttpReply, deltas) -> list[dict]:
    return [body["choices"][0] for body in collect_events(reply, deltas) if body["choices"]]


def reassembled(chunks: list[dict]) -> dict:
    """What a client puts together from a stream's deltas (the role chunk's "" left out)."""
    out = {"reasoning_content": "", "reasoning": "", "content": "", "calls": {}}
    for chunk in chunks[1:]:
        delta = chunk["delta"]
        for key in ("reasoning_content", "reasoning", "content"):
            out[key] += delta.get(key) or ""
        for call in delta.get("tool_calls", []):
            entry = out["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call.get("function", {}).get("name") or ""
            entry["arguments"] += call.get("function", {}).get("arguments") or ""
    return out


TEXT = "<think>Two and two make four.</think>It is 4."


def test_whole_reply_carries_the_reasoning_beside_the_content():
    message, reason = whole_message(reply(IN_REASONING, False), pieces_of(TEXT, [5, 40]))
    assert message == {
        "role": "assistant",
        "content": "It is 4.",
        "reasoning_content": "Two and two make four.",
        "reasoning": "Two and two make four.",
    }
    assert reason == "stop"
    message, reason = whole_message(reply(IN_REASONING, False), pieces_of("Hmm, so", [], "length"))
    assert (message["reasoning_content"], message["content"], reason) == ("Hmm, so", None, "length")
    message, _ = whole_message(reply(NO_REASONING, False), pieces_of(TEXT, []))
    assert (message["reasoning_content"], message["content"]) == (None, TEXT)  # thinking off
    message, _ = whole_message(reply(None, False), pieces_of(TEXT, []))
    assert message == {"role": "assistant", "content": TEXT}  # no parser: as generated


@pytest.mark.parametrize("cuts", [[1, 4, 6], [30, 33, 36, 38], [37, 38], list(range(1, 46))])
def test_streamed_chunks_split_the_reasoning_where_tags_are_cut(cuts):
    chunks = stream_chunks(reply(IN_REASONING, True), pieces_of(TEXT, cuts))
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
    out = reassembled(chunks)
    assert out["reasoning_content"] == out["reasoning"] == "Two and two make four."
    assert out["content"] == "It is 4."
    for chunk in chunks[1:]:  # reasoning and content never share a delta
        assert not ("content" in chunk["delta"] and "reasoning" in chunk["delta"])
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]


@pytest.mark.parametrize("cuts", [[], [5, 40], list(range(1, 46))])
def test_include_reasoning_false_leaves_the_reasoning_out(cuts):
    message, _ = whole_message(
        reply(IN_REASONING, False, include_reasoning=False), pieces_of(TEXT, cuts)
    )
    assert (message["reasoning_content"], message["content"]) == (None, "It is 4.")
    chunks = stream_chunks(
        reply(IN_REASONING, True, include_reasoning=False), pieces_of(TEXT, cuts)
    )
    out = reassembled(chunks)
    assert (out["reasoning_content"], out["reasoning"], out["content"]) == ("", "", "It is 4.")
    assert chunks[-1]["finish_reason"] == "stop"


def test_continuous_usage_shows_tokens_held_back_as_a_possible_tag():
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream_chunks(
        reply(IN_REASONING, True, stream_options=options), pieces_of(TEXT, [30, 33, 36])
    )
    assert [c["delta"] for c in chunks[2:4]] == [{"content": ""}] * 2  # "</t", "hin": held
    bodies = collect_events(
        reply(IN_REASONING, True, stream_options=options), pieces_of(TEXT, [30, 33, 36])
    )
    assert [b["usage"]["completion_tokens"] for b in bodies] == [0, 1, 2, 3, 4, 4]


# A call written inside the reasoning is thought, not called; the content's call is read
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
THOUGHT_CALL = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
TOOL_TEXT = f"<think>Maybe {THOUGHT_CALL}? No.</think>\n\n<tool_call>\n{CALL}\n</tool_call>"


@pytest.mark.parametrize("cuts", [[], [9, 60, 75], list(range(1, len(TOOL_TEXT)))])
def test_tool_calls_are_read_in_the_content_after_the_reasoning(cuts):
    tools = {"tools": [WEATHER]}
    message, reason = whole_message(reply(IN_REASONING, False, **tools), pieces_of(TOOL_TEXT, cuts))
    assert reason == "tool_calls"
    assert message["reasoning_content"] == f"Maybe {THOUGHT_CALL}? No."
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        "get_weather",
        {"city": "Paris"},
    )
    chunks = stream_chunks(reply(IN_REASONING, True, **tools), pieces_of(TOOL_TEXT, cuts))
    out = reassembled(chunks)
    assert out["reasoning_content"] == message["reasoning_content"]
    assert out["content"].strip() == ""
    assert out["calls"] == {0: {"name": "get_weather", "arguments": call["function"]["arguments"]}}
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_completions_are_never_split():
    request = CompletionRequest(prompt="x")
    body = asyncio.run(
        HttpReply("cmpl-1", "tiny", False, request, 3, reasoning_start=IN_REASONING).whole(
            pieces_of(TEXT, []), Timings()
        )
    )
    assert body["choices"][0]["text"] == TEXT


# --- an assistant's reasoning in the request -------------------------------------------------
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:{% if m.reasoning_content %}<think>"
    "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}|{% endfor %}"
)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_an_assistants_reasoning_reaches_the_template(prompts, monkeypatch, field):
    messages = [
        {"role": "user", "content": "2+2?", field: "not mine"},  # a user's is dropped, as vLLM
        {"role": "assistant", "content": "4", field: "Two and two."},
        {"role": "user", "content": "Sure?"},
    ]
    text = rendered_chat(prompts, monkeypatch, THINKING_TEMPLATE, messages)
    assert text == "user:2+2?|assistant:<think>Two and two.</think>4|user:Sure?|"


def test_a_reasoning_that_is_not_text_is_a_400_naming_it():
    messages = [*USER, {"role": "assistant", "content": "4", "reasoning_content": ["x"]}]
    error = error_for(ChatCompletionRequest, {"messages": messages})
    assert error.param == "messages[1].reasoning_content"


# --- end to end: the ingress's chat path over a real engine loop -----------------------------
class WrittenPrompts(PromptBuilder):
    """The tiny model's prompts, the engine's params carrying a regex that makes the
    random-weights model write `text` (the request itself asks for no structured output)."""

    text = r"Two and two\.</think>\n\nIt is 4\."

    def build(self, request):
        prompt_ids, params = super().build(request)
        written = StructuredOutput("regex", self.text)
        return prompt_ids, replace(params, structured_output=written)


class ReasoningIngress(IngressClass):
    """The ingress's request path with deepseek_r1 (R1's template opened <think> in the prompt)
    over a colocated pipeline of one engine loop, without Serve."""

    def __init__(self, pipeline: ColocatedPipeline):
        self.source = ModelSource.resolve(AppConfig(max_model_len=128))
        self.prompts = WrittenPrompts(self.source)
        self.pipeline = pipeline
        self.choice_limit = ChoiceLimit(16, "engine.max_queued_requests")
        self.reasoning = ChatReasoning("deepseek_r1", self.prompts.tokenizer)

    def reply(self, **fields):
        request = ChatCompletionRequest(**{"messages": USER, "max_tokens": 40, **fields})
        return asyncio.run(self.reply_async(request))

    async def reply_async(self, request):
        response = await self._reply(request, "chatcmpl-1", chat=True)
        if not request.stream:
            return json.loads(response.body)
        events = [event async for event in response.body_iterator]
        return [json.loads(e[6:]) for e in events[:-1]]


@pytest.fixture(scope="module")
def ingress():
    llm = rayinfer.LLM("tiny", max_model_len=128, num_kv_blocks=64)
    loop = new_loop(llm)
    engine = replica(Engine, loop)
    pipeline = ColocatedPipeline(Handle(lambda r: Stream(engine._generate(r))), Metrics())
    yield ReasoningIngress(pipeline)
    loop.stop()


def test_a_chat_through_the_ingress_splits_whole_and_streamed(ingress):
    """The tiny tokenizer spells </think> over several tokens, each its own delta."""
    assert len(ingress.prompts.tokenizer.encode("</think>")) > 2
    choice = ingress.reply(temperature=0)["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"] == "Two and two."
    assert (message["content"], choice["finish_reason"]) == ("\n\nIt is 4.", "stop")
    chunks = [body["choices"][0] for body in ingress.reply(temperature=0, stream=True)]
    out = reassembled(chunks)
    assert (out["reasoning"], out["content"]) == ("Two and two.", "\n\nIt is 4.")
    assert sum("reasoning" in chunk["delta"] for chunk in chunks) > 5  # token by token
    choices = ingress.reply(temperature=0, n=2)["choices"]  # each choice its own splitter
    assert [c["message"]["reasoning"] for c in choices] == ["Two and two."] * 2
    with pytest.raises(OpenAIError) as error:
        ingress.reply(response_format={"type": "json_object"})
    assert (error.value.status, error.value.param) == (400, "response_format")
