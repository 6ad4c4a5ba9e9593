"""The hand-off runs beside the steps: an import still waiting for its KV does not hold up the
decode steps of other requests, and joins the batch once the KV lands; an export returns before
its copy ends and frees its blocks only after. Bytes stay exact through export -> put -> get ->
import, and through export -> header -> mapped import (the same-node arena), into a cache of
another block size; a prefill worker copies the KV into its arena during the step that ends the
prompt (layer by layer). Both paths, between real worker groups."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest

import rayinfer
from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.runtime import ModelSource, build_engine
from rayinfer.engine.kv_handoff import KVHandoff
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.workers.group import KVRefs
from rayinfer.workers.runner.kv_arena_maps import ArenaMaps
from rayinfer.workers.runner.kv_transfer import arena_chunks

PROMPT_IDS = [5, 17, 42, 99, 7, 123, 64, 8, 250, 31, 77]
OTHER_IDS = [9, 8, 7, 6, 5, 4]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected():
    llm = rayinfer.LLM("tiny", max_model_len=128)
    return {
        "prompt": llm.generate(PROMPT_IDS, GREEDY)[0].token_ids,
        "other": llm.generate(OTHER_IDS, GREEDY)[0].token_ids,
        "handoff": llm.prefill(PROMPT_IDS, GREEDY)[0],  # an in-process payload
    }


def engine_for(phase: str, block_size: int = 16, path: str = "auto"):
    config = AppConfig(
        max_model_len=128,
        block_size=block_size,
        prefill={"num_kv_blocks": 64},
        decode={"num_kv_blocks": 64},
        kv_handoff={"path": path},
    )
    source = ModelSource.resolve(config)
    return build_engine(config, source, phase, f"rayinfer-test-{phase}-{uuid.uuid4().hex[:6]}")


@pytest.fixture(scope="module")
def prefill(ray_cluster):
    """A prefill replica's engine exporting through its arena (the default path)."""
    engine, group = engine_for("prefill")
    yield engine
    group.shutdown()


@pytest.fixture(scope="module")
def decode_of(ray_cluster):
    """decode_of(block_size) -> (engine, group): one decode replica per block size, shared by
    the module's tests (each uses its own request ids)."""
    made = {}

    def decode(block_size: int):
        if block_size not in made:
            made[block_size] = engine_for("decode", block_size=block_size)
        return made[block_size]

    yield decode
    for _, group in made.values():
        group.shutdown()


def prefilled(engine, request_id: str) -> KVHandoff:
    engine.add_request(request_id, PROMPT_IDS, GREEDY, prefill_only=True)
    step_until(engine, lambda outs: any(o.finish_reason == "prefilled" for o in outs))
    return engine.take_handoff(request_id)


def payload_bytes(ray, payload) -> np.ndarray:
    """[num_layers, num_tokens, row_bytes] uint8 (every layer of one width here): a copy of the
    payload's KV, wherever it is."""
    if payload.arena is None:
        chunks = ray.get(payload.chunks)
    else:
        maps = ArenaMaps(pin=False)
        try:
            chunks = [c.numpy().copy() for c in arena_chunks(maps.view(payload.arena), payload)]
        finally:
            maps.close()
    row_bytes = payload.token_bytes // payload.num_layers
    return np.concatenate([c.reshape(payload.num_layers, -1, row_bytes) for c in chunks], axis=1)


def step_until(engine, done, timeout_s: float = 120) -> list:
    outputs = []
    deadline = time.monotonic() + timeout_s
    while not done(outputs):
        assert time.monotonic() < deadline, "timed out"
        outputs += engine.step()
    return outputs


def tokens_of(outputs, request_id: str) -> list[int]:
    return next(o.token_ids for o in outputs if o.request_id == request_id and o.finished)


def finished(request_id: str):
    return lambda outputs: any(o.request_id == request_id and o.finished for o in outputs)


@pytest.mark.parametrize("path", ["object_store", "shm"])
def test_a_pending_import_does_not_hold_up_the_batch(
    ray_cluster, expected, prefill, decode_of, path
):
    """The KV held back by a gate: an in-process payload (put into the object store by the
    decode group), or the header of a prefill worker's arena export."""
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Gate:  # releases the KV only when told to
        def __init__(self):
            import threading

            self.opened = threading.Event()

        def open(self):
            self.opened.set()

        def payload(self, payload):
            self.opened.wait(120)
            return payload

    gate = Gate.options(max_concurrency=2).remote()
    decode, group = decode_of(16)
    other = f"other-{path}"
    try:
        held = expected["handoff"] if path == "object_store" else prefilled(prefill, "held")
        header = held.payload
        if path == "shm":
            [shard] = held.payload.shards
            header = ray.get(shard)
            assert header.arena is not None
        late_kv = KVRefs([gate.payload.remote(header)], header.num_bytes, ["gate"])
        late = KVHandoff(held.request_id, held.prompt_token_ids, held.first_token_id, late_kv)
        decode.add_prefilled_request(late, GREEDY)
        decode.add_request(other, OTHER_IDS, GREEDY)
        outputs = step_until(decode, finished(other))  # decodes while the KV is held back
        assert tokens_of(outputs, other) == expected["other"]
        in_flight = decode.handoffs.imports_in_flight
        assert [p.state.seq.request_id for p in in_flight] == [held.request_id]
        assert not any(o.request_id == held.request_id and o.token_ids for o in outputs)
        ray.get(gate.open.remote())
        outputs = step_until(decode, finished(held.request_id))
        assert tokens_of(outputs, held.request_id) == expected["prompt"]
        assert decode.handoffs.num_kv_recomputes == 0 and not decode.handoffs.imports_in_flight
        assert decode.kv_usage == 0
        assert group.stats.handoff_timings[held.request_id]["path"] == path
    finally:
        ray.kill(gate)


