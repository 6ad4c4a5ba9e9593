"""vLLM's /tokenize and /detokenize (deployments/tokenization.py) through the ingress's route
methods, called directly on an ingress that has the built-in model's tokenizer and no engine;
and their request bodies' 400s naming the field."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.ingress import Ingress, app
from rayinfer.deployments.openai_error import OpenAIError
from rayinfer.deployments.prompts import PromptBuilder
from rayinfer.deployments.protocol import ChatCompletionRequest
from rayinfer.deployments.runtime import ModelSource
from rayinfer.deployments.tokenization import DetokenizeRequest, TokenizeRequest
from tests.serve.test_protocol import error_for

IngressClass = Ingress.func_or_class.__mro__[1]  # the class as written, without Serve's wrapper
TEXT = "Tell me about the river."
ASK = [{"role": "user", "content": TEXT}]
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}


class TokenizerIngress(IngressClass):
    """The ingress with its model source and prompt builder alone: no pipeline, no engine."""

    def __init__(self, source: ModelSource):
        self.source = source
        self.prompts = PromptBuilder(source)


@pytest.fixture(scope="module")
def ingress() -> TokenizerIngress:
    return TokenizerIngress(ModelSource.resolve(AppConfig(max_model_len=256)))


def tokenize(ingress, body: dict) -> dict:
    request = TokenizeRequest.model_validate(body)
    http = SimpleNamespace(state=SimpleNamespace())
    return asyncio.run(ingress.tokenize(request, http)).model_dump()


def detokenize(ingress, body: dict) -> dict:
    request = DetokenizeRequest.model_validate(body)
    http = SimpleNamespace(state=SimpleNamespace())
    return asyncio.run(ingress.detokenize(request, http)).model_dump()


def test_a_prompt_is_tokenized_as_completions_encode_it(ingress):
    tokenizer = ingress.prompts.tokenizer
    reply = tokenize(ingress, {"model": "tiny", "prompt": TEXT})
    assert reply == {"count": len(reply["tokens"]), "max_model_len": 256,
                     "tokens": tokenizer.encode(TEXT), "token_strs": None}  # fmt: skip
    assert reply["tokens"][0] == tokenizer.bos_token_id
    bare = tokenize(ingress, {"prompt": TEXT, "add_special_tokens": False})
    assert bare["tokens"] == reply["tokens"][1:]
    strs = tokenize(ingress, {"prompt": TEXT, "return_token_strs": True})["token_strs"]
    assert strs[0] == "<|begin_of_text|>" and len(strs) == reply["count"]
    assert "".join(strs[1:]).replace("Ġ", " ") == TEXT  # byte-level BPE: Ġ is a space
    long = tokenize(ingress, {"prompt": TEXT * 100})  # counted beyond max_model_len
    assert long["count"] > 256


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"tools": [WEATHER]},
        {"messages": [*ASK, {"role": "assistant", "content": "The river"}],
         "add_generation_prompt": False, "continue_final_message": True},
        {"add_generation_prompt": False, "chat_template_kwargs": {"enable_thinking": False}},
    ],
    ids=["plain", "tools", "continued", "template-fields"],
)  # fmt: skip
def test_messages_are_tokenized_as_a_chat_completion_prompts_them(ingress, fields):
    body = {"messages": ASK, **fields}
    chat_ids, _ = ingress.prompts.build(ChatCompletionRequest.model_validate(body))
    reply = tokenize(ingress, body)
    assert reply["tokens"] == chat_ids and reply["count"] == len(chat_ids)
    with_bos = tokenize(ingress, {**body, "add_special_tokens": True})["tokens"]
    assert with_bos == [ingress.prompts.tokenizer.bos_token_id, *chat_ids]


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": TEXT, "messages": ASK}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "a\ud800"}, "prompt"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"prompt": TEXT, "add_special_tokens": "no"}, "add_special_tokens"),
        ({"prompt": TEXT, "return_token_strs": 1}, "return_token_strs"),
        ({"messages": ASK, "continue_final_message": True}, "continue_final_message"),
        ({"messages": ASK, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"messages": ASK, "tools": [{"type": "function"}]}, "tools[0].function"),
    ],
)
def test_bad_tokenize_bodies_answer_400_naming_the_field(body, param):
    error = error_for(TokenizeRequest, body)
    assert error.status == 400 and error.param == param
    assert error.message.startswith(f"{param}: ")


def test_a_conversation_that_cannot_be_continued_is_400(ingress):
    body = {"messages": ASK, "add_generation_prompt": False, "continue_final_message": True}
    with pytest.raises(OpenAIError, match=r"messages\[0\] is a user message") as caught:
        tokenize(ingress, body)
    assert caught.value.status == 400 and caught.value.param == "continue_final_message"


def test_tokens_are_detokenized_with_their_special_tokens(ingress):
    tokens = tokenize(ingress, {"prompt": TEXT})["tokens"]
    assert detokenize(ingress, {"model": "tiny", "tokens": tokens}) == {
        "prompt": "<|begin_of_text|>" + TEXT
    }
    assert detokenize(ingress, {"tokens": tokens[1:]}) == {"prompt": TEXT}
    assert detokenize(ingress, {"tokens": []}) == {"prompt": ""}


@pytest.mark.parametrize("bad", [-1, "vocab", 2**70])
def test_token_ids_outside_the_vocabulary_are_400_naming_tokens(ingress, bad):
    vocab_size = ingress.prompts.tokenizer.vocab_size
    bad = vocab_size if bad == "vocab" else bad
    with pytest.raises(OpenAIError) as caught:
        detokenize(ingress, {"tokens": [5, bad]})
    error = caught.value
    assert error.status == 400 and error.param == "tokens"
    assert error.message == f"tokens: token ids must lie in [0, {vocab_size}); tokens[1] is {bad}"


@pytest.mark.parametrize(
    "body, param", [({}, "tokens"), ({"tokens": [True]}, "tokens[0]"), ({"tokens": "1"}, "tokens")]
)
def test_bad_detokenize_bodies_answer_400_naming_the_field(body, param):
    assert error_for(DetokenizeRequest, body).param == param


def test_an_unknown_model_is_404_on_both_routes(ingress):
    for call, body in [(tokenize, {"prompt": TEXT}), (detokenize, {"tokens": [5]})]:
        with pytest.raises(OpenAIError) as caught:
            call(ingress, {**body, "model": "gpt-5"})
        error = caught.value
        assert (error.status, error.code, error.param) == (404, "model_not_found", "model")


def test_the_routes_document_their_bodies_and_errors():
    paths = app.openapi()["paths"]
    for route in ("/tokenize", "/detokenize"):
        responses = paths[route]["post"]["responses"]
        assert {"200", "400", "404", "500"} <= set(responses)
