"""WorkerGroup hand-off through the Ray object store: by reference, the KV's chunks owned by the
prefill worker; a lost object (owner killed) reads as KVLostError and the decode engine
recomputes the prompt."""

from __future__ import annotations

import time
import uuid

import pytest

import rayinfer
from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.runtime import ModelSource, build_engine
from rayinfer.engine.executor import KVLostError
from rayinfer.engine.sampling_params import SamplingParams

PROMPT_IDS = [5, 17, 42, 99, 7, 123, 64, 8]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(ray_cluster):
    config = AppConfig(
        max_model_len=128, prefill={"num_kv_blocks": 64}, decode={"num_kv_blocks": 64}
    )
    source = ModelSource.resolve(config)
    expected = rayinfer.LLM("tiny", max_model_len=128).generate(PROMPT_IDS, GREEDY)[0].token_ids
    return config, source, expected


def engine_for(setup, phase: str):
    config, source, _ = setup
    return build_engine(config, source, phase, f"rayinfer-test-{phase}-{uuid.uuid4().hex[:6]}")


def run_to_end(engine, request_id: str) -> list[int]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output.token_ids
    raise TimeoutError(f"{request_id} did not finish")


def prefill_handoff(engine, request_id: str):
    engine.add_request(request_id, PROMPT_IDS, GREEDY, prefill_only=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for output in engine.step():
            if output.request_id == request_id and output.finish_reason == "prefilled":
                return engine.take_handoff(request_id)
    raise TimeoutError("prefill did not finish")


def test_handoff_by_reference_between_worker_groups(setup, ray_cluster):
    ray = ray_cluster
    prefill, prefill_group = engine_for(setup, "prefill")
    decode, decode_group = engine_for(setup, "decode")
    try:
        handoff = prefill_handoff(prefill, "h0")
        [shard] = handoff.payload.shards
        assert isinstance(shard, ray.ObjectRef)
        [owner] = handoff.payload.owners
        assert owner == prefill_group.worker_names[0]
        assert owner.startswith("rayinfer-test-prefill-") and owner.endswith("-r0")
        payload = ray.get(shard)
        assert all(isinstance(chunk, ray.ObjectRef) for chunk in payload.chunks)
        assert handoff.num_bytes == payload.num_bytes > 0
        decode.add_prefilled_request(handoff, GREEDY)
        assert run_to_end(decode, "h0") == setup[2]
        assert decode.handoffs.num_kv_recomputes == 0
        assert "h0" in decode_group.stats.import_seconds
    finally:
        prefill_group.shutdown()
        decode_group.shutdown()


def test_lost_owner_is_recomputed(setup, ray_cluster):
    ray = ray_cluster
    prefill, prefill_group = engine_for(setup, "prefill")
    decode, decode_group = engine_for(setup, "decode")
    try:
        handoff = prefill_handoff(prefill, "lost")
        payload = ray.get(handoff.payload.shards[0])  # the export finished: its chunks exist
        prefill_group.shutdown()  # kills the worker that owns the KV's chunks
        wait_until_lost(ray, payload.chunks[0])
        pending = decode_group.import_kv("probe", [0], handoff.payload)
        with pytest.raises(KVLostError, match="rayinfer-test-prefill-"):
            decode_group.finish_import(pending)
        decode.add_prefilled_request(handoff, GREEDY)
        assert run_to_end(decode, "lost") == setup[2]
        assert decode.handoffs.num_kv_recomputes == 1
        assert "lost" in decode_group.stats.lost_request_ids
    finally:
        decode_group.shutdown()


def wait_until_lost(ray, ref, timeout_s: float = 30) -> None:
    """Ray notices an owner's death within about a second; until then the object still reads."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(ref, timeout=5)
        except ray.exceptions.ObjectLostError:
            return
        time.sleep(0.2)
    raise TimeoutError("the KV object stayed readable after its owner died")
