"""The hand-off's chunked copies (workers/runner/kv_copy.py) are exact on the CPU: chunk boundaries,
another block size and chunk size on the way in, every dtype and row shape the caches hold.
(tests/gpu/test_kv_copy.py checks the pinned/staged CUDA path the same way.)

The same-node path's shared-memory arena (workers/runner/kv_arena.py, kv_arena_maps.py,
workers/handoff_io.py), in this process and in real child processes: exact through export ->
header -> mapped import, its spans released by the importer or taken back past their lease
(never read as another request's bytes), and its file unlinked when its owner closes it, exits,
or is killed (then by the next arena made on the node)."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from rayinfer.workers.handoff_io import HandoffIO, KVLost
from rayinfer.workers.runner.kv_arena import KVArena, unlink_dead_arenas
from rayinfer.workers.runner.kv_arena_maps import ArenaMaps
from rayinfer.workers.runner.kv_cache import KVCache
from rayinfer.workers.runner.kv_copy import KVCopier
from rayinfer.workers.runner.kv_transfer import KVPayload, layer_rows, pack_kv, token_slots


def random_caches(num_layers, num_blocks, block_size, shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_blocks, block_size, *shape, generator=generator).to(dtype)
        for _ in range(num_layers)
    ]


def tokens_per_chunk_bytes(caches, tokens: int) -> int:
    return sum(cache[0, 0].numel() * cache.element_size() for cache in caches) * tokens


def chunk_layers(chunks, copier: KVCopier) -> list[torch.Tensor]:
    """Per layer [tokens of every chunk, row bytes]: the chunks' layers (layer_rows) joined."""
    parts = [layer_rows(torch.from_numpy(chunk), copier.layer_bytes) for chunk in chunks]
    return [torch.cat(layer) for layer in zip(*parts)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8])
