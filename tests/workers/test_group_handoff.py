"""WorkerGroup hand-off between two real worker groups on one node, by either path:
- the shared-memory arena (kv_handoff.path=auto, the default): the payload names a span of the
  prefill worker's arena file, decode maps it, and the span is released once decode has landed
  the KV, or has dropped the hand-off (aborted, or ended at its first token);
- the object store (kv_handoff.path=object_store): by reference, the chunks owned by the
  prefill worker.
A lost KV (its owner killed, or its group shut down) reads as KVLostError and the decode engine
recomputes the prompt; a shut-down group's arena files are unlinked, a killed worker's by the
decode worker that finds it dead."""

from __future__ import annotations

import gc
import os
import time
import uuid
from dataclasses import replace

import pytest

import rayinfer
from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.runtime import ModelSource, build_engine
from rayinfer.engine.executor import KVLostError
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.workers.group import KVRefs
from rayinfer.workers.runner.kv_arena_maps import ArenaMaps

PROMPT_IDS = [5, 17, 42, 99, 7, 123, 64, 8]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(ray_cluster):
    return rayinfer.LLM("tiny", max_model_len=128).generate(PROMPT_IDS, GREEDY)[0].token_ids


def engine_for(phase: str, path: str = "auto", tp: int = 1):
    config = AppConfig(
        max_model_len=128,
        prefill={"num_kv_blocks": 64},
        decode={"num_kv_blocks": 64, "tp": tp},
        kv_handoff={"path": path},
    )
    source = ModelSource.resolve(config)
    return build_engine(config, source, phase, f"rayinfer-test-{phase}-{uuid.uuid4().hex[:6]}")


@pytest.fixture(scope="module")
def decode(ray_cluster):
    engine, group = engine_for("decode")
    yield engine, group
    group.shutdown()


@pytest.fixture(scope="module")
def prefill(ray_cluster):
    engine, group = engine_for("prefill")
    yield engine, group
    group.shutdown()


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


