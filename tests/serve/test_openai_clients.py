"""End to end: what third-party OpenAI clients send, against a real `serve run` on a private
cluster: the openai SDK, raw httpx (vLLM's /tokenize and /detokenize too), lm-eval's
`local-completions` with batched prompts, and a schemathesis run over `/openapi.json`.

The server (disaggregated, max_model_len=512) is shared with test_bench_serve.py and
test_structured_outputs.py (tests/serve/conftest.py): starting one costs ~45 s on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512  # the shared server's
PROMPTS = ["The quick brown fox", "Tell me about the river.", "Once upon a time", "a b c"]
GREEDY = dict(model="tiny", max_tokens=6, temperature=0)
GREEDY_PARAMS = dict(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def server(disaggregated_server):
    return disaggregated_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    from rayinfer.engine.tokenizer import Tokenizer
    from rayinfer.models.tiny import ensure_tiny_model

    return Tokenizer.from_pretrained(ensure_tiny_model())


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.http_url + path, json=body, timeout=120)


def post_raw(server, path: str, content: str | bytes) -> httpx.Response:
    """A JSON-typed body sent as given (text the client's JSON encoder would not write)."""
    return httpx.post(
        f"{server.http_url}{path}",
        content=content,
        headers={"content-type": "application/json"},
        timeout=120,
    )


def test_models_retrieve_and_an_unknown_id_is_404(client):
    model = client.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model" and model.owned_by == "rayinfer"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-5")
    error = caught.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "gpt-5" in error["message"] and error["request_id"]