@pytest.mark.parametrize("shape", [(80,), (2, 4, 8), (1, 592)], ids=["mla", "gqa", "dsa-row"])
@pytest.mark.parametrize("chunk_tokens", [1, 3, 11, 64])
def test_export_then_import_is_bit_exact(dtype, shape, chunk_tokens):
    source = random_caches(3, 8, 4, shape, dtype)
    slots = token_slots([5, 2, 7], num_tokens=11, block_size=4)
    copier = KVCopier(source, chunk_bytes=tokens_per_chunk_bytes(source, chunk_tokens))
    chunks = [chunk.copy() for chunk in copier.export(slots)]  # buffers are reused
    sizes = [c.size // copier.token_bytes for c in chunks]
    assert sizes == [e - s for s, e in copier.chunk_bounds(11)]
    assert sum(sizes) == 11 and max(sizes) <= chunk_tokens
    reference = pack_kv(source, slots)
    # one width for all: the bytes of [layers, tokens, row bytes] arrays, chunk by chunk
    whole = np.concatenate([c.reshape(3, -1, copier.token_bytes // 3) for c in chunks], axis=1)
    for layer, expected in enumerate(reference):
        rows = torch.from_numpy(whole[layer])
        assert torch.equal(rows, expected.contiguous().view(torch.uint8).reshape(11, -1))

    target = [torch.zeros(16, 3, *shape, dtype=dtype) for _ in range(3)]  # block size 3
    target_slots = token_slots([9, 0, 4, 11], num_tokens=11, block_size=3)
    KVCopier(target, chunk_bytes=tokens_per_chunk_bytes(target, 2)).import_(target_slots, chunks)
    for layer, expected in enumerate(reference):
        got = target[layer].view(-1, *shape)[target_slots]
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    untouched = torch.ones(16 * 3, dtype=torch.bool)
    untouched[target_slots] = False
    assert not target[0].view(-1, *shape)[untouched].any()  # nothing written elsewhere


def layers_of_widths(widths, num_blocks, block_size, dtype, seed=0):
    """One cache per width ([num_blocks, block_size, width]): DeepSeek-V4's layer types."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(num_blocks, block_size, w, generator=generator).to(dtype) for w in widths]


@pytest.mark.parametrize("chunk_tokens", [1, 4, 64])
def test_layers_of_different_widths_travel_unpadded(chunk_tokens):
    """Each layer's own rows, back to back (no padding to the widest), and back into each
    layer's own, through an importer of another chunk size."""
    widths, dtype = [160, 4, 1, 160, 4], torch.bfloat16
    source = layers_of_widths(widths, 8, 4, dtype)
    slots = token_slots([5, 2, 7], num_tokens=11, block_size=4)
    copier = KVCopier(source, chunk_bytes=sum(widths) * 2 * chunk_tokens)
    assert copier.token_bytes == sum(widths) * 2 and copier.chunk_tokens == chunk_tokens
    chunks = [chunk.copy() for chunk in copier.export(slots)]
    assert sum(c.size for c in chunks) == 11 * sum(widths) * 2
    for rows, expected in zip(chunk_layers(chunks, copier), pack_kv(source, slots)):
        assert torch.equal(rows, expected.view(torch.uint8))
    target = [torch.zeros(16, 3, w, dtype=dtype) for w in widths]
    target_slots = token_slots([9, 0, 4, 11], num_tokens=11, block_size=3)
    KVCopier(target, chunk_bytes=sum(widths) * 2 * 3).import_(target_slots, chunks)
    for got, expected in zip(pack_kv(target, target_slots), pack_kv(source, slots)):
        assert torch.equal(got, expected)
    payload = KVPayload.from_tensors(pack_kv(source, slots), generator_state=None)
    assert payload.shape == (11, 160) and payload.num_bytes == sum(widths) * 11 * 2
    assert payload.kv_shapes == tuple((w,) for w in widths)
    assert all(torch.equal(a, b) for a, b in zip(payload.kv, pack_kv(source, slots)))


def test_payload_views_and_sizes_agree():
    source = random_caches(2, 4, 4, (2, 3, 5), torch.bfloat16)
    slots = token_slots([3, 1], num_tokens=7, block_size=4)
    kv = pack_kv(source, slots)
    payload = KVPayload.from_tensors(kv, generator_state=None)
    assert payload.num_bytes == 2 * 7 * 30 * 2 == sum(chunk.nbytes for chunk in payload.chunks)
    assert payload.layer_shapes is None and payload.kv_shapes == ((2, 3, 5), (2, 3, 5))
    assert all(torch.equal(a, b) for a, b in zip(payload.kv, kv))
    copier = KVCopier(source, chunk_bytes=tokens_per_chunk_bytes(source, 2))
    split = payload.with_chunks([chunk.copy() for chunk in copier.export(slots)])
    assert len(split.chunks) == 4 and all(torch.equal(a, b) for a, b in zip(split.kv, kv))


# --- the same-node arena ------------------------------------------------------------------------
def rows_at(cache: KVCache, block_table: list[int], num_tokens: int) -> list[torch.Tensor]:
    return pack_kv(cache.layers, token_slots(block_table, num_tokens, cache.block_size))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(80,), (2, 4, 8), "v4"], ids=["mla", "gqa", "v4-widths"])
def test_export_header_import_through_the_arena_is_bit_exact(dtype, shape):
    if shape == "v4":  # per-layer widths: each layer's own rows travel and land
        layers = layers_of_widths([80, 4, 80], 8, 4, dtype)
        empty = [torch.zeros(16, 3, w, dtype=dtype) for w in (80, 4, 80)]
    else:
        layers = random_caches(3, 8, 4, shape, dtype)
        empty = [torch.zeros(16, 3, *shape, dtype=dtype) for _ in range(3)]
    source = KVCache(layers, 4, None, chunk_bytes=tokens_per_chunk_bytes(layers, 3))
    target = KVCache(empty, 3, None, chunk_bytes=tokens_per_chunk_bytes(layers, 2))
    exporter, importer = HandoffIO(is_cuda=False), HandoffIO(is_cuda=False)
    try:
        header = exporter.export(source, [5, 2, 7], 11, generator_state=None)
        assert header.chunks == [] and header.arena.num_bytes == header.num_bytes
        assert header.timings["path"] == "shm" and header.arena_chunk_tokens == 3
        landed = importer.import_(target, [9, 0, 4, 11], [header])
        assert landed.timings["path"] == "shm"
        for got, expected in zip(
            rows_at(target, [9, 0, 4, 11], 11), rows_at(source, [5, 2, 7], 11)
        ):
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        # landed: the importer released the span, so the next export takes its place back
        span = header.arena
        assert int(exporter.arena.table[span.slot, 1]) == span.generation
        again = exporter.export(source, [5, 2, 7], 11, generator_state=None)
        assert exporter.arena.num_held == 1 and again.arena.offset == span.offset
        with pytest.raises(KVLost, match="gone or its span was reused"):
            importer.import_(target, [9, 0, 4, 11], [header])  # the old header reads as lost
    finally:
        exporter.close()
        importer.close()


def test_a_full_arena_has_no_room_and_spans_come_back_when_released_or_expired():
    arena = KVArena(1 << 20, lease_s=0.2, pin=False)
    maps = ArenaMaps(pin=False)
    try:
        first = arena.allocate(600_000)
        assert first is not None and arena.allocate(600_000) is None  # no room: object store
        view = maps.view(first)
        view.fill_(7)
        maps.release(first)
        second = arena.allocate(600_000)  # the released span is taken back
        assert second.offset == first.offset and second.generation > first.generation
        assert maps.view(first) is None and not maps.still_holds(first)
        assert maps.view(second) is not None
        beside = arena.allocate(300_000)  # in another slot, after second
        assert beside.slot != second.slot and beside.offset > second.offset
        time.sleep(0.3)  # both are held past their lease, never released
        assert maps.still_holds(second) and maps.still_holds(beside)  # until room is needed
        spanning = arena.allocate(900_000)  # over both: its slot is second's
        assert spanning.offset == second.offset and spanning.slot == second.slot
        # Late importers read them as lost, never as the new span's bytes.
        assert maps.view(second) is None and maps.view(beside) is None
    finally:
        arena.close()
        maps.close()


def test_more_spans_than_slots_go_elsewhere():
    arena = KVArena(8 << 20, lease_s=60, pin=False)
    try:
        spans = [arena.allocate(64) for _ in range(512)]
        assert all(spans) and len({s.offset for s in spans}) == 512
        assert arena.allocate(64) is None
    finally:
        arena.close()


OWNER = """
import sys
from rayinfer.workers.runner.kv_arena import KVArena
arena = KVArena(1 << 20, lease_s=60, pin=False)
span = arena.allocate(4096)
arena.view(span).fill_(5)
print(span.path, span.slot, span.generation, span.offset, span.num_bytes, flush=True)
sys.stdin.read()  # until the test closes our stdin (a clean exit) or kills us
"""


def start_owner():
    """A real process owning an arena with one span of 4096 bytes of 5s; (process, span)."""
    from rayinfer.comm.rendezvous import this_node_id
    from rayinfer.workers.runner.kv_arena import ArenaSpan

    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    path, *numbers = owner.stdout.readline().split()
    return owner, ArenaSpan(path, this_node_id(), *map(int, numbers))


def test_the_arena_file_goes_when_its_owner_exits_or_is_killed():
    (exiting, exiting_span), (killed, killed_span) = start_owner(), start_owner()
    maps = ArenaMaps(pin=False)
    try:
        for span in (exiting_span, killed_span):
            assert torch.equal(maps.view(span), torch.full((4096,), 5, dtype=torch.uint8))
        exiting.stdin.close()  # a clean exit: the owner unlinks its file (atexit)
        assert exiting.wait(timeout=30) == 0 and not os.path.exists(exiting_span.path)
        assert maps.view(exiting_span) is None  # its mapping here is dropped, its KV lost
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert os.path.exists(killed_span.path)  # a killed owner unlinks nothing
        next_owner = KVArena(1 << 20, lease_s=60, pin=False)  # the next arena on the node
        next_owner.close()
        assert not os.path.exists(killed_span.path) and not os.path.exists(next_owner.path)
        assert maps.view(killed_span) is None  # its lock went with it: the KV reads as lost
        assert unlink_dead_arenas() == []
    finally:
        maps.close()
        for owner in (exiting, killed):
            owner.kill()
            owner.wait()