def test_export_frees_its_blocks_once_copied(ray_cluster, expected, prefill, decode_of):
    decode, decode_group = decode_of(8)  # another block size
    prefill.add_request("h", PROMPT_IDS, GREEDY, prefill_only=True)
    step_until(prefill, lambda outs: any(o.finish_reason == "prefilled" for o in outs))
    handoff = prefill.take_handoff("h")
    assert handoff.num_bytes > 0
    # The blocks stay held until the engine sees the export done (at a later step).
    step_until(prefill, lambda outs: not prefill.handoffs.exports_in_flight)
    assert prefill.kv_usage == 0

    decode.add_prefilled_request(handoff, GREEDY)
    outputs = step_until(decode, finished("h"))
    assert tokens_of(outputs, "h") == expected["prompt"]
    timings = decode_group.stats.handoff_timings["h"]
    assert {"get_s", "copy_s", "path"} <= timings.keys()
    assert {"export_s", "put_s", "copy_s", "path"} <= timings["export"].keys()
    assert timings["export"]["way"] == "layers"  # copied out during the step that ended the prompt


@pytest.mark.parametrize("path", ["object_store", "auto"])
def test_bytes_survive_export_then_import(ray_cluster, prefill, decode_of, path):
    """export -> put -> get -> import (object_store), or export -> header -> mapped import
    (auto, the same-node arena), between groups of block sizes 16 and 8 (the decode group
    exports back through its own arena)."""
    ray = ray_cluster
    own_prefill = None
    if path == "object_store":
        prefill, own_prefill = engine_for("prefill", path=path)
    decode, decode_group = decode_of(8)
    request_id = f"b-{path}"
    try:
        handoff = prefilled(prefill, request_id)
        [shard] = handoff.payload.shards
        sent = ray.get(shard)
        assert (sent.arena is not None) == (path == "auto")
        # the prefill step copied it out layer by layer where it went to the arena
        assert sent.timings["way"] == ("layers" if path == "auto" else "host")
        before = payload_bytes(ray, sent)  # read now: the import releases the span
        # Into the decode cache (block size 8, blocks 43, 40, 45: past what the engine's own
        # requests take), then exported again from there.
        table = [43, 40, 45]
        pending = decode_group.import_kv(request_id, table, handoff.payload)
        while decode_group.transfers_done([pending]) != [True]:
            time.sleep(0.01)
        decode_group.finish_import(pending)
        came_by = decode_group.stats.handoff_timings[request_id]["path"]
        assert came_by == {"auto": "shm"}.get(path, path)
        [back] = decode_group.export_kv(request_id, table, len(PROMPT_IDS)).shards
        received = ray.get(back)
        assert received.timings["way"] == "host"  # no step of this group ended its prompt
        assert received.shape == sent.shape and received.dtype == sent.dtype
        after = payload_bytes(ray, received)
        assert before.shape[1] == len(PROMPT_IDS) and np.array_equal(before, after)
    finally:
        if own_prefill is not None:
            own_prefill.shutdown()


def test_an_arena_export_put_for_another_node_keeps_its_window_and_layer_widths(ray_cluster):
    """kv_from_arena (what an importer on another node asks the exporter for): the header as
    exported, its window state and per-layer shapes too, its chunks now in the object store;
    the bytes land exact in a cache of another block size (DeepSeek-V4's layers of different
    widths, with a window pool)."""
    import torch

    from rayinfer.workers.handoff_io import HandoffIO
    from rayinfer.workers.runner.kv_cache import KVCache
    from rayinfer.workers.runner.kv_transfer import pack_kv, token_slots

    generator = torch.Generator().manual_seed(5)
    widths, window_width, num_tokens = (80, 4, 1, 80), 24, 11

    def cache(block_size, num_blocks, fill):
        make = torch.randn if fill else torch.zeros
        layers = [make(num_blocks, block_size, w, generator=generator) if fill else
                  make(num_blocks, block_size, w) for w in widths]  # fmt: skip
        window = [make(num_blocks, block_size, window_width, generator=generator) if fill else
                  make(num_blocks, block_size, window_width) for _ in widths]  # fmt: skip
        return KVCache(layers, block_size, None, chunk_bytes=sum(widths) * 4 * 3,
                       window_layers=window, window_span=5)  # fmt: skip

    source, target = cache(4, 8, fill=True), cache(3, 16, fill=False)
    exporter, importer = HandoffIO(is_cuda=False), HandoffIO(is_cuda=False)
    try:
        header = exporter.export(source, [5, 2, 7], num_tokens, None, window_table=[5, 2, 7])
        assert header.arena is not None and header.layer_shapes == tuple((w,) for w in widths)
        stored = exporter.kv_from_arena(header)
        assert stored.arena is None and stored.window is not None
        assert stored.layer_shapes == header.layer_shapes and len(stored.chunks) == 4
        importer.import_(target, [9, 0, 4, 11], [stored], window_table=[9, 0, 4, 11])
        slots, into = token_slots([5, 2, 7], num_tokens, 4), token_slots([9, 0, 4, 11], 11, 3)
        for got, sent in zip(pack_kv(target.layers, into), pack_kv(source.layers, slots)):
            assert torch.equal(got, sent)
        last = slice(num_tokens - 5, num_tokens)
        for got, sent in zip(pack_kv(target.window_layers, into[last]),
                             pack_kv(source.window_layers, slots[last])):  # fmt: skip
            assert torch.equal(got, sent)
    finally:
        exporter.close()
        importer.close()