@pytest.mark.parametrize("as_ids", [False, True])
def test_a_batch_of_prompts_equals_each_prompt_alone(client, tokenizer, as_ids):
    prompts = [tokenizer.encode(p) for p in PROMPTS] if as_ids else PROMPTS
    batch = client.completions.create(prompt=prompts, **GREEDY)
    singles = [client.completions.create(prompt=p, **GREEDY) for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_a_streamed_batch_with_n_indexes_prompt_major(client):
    args = dict(prompt=PROMPTS[:2], n=2, seed=3, max_tokens=5, temperature=0.9, model="tiny")
    whole = client.completions.create(**args)
    texts = {}
    usage = None
    for chunk in client.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert texts == {c.index: c.text for c in whole.choices}
    assert sorted(texts) == [0, 1, 2, 3]
    single = client.completions.create(**{**args, "prompt": PROMPTS[1], "seed": 4, "n": 1})
    assert whole.choices[3].text == single.choices[0].text  # prompt 1, choice 1: seed + 1
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_lm_eval_scoring_request_batch(server, tokenizer):
    """What lm-eval's local-completions sends with batch_size 4: token-id prompts, echo,
    logprobs=1, max_tokens=1; each choice scores its whole prompt plus one token."""
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    body = dict(model="tiny", prompt=prompts, temperature=0, max_tokens=1, logprobs=1,
                seed=1234, echo=True)  # fmt: skip
    reply = post(server, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
    for prompt, choice in zip(prompts, choices):
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt) + 1
        assert logprobs["token_logprobs"][0] is None
        assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
        assert all(len(top) >= 1 for top in logprobs["top_logprobs"][1:])


LM_EVAL_TASK = """
task: rayinfer_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def write_lm_eval_task(tmp_path) -> None:
    """A 4-question local multiple-choice task for lm-eval, in tmp_path."""
    data = tmp_path / "questions.jsonl"
    questions = [(p, ["the river", "a fox", "upon"]) for p in PROMPTS]
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": i % 3}) + "\n"
                            for i, (q, c) in enumerate(questions)))  # fmt: skip
    (tmp_path / "task.yaml").write_text(LM_EVAL_TASK.format(data=data))


def start_lm_eval(server, tmp_path, batch_size: int) -> subprocess.Popen:
    """lm-eval's CLI against the server on the task of `write_lm_eval_task`, started."""
    from rayinfer.models.tiny import ensure_tiny_model

    output = tmp_path / f"out-{batch_size}"
    model_args = (
        f"model=tiny,base_url={server.http_url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={ensure_tiny_model()},max_retries=1,num_concurrent=1"
    )
    command = [
        sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
        model_args, "--tasks", "rayinfer_tiny_choice", "--include_path", str(tmp_path),
        "--batch_size", str(batch_size), "--output_path", str(output), "--log_samples",
    ]  # fmt: skip
    env = {**server.env(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("RAY_ADDRESS")
    with open(tmp_path / f"lm_eval-{batch_size}.log", "wb") as log:  # no pipe to fill
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def lm_eval_scores(process: subprocess.Popen, tmp_path, batch_size: int) -> list:
    """Each choice's score, once the lm-eval run of `start_lm_eval` has ended."""
    process.wait(timeout=300)
    log = (tmp_path / f"lm_eval-{batch_size}.log").read_text(errors="replace")
    assert process.returncode == 0, log[-6000:]
    (samples,) = (tmp_path / f"out-{batch_size}").rglob("samples_rayinfer_tiny_choice_*.jsonl")
    lines = samples.read_text().splitlines()
    return [[float(score) for ((score, _),) in json.loads(line)["resps"]] for line in lines]


def test_lm_eval_local_completions_batch_size_4_scores_as_one_at_a_time(server, tmp_path):
    """The two lm-eval runs go at once: each CLI spends most of its ~25 s importing (one core
    each on 2 cores), and a score does not depend on which requests share the server's steps."""
    pytest.importorskip("lm_eval")
    write_lm_eval_task(tmp_path)
    runs = {size: start_lm_eval(server, tmp_path, size) for size in (4, 1)}
    try:
        batched, alone = (lm_eval_scores(runs[size], tmp_path, size) for size in (4, 1))
    finally:
        for process in runs.values():
            if process.poll() is None:
                process.kill()
    assert len(batched) == 4 and all(len(scores) == 3 for scores in batched)
    assert all(score < 0 for scores in batched for score in scores)
    for scores, expected in zip(batched, alone):
        assert scores == pytest.approx(expected, abs=1e-4)


def test_echo_text_offsets_slice_the_returned_text(client, tokenizer):
    reply = client.completions.create(prompt=PROMPTS[1], echo=True, logprobs=1, **GREEDY)
    choice = reply.choices[0]
    text, logprobs = choice.text, choice.logprobs
    assert text.startswith(PROMPTS[1])
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets[1] == 0  # BOS is not in the text: no width
    ends = [*offsets[1:], len(text)]
    for token, start, end in zip(logprobs.tokens, offsets, ends):
        assert text[start:end] in (token, ""), (token, start, end)
    assert "".join(text[a:b] for a, b in zip(offsets, ends)) == text


def test_usage_is_null_until_the_usage_chunk_and_counts_cached_tokens(server):
    prompt = " ".join(["the river runs past the old mill and the fox"] * 8)  # several blocks
    body = dict(model="tiny", prompt=prompt, max_tokens=4, temperature=0, stream=True,
                stream_options={"include_usage": True})  # fmt: skip
    with httpx.stream("POST", server.http_url + "/v1/completions", json=body, timeout=120) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] >= 1
    assert "cached_tokens" in usage["prompt_tokens_details"]
    again = post(server, "/v1/completions", {**body, "stream": False}).json()["usage"]
    assert again["prompt_tokens"] == usage["prompt_tokens"]
    assert 0 < again["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens"]


def test_logit_bias_forces_a_token(client, tokenizer):
    forced_id = tokenizer.encode(" river", add_special_tokens=False)[0]
    reply = client.completions.create(prompt=PROMPTS[0], logit_bias={str(forced_id): 100}, **GREEDY)
    assert reply.choices[0].text == tokenizer.decode([forced_id] * 6)
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], logit_bias={str(forced_id): 100}, **GREEDY
    )
    assert chat.choices[0].message.content == tokenizer.decode([forced_id] * 6)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(prompt=PROMPTS[0], logit_bias={"100000": 5}, **GREEDY)
    assert caught.value.body["param"] == "logit_bias"


def test_vllm_sampling_extensions_answer_as_the_offline_engine(client, server):
    """Through the prefill -> decode hand-off of this server: the repetition penalty needs the
    prompt on the decode worker, min_tokens the count, stop_token_ids the engine's stop rule
    and its stop_reason."""
    import rayinfer

    llm = rayinfer.LLM("tiny", max_model_len=MAX_MODEL_LEN)
    extensions = dict(repetition_penalty=1.5, min_tokens=3, skip_special_tokens=False)
    tokens = llm.generate(PROMPTS[0], rayinfer.SamplingParams(**GREEDY_PARAMS, **extensions))[0]
    tokens = list(tokens.token_ids)
    step = next(k for k in range(3, len(tokens)) if tokens[k] not in tokens[:k])
    extensions["stop_token_ids"] = [tokens[step]]  # ends PROMPTS[0] there
    offline = llm.generate(PROMPTS, rayinfer.SamplingParams(**GREEDY_PARAMS, **extensions))
    assert (offline[0].finish_reason, offline[0].stop_reason) == ("stop", tokens[step])
    for prompt, expected in zip(PROMPTS, offline):
        reply = client.completions.create(prompt=prompt, extra_body=extensions, **GREEDY)
        choice = reply.choices[0]  # stop_reason: vLLM's field, an extra to the SDK's model
        assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (
            expected.text, expected.finish_reason, expected.stop_reason,
        )  # fmt: skip
    bad = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "min_p": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_p"