def wait_until(condition, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_handoff_through_the_arena_between_worker_groups(ray_cluster, prefill, decode, expected):
    ray = ray_cluster
    (prefill_engine, prefill_group), (decode_engine, decode_group) = prefill, decode
    handoff = prefill_handoff(prefill_engine, "a0")
    [owner] = handoff.payload.owners
    assert owner == prefill_group.worker_names[0]
    header = ray.get(handoff.payload.shards[0])
    span = header.arena
    assert header.chunks == [] and span.num_bytes == header.num_bytes == handoff.num_bytes > 0
    pid = prefill_group.descriptions[0]["pid"]
    assert os.path.basename(span.path).startswith(f"rayinfer-kv-{pid}-")
    assert span.node_id == ray.get_runtime_context().get_node_id()
    decode_engine.add_prefilled_request(handoff, GREEDY)
    assert run_to_end(decode_engine, "a0") == expected
    assert decode_engine.handoffs.num_kv_recomputes == 0
    timings = decode_group.stats.handoff_timings["a0"]
    assert timings["path"] == "shm" and timings["export"]["path"] == "shm"
    # landed: the span is released, so the prefill worker's next export takes its place back
    later = prefill_handoff(prefill_engine, "a1")
    next_span = ray.get(later.payload.shards[0]).arena
    assert (next_span.path, next_span.offset, next_span.slot) == (span.path, span.offset, span.slot)
    assert next_span.generation > span.generation
    decode_engine.add_prefilled_request(later, GREEDY)
    assert run_to_end(decode_engine, "a1") == expected


@pytest.mark.parametrize("how", ["aborted", "ended at its first token"])
def test_a_dropped_handoff_releases_its_span(ray_cluster, prefill, decode, how):
    ray = ray_cluster
    (prefill_engine, _), (decode_engine, _) = prefill, decode
    request_id = f"dropped-{how[0]}"
    handoff = prefill_handoff(prefill_engine, request_id)
    span = ray.get(handoff.payload.shards[0]).arena
    maps = ArenaMaps(pin=False)
    try:
        assert not maps.is_released(span)
        if how == "aborted":  # before any step: the import waits, nothing copied yet
            decode_engine.add_prefilled_request(handoff, GREEDY)
            decode_engine.abort(request_id)
        else:
            one = SamplingParams(max_tokens=1, temperature=0)
            decode_engine.add_prefilled_request(handoff, one)
            [output] = decode_engine.step()
            assert output.request_id == request_id and output.finish_reason == "length"
        assert not decode_engine.handoffs.busy
        wait_until(lambda: maps.is_released(span), "the decode worker's release of the span")
    finally:
        maps.close()


def test_two_decode_ranks_read_one_span_which_is_released_once_both_have(
    ray_cluster, prefill, expected
):
    """MLA's latent is the same on every tensor-parallel rank: one span, read by both."""
    ray = ray_cluster
    prefill_engine, _ = prefill
    decode_engine, decode_group = engine_for("decode", tp=2)
    maps = ArenaMaps(pin=False)
    try:
        handoff = prefill_handoff(prefill_engine, "two-ranks")
        span = ray.get(handoff.payload.shards[0]).arena
        decode_engine.add_prefilled_request(handoff, GREEDY)
        assert run_to_end(decode_engine, "two-ranks") == expected
        assert decode_group.stats.handoff_timings["two-ranks"]["path"] == "shm"
        wait_until(lambda: maps.is_released(span), "the group's release once both ranks landed")
    finally:
        maps.close()
        decode_group.shutdown()


def test_handoff_by_reference_through_the_object_store_and_its_loss(ray_cluster, decode, expected):
    ray = ray_cluster
    decode_engine, decode_group = decode
    prefill_engine, prefill_group = engine_for("prefill", path="object_store")
    try:
        handoff = prefill_handoff(prefill_engine, "h0")
        [shard] = handoff.payload.shards
        assert isinstance(shard, ray.ObjectRef)
        [owner] = handoff.payload.owners
        assert owner == prefill_group.worker_names[0]
        assert owner.startswith("rayinfer-test-prefill-") and owner.endswith("-r0")
        payload = ray.get(shard)
        assert payload.arena is None
        assert all(isinstance(chunk, ray.ObjectRef) for chunk in payload.chunks)
        assert handoff.num_bytes == payload.num_bytes > 0
        decode_engine.add_prefilled_request(handoff, GREEDY)
        assert run_to_end(decode_engine, "h0") == expected
        assert decode_group.stats.handoff_timings["h0"]["path"] == "object_store"
        lost = prefill_handoff(prefill_engine, "lost-object-store")
        lost_chunk = ray.get(lost.payload.shards[0]).chunks[0]  # the export finished
    finally:
        prefill_group.shutdown()  # kills the worker that owns the KV's chunks
    wait_until_lost(ray, lost_chunk)
    assert_recomputed(decode, lost, expected)


def test_a_handoff_read_through_refs_its_owner_does_not_know_lands(
    ray_cluster, prefill, decode, expected, read_unregistered
):
    """Serve sends a Prefill replica's reply as an item of a streaming generator, and Ray can lose
    the borrow of the ObjectRefs nested in it (ray-project/ray#58080): decode then reads the
    hand-off through refs that its owner (here this process's prefill group) does not know of.
    The group's own references keep it readable until the importer is done with it."""
    ray = ray_cluster
    (prefill_engine, prefill_group), (decode_engine, _) = prefill, decode
    handoff = prefill_handoff(prefill_engine, "unknown-reader")
    while prefill_engine.handoffs.busy:  # until the export has ended
        prefill_engine.step()
    core = ray._private.worker.global_worker.core_worker
    ids = [(ref.binary(), core.get_owner_address(ref)) for ref in handoff.payload.shards]
    num_bytes, owners = handoff.payload.num_bytes, handoff.payload.owners
    handoff = replace(handoff, payload=None)  # the last reference this test held
    gc.collect()
    headers = ray.get(read_unregistered.remote(ids))
    assert not isinstance(headers, str), f"the hand-off's header was freed: {headers}"
    recomputes = decode_engine.handoffs.num_kv_recomputes
    decode_engine.add_prefilled_request(
        replace(handoff, payload=KVRefs(headers, num_bytes, owners)), GREEDY
    )
    assert run_to_end(decode_engine, "unknown-reader") == expected
    assert decode_engine.handoffs.num_kv_recomputes == recomputes
    prefill_group.free_requests([])  # the import released the span: the group lets go too
    assert "unknown-reader" not in prefill_group.export_holds.request_ids


@pytest.fixture(scope="module")
def read_unregistered(ray_cluster):
    """A task reading ObjectRefs rebuilt from their ids, a borrow their owner is never told of
    (as when Ray loses it): it reads them only while the owner itself still holds them."""

    @ray_cluster.remote
    def read(ids):
        import ray

        core = ray._private.worker.global_worker.core_worker
        refs = []
        for binary, owner in ids:
            refs.append(ray.ObjectRef(binary, owner))
            core.deserialize_and_register_object_ref(binary, ray.ObjectRef.nil(), owner, b"")
        try:
            return ray.get(refs, timeout=30)
        except ray.exceptions.RayError as error:
            return type(error).__name__

    return read


@pytest.mark.parametrize("death", ["shut down", "killed"])
def test_lost_arena_owner_is_recomputed(ray_cluster, decode, expected, death):
    ray = ray_cluster
    prefill_engine, prefill_group = engine_for("prefill")
    try:
        handoff = prefill_handoff(prefill_engine, f"lost-arena-{death[0]}")
        span = ray.get(handoff.payload.shards[0]).arena  # the export finished
    finally:
        pid = prefill_group.descriptions[0]["pid"]
        if death == "killed":  # as a crash: nothing closes the arena
            ray.kill(prefill_group.workers[0])
            wait_until(lambda: not os.path.exists(f"/proc/{pid}"), "the worker's exit")
        else:
            prefill_group.shutdown()
    # shut down: its file is unlinked; killed: it stays until someone finds the owner dead
    assert os.path.exists(span.path) == (death == "killed")
    assert_recomputed(decode, handoff, expected)
    # killed: the decode worker that found the owner dead unlinked its file
    assert not os.path.exists(span.path)


def assert_recomputed(decode, handoff, expected) -> None:
    """The hand-off's KV reads as lost (naming its owner), and decode recomputes the prompt."""
    decode_engine, decode_group = decode
    pending = decode_group.import_kv("probe", [0], handoff.payload)
    with pytest.raises(KVLostError, match="rayinfer-test-prefill-"):
        decode_group.finish_import(pending)
    decode_engine.add_prefilled_request(handoff, GREEDY)
    recomputes = decode_engine.handoffs.num_kv_recomputes
    assert run_to_end(decode_engine, handoff.request_id) == expected
    assert decode_engine.handoffs.num_kv_recomputes == recomputes + 1
    assert handoff.request_id in decode_group.stats.lost_request_ids


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
