"""Structured outputs under tensor parallelism (tp=2 CPU workers, gloo): unseeded requests at
temperature 1 draw from each rank's own OS-seeded generator, yet every rank advances its grammar
matchers with the first rank's tokens, so the ranks return the same tokens and the output
matches the schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

import rayinfer
from rayinfer import ParallelPlan, SamplingParams
from rayinfer.engine.batch import ModelBatch, ScheduledRequest
from rayinfer.engine.structured_output import StructuredOutput
from rayinfer.engine.tokenizer import Tokenizer
from rayinfer.models.tiny import EOS_ID, IM_END_ID, ensure_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
PROMPT = [5, 17, 42, 99, 7]
UNSEEDED_JSON = SamplingParams(
    max_tokens=64, temperature=1.0, structured_output=StructuredOutput.json_schema(SCHEMA)
)
MAX_STEPS = UNSEEDED_JSON.max_tokens
TABLE = list(range(8))  # blocks enough for the prompt and MAX_STEPS tokens


@pytest.fixture(scope="module")
def llm(ray_cluster):
    llm = rayinfer.LLM("tiny", device="cpu", parallel=ParallelPlan(tp=2))
    yield llm
    llm.shutdown()


def each_rank_step_by_step(llm, request_id: str, params: SamplingParams, max_steps: int):
    """Drive the group's workers as its engine would, feeding back the first rank's token:
    per step, every rank's (token, errors). Ends at an end-of-text token or max_steps."""
    import ray

    workers = llm.engine.executor.workers
    request = ScheduledRequest(request_id, PROMPT, 0, TABLE, True, params)
    steps = []
    try:
        while len(steps) < max_steps:
            results = ray.get([w.execute.remote(ModelBatch([request])) for w in workers])
            steps.append([(r.token_ids[0], r.errors) for r in results])
            token = results[0].token_ids[0]
            if token in (EOS_ID, IM_END_ID):
                break
            request = ScheduledRequest(request_id, [token], request.seq_len, TABLE, True, params)
    finally:
        ray.get([w.free_requests.remote([request_id]) for w in workers])
    return steps


def test_tensor_parallel_ranks_advance_their_grammars_with_the_same_tokens(llm):
    tokenizer = Tokenizer.from_pretrained(str(ensure_tiny_model()))
    for index in range(4):  # unseeded: each request's ranks draw apart from the first free token
        steps = each_rank_step_by_step(llm, f"grammar-{index}", UNSEEDED_JSON, MAX_STEPS)
        for number, ranks in enumerate(steps):
            assert ranks[0] == ranks[1], f"request {index} step {number}: ranks {ranks}"
            assert ranks[0][1] is None, f"request {index} step {number}: {ranks[0][1]}"
        tokens = [rank_zero[0] for rank_zero, _ in steps]
        assert tokens[-1] in (EOS_ID, IM_END_ID), f"no end within {MAX_STEPS} tokens"
        jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), SCHEMA)


def test_without_a_grammar_the_ranks_own_draws_differ(llm):
    """The control: the agreement above is the shared tokens' doing, not equal generators (the
    random weights spread each draw over many of the 1,000 tokens, so 12 equal draws in a row
    do not happen by chance)."""
    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    steps = each_rank_step_by_step(llm, "plain", params, 12)
    assert any(ranks[0][0] != ranks[1][0] for ranks in steps), steps


def test_unseeded_json_schema_outputs_through_the_tp_engine_validate(llm):
    outputs = llm.generate([PROMPT] * 6, UNSEEDED_JSON)
    for output in outputs:
        assert output.finish_reason == "stop", (output.finish_reason, output.text)
        jsonschema.validate(json.loads(output.text), SCHEMA)