def test_tokenize_and_detokenize_as_vllm_serves_them(server, tokenizer):
    """Answered by the ingress alone: a prompt's ids and back to text, a conversation's ids
    (a chat completion's prompt_tokens), and bad input as 400/404 naming the field."""
    body = dict(model="tiny", prompt=PROMPTS[1], return_token_strs=True)
    reply = post(server, "/tokenize", body)
    assert reply.status_code == 200, reply.text
    tokens = reply.json()["tokens"]
    assert tokens == tokenizer.encode(PROMPTS[1])
    assert reply.json() == {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens,
                            "token_strs": tokenizer.token_strings(tokens)}  # fmt: skip
    back = post(server, "/detokenize", {"model": "tiny", "tokens": tokens[1:]})
    assert back.status_code == 200 and back.json() == {"prompt": PROMPTS[1]}
    chat = dict(model="tiny", messages=[{"role": "user", "content": PROMPTS[2]}])
    usage = post(server, "/v1/chat/completions", {**chat, **GREEDY_PARAMS}).json()["usage"]
    assert post(server, "/tokenize", chat).json()["count"] == usage["prompt_tokens"]
    for route, bad, status, param in [
        ("/tokenize", {"prompt": "a", **chat}, 400, "prompt"),
        ("/tokenize", {"messages": chat["messages"], "continue_final_message": True}, 400,
         "continue_final_message"),
        ("/detokenize", {"tokens": [5, 10**6]}, 400, "tokens"),
        ("/detokenize", {"model": "gpt-5", "tokens": [5]}, 404, "model"),
    ]:  # fmt: skip
        reply = post(server, route, bad)
        assert reply.status_code == status, reply.text
        assert reply.json()["error"]["param"] == param and reply.json()["error"]["request_id"]


IMAGE_MESSAGE = {
    "role": "user",
    "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    ],
}
STRICT_CASES = {
    "string max_tokens": ("completions", {"prompt": "hi", "max_tokens": "3"}, "max_tokens"),
    "string stream": ("completions", {"prompt": "hi", "stream": "true"}, "stream"),
    "boolean token id": ("completions", {"prompt": [[False]]}, "prompt"),
    "mixed batch": ("completions", {"prompt": ["hi", [1, 2]]}, "prompt"),
    "string temperature": (
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "temperature": "0"},
        "temperature",
    ),  # fmt: skip
    "image part": ("chat/completions", {"messages": [IMAGE_MESSAGE]}, "messages[0].content"),
}


@pytest.mark.parametrize("case", STRICT_CASES, ids=list(STRICT_CASES))
def test_strict_types_and_image_parts_are_400_naming_the_field(server, case):
    route, body, param = STRICT_CASES[case]
    reply = post(server, f"/v1/{route}", {"model": "tiny", **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(param)
    if case == "image part":
        assert "image_url" in error["message"]


LONE_SURROGATES = {  # JSON text: "\ud800" escapes a lone UTF-16 surrogate
    "prompt": ("completions", '{"prompt": "a\\ud800b"}'),
    "model": ("completions", '{"prompt": "a", "model": "\\udfff"}'),
    "messages[0].content": (
        "chat/completions",
        '{"messages": [{"role": "user", "content": "\\ud800"}]}',
    ),
}


@pytest.mark.parametrize("param", LONE_SURROGATES)
def test_a_lone_surrogate_is_400_naming_the_field(server, param):
    """Python's JSON parser keeps such a string; the tokenizer (a 500) or the error body that
    quotes it (an unencodable body) would fail on it."""
    route, text = LONE_SURROGATES[param]
    reply = post_raw(server, f"/v1/{route}", text)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "body, why",
    [
        (b'{"prompt": "\xff\xfe\xfa"}', "not UTF-8"),
        (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nest too deeply"),
        (b'{"prompt": "a\xed\xa0\x80"}', "lone UTF-16 surrogate"),  # one encoded as UTF-8
    ],
)
def test_an_undecodable_body_is_400_saying_why(server, body, why):
    reply = post_raw(server, "/v1/completions", body)
    assert reply.status_code == 400, reply.text
    assert why in reply.json()["error"]["message"]


def test_schemathesis_finds_no_undocumented_status_or_body(server, tmp_path):
    """Bounded property-based requests from /openapi.json: every status code and every JSON
    body is one the schema documents, and none is a 5xx."""
    pytest.importorskip("schemathesis")
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{server.http_url}/openapi.json",
        "--checks", "status_code_conformance,response_schema_conformance,not_a_server_error",
        "--max-examples", "10", "--generation-deterministic", "--request-timeout", "60",
        "--phases", "examples,coverage,fuzzing", "--workers", "1",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
