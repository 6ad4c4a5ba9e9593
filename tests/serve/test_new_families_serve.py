"""`serve run rayinfer.app:build model=<folder>` on CPU for the newest families: tiny random
checkpoints made by transformers, with the built-in model's tokenizer and chat template beside
them; the openai client's answers equal the offline engine's on the same folder, whole and
streamed.
- GLM-5: DeepSeek Sparse Attention with full and shared indexer layers, index_topk below the
  prompts;
- DeepSeek-V4: sliding-window, CSA and HCA layers with a window and compression rates the
  prompts cross, and a hash-routed MoE layer."""

from __future__ import annotations

import shutil

import openai
import pytest

import rayinfer
from rayinfer.bench.serve_cluster import ServeCluster
from rayinfer.models.tiny import VOCAB_SIZE, ensure_tiny_model
from tests.models.harness import make_dsa_checkpoint, make_v4_checkpoint

pytestmark = pytest.mark.slow

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Once upon a time"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="module", params=["glm5", "deepseek_v4"])
def folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "glm5":
        make_dsa_checkpoint(
            folder,
            "glm_moe_dsa",
            vocab_size=VOCAB_SIZE,
            indexer_types=["full", "shared", "full"],
            max_position_embeddings=512,
        )
    else:
        make_v4_checkpoint(folder, vocab_size=VOCAB_SIZE)
    for name in TOKENIZER_FILES:
        shutil.copy(ensure_tiny_model() / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def client(folder):
    app_args = [f"model={folder}", "served_model_name=tiny-new", "max_model_len=256"]
    with ServeCluster(app_args) as cluster:
        yield openai.OpenAI(base_url=cluster.http_url + "/v1", api_key="unused", timeout=120)


def test_completions_equal_the_offline_engine(client, folder):
    offline = rayinfer.LLM(str(folder), device="cpu", max_model_len=256)
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
