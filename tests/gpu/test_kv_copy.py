"""The hand-off's chunked copies on a GPU (device staging, pinned buffers, copy stream) are exact
at DeepSeek-V2-Lite's row (576 bf16) and GLM-5's (704 bf16), across chunk boundaries, with chunks
longer than the importer's staging, and while the compute stream keeps writing other blocks;
and so is the same-node path through a page-locked shared-memory arena (export into the arena,
import from another mapping of it, page-locked too: workers/handoff_io.py), including the copy
made layer by layer during the prefill step, which waits for each layer's writes
(workers/runner/layer_export.py):

    python -m pytest -q -m gpu tests/gpu/test_kv_copy.py
"""

import pytest
import torch

from rayinfer.engine.batch import ScheduledRequest
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.kernels.cache_rows import CacheRowsTable, cache_rows, cache_rows_reference
from rayinfer.workers.handoff_io import HandoffIO
from rayinfer.workers.runner.kv_cache import KVCache
from rayinfer.workers.runner.kv_copy import KVCopier
from rayinfer.workers.runner.kv_transfer import arena_chunks, layer_rows, pack_kv, token_slots

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def chunk_layers(chunks, copier: KVCopier) -> list[torch.Tensor]:
    """Per layer [tokens of every chunk, row bytes]: the chunks' layers (layer_rows) joined."""
    parts = [layer_rows(torch.from_numpy(chunk), copier.layer_bytes) for chunk in chunks]
    return [torch.cat(layer) for layer in zip(*parts)]


def random_caches(num_layers, num_blocks, block_size, row, dtype, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(num_blocks, block_size, row, generator=generator, device="cuda").to(dtype)
        for _ in range(num_layers)
    ]


@pytest.mark.parametrize("row", [576, 704])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 63, 1000, 3700])
def test_gpu_export_import_exact(row, dtype, num_tokens):
    layers, block_size = 5, 64
    blocks = -(-num_tokens // block_size)
    source = random_caches(layers, 2 * blocks + 3, block_size, row, dtype, seed=1)
    table = list(range(2 * blocks + 2, 2 * blocks + 2 - 2 * blocks, -2))  # scattered
    slots = token_slots(table, num_tokens, block_size)
    row_bytes = row * dtype.itemsize
    exporter = KVCopier(source, chunk_bytes=layers * row_bytes * 257)  # 257-token chunks
    chunks = [chunk.copy() for chunk in exporter.export(slots)]
    expected = pack_kv(source, slots)
    for got, rows in zip(chunk_layers(chunks, exporter), expected):
        assert torch.equal(got, rows.view(torch.uint8).reshape(num_tokens, -1))

    target = random_caches(layers, blocks * 4 + 4, 16, row, dtype, seed=2)  # block size 16
    target_table = list(range(3, 3 + -(-num_tokens // 16)))
    target_slots = token_slots(target_table, num_tokens, 16)
    before = [t.clone() for t in target]
    importer = KVCopier(target, chunk_bytes=layers * row_bytes * 100)  # shorter than the chunks
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):  # work queued on the compute stream meanwhile
        busy = busy @ busy / 64
    importer.import_(target_slots, chunks)
    for layer, rows in enumerate(expected):
        got = target[layer].view(-1, row)[target_slots].cpu()
        assert torch.equal(got.view(torch.uint8), rows.view(torch.uint8))
        others = torch.ones(target[layer].shape[0] * 16, dtype=torch.bool, device="cuda")
        others[target_slots.cuda()] = False
        assert torch.equal(target[layer].view(-1, row)[others], before[layer].view(-1, row)[others])


@pytest.mark.parametrize("row", [576, 704])
@pytest.mark.parametrize("num_tokens", [1, 1000, 3700])
def test_gpu_arena_export_import_exact(row, num_tokens):
    layers, block_size, dtype = 5, 64, torch.bfloat16
    blocks = -(-num_tokens // block_size)
    source = random_caches(layers, 2 * blocks + 3, block_size, row, dtype, seed=1)
    table = list(range(2 * blocks + 2, 2 * blocks + 2 - 2 * blocks, -2))  # scattered
    row_bytes = row * dtype.itemsize
    exporting = KVCache(source, block_size, None, chunk_bytes=layers * row_bytes * 257)
    target = random_caches(layers, blocks * 4 + 4, 16, row, dtype, seed=2)  # block size 16
    importing = KVCache(target, 16, None, chunk_bytes=layers * row_bytes * 100)
    target_table = list(range(3, 3 + -(-num_tokens // 16)))
    exporter, importer = HandoffIO(is_cuda=True), HandoffIO(is_cuda=True)
    try:
        header = exporter.export(exporting, table, num_tokens, generator_state=None)
        assert header.arena is not None and exporter.arena.is_pinned
        busy = torch.randn(4096, 4096, device="cuda")
        for _ in range(4):  # work queued on the compute stream meanwhile
            busy = busy @ busy / 64
        landed = importer.import_(importing, target_table, [header])
        assert landed.timings["path"] == "shm"
        expected = pack_kv(source, token_slots(table, num_tokens, block_size))
        got = pack_kv(target, token_slots(target_table, num_tokens, 16))
        for a, b in zip(got, expected):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    finally:
        exporter.close()
        importer.close()


@pytest.mark.parametrize("announced", [(0, 1, 2, 4), ()])
@pytest.mark.parametrize("num_tokens", [1000, 3700])
def test_gpu_layer_export_copies_each_layer_after_its_writes(num_tokens, announced):
    """A "forward" on the compute stream writes each layer late (a sleep kernel first) and
    announces the `announced` ones; a copy that did not wait for the writes would read the rows
    from before. `finish` copies the rest (all of them in one batch where none was announced,
    as after a step replayed from a graph)."""
    layers, block_size, row, dtype = 5, 64, 576, torch.bfloat16
    blocks = -(-num_tokens // block_size)
    source = random_caches(layers, 2 * blocks + 3, block_size, row, dtype, seed=1)
    written = random_caches(layers, 2 * blocks + 3, block_size, row, dtype, seed=3)
    table = list(range(2 * blocks + 2, 2 * blocks + 2 - 2 * blocks, -2))  # scattered
    cache = KVCache(source, block_size, None, chunk_bytes=layers * row * 2 * 1500)
    handoff = HandoffIO(is_cuda=True)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    request = ScheduledRequest("r", [0] * num_tokens, 0, table, True, greedy, exports_kv=True)
    try:
        copies = handoff.start_layer_exports(cache, [request])
        assert copies is not None
        for layer in range(layers):
            torch.cuda._sleep(5_000_000)  # a few ms of the compute stream before the write
            source[layer].copy_(written[layer])
            if layer in announced:
                copies.layer_cached(layer)
        copies.finish()
        header = handoff.export(cache, table, num_tokens, None, request_id="r")
        assert header.timings["way"] == "layers" and header.arena is not None
        chunks = arena_chunks(handoff.arena.view(header.arena), header)
        parts = [layer_rows(chunk, cache.copier.layer_bytes) for chunk in chunks]
        got = [torch.cat(layer) for layer in zip(*parts)]
        expected = pack_kv(written, token_slots(table, num_tokens, block_size))
        for a, b in zip(got, expected):
            assert torch.equal(a, b.view(torch.uint8).reshape(num_tokens, -1))
    finally:
        handoff.close()


@pytest.mark.parametrize("num_tokens", [1, 300])
def test_gpu_layers_of_different_widths_round_trip(num_tokens):
    """DeepSeek-V4-Flash's layer widths (160 for CSA, 4 for HCA): each layer's own rows on the
    way (no padding), and back in the cache through an importer of shorter chunks."""
    widths, block_size = [160, 4, 160, 4, 4], 64
    blocks = -(-num_tokens // block_size)
    generator = torch.Generator(device="cuda").manual_seed(3)
    source = [
        torch.randn(blocks + 2, block_size, w, generator=generator, device="cuda").bfloat16()
        for w in widths
    ]
    slots = token_slots(list(range(1, 1 + blocks)), num_tokens, block_size)
    exporter = KVCopier(source, chunk_bytes=sum(widths) * 2 * 97)  # 97-token chunks
    chunks = [c.copy() for c in exporter.export(slots)]
    assert sum(c.size for c in chunks) == num_tokens * sum(widths) * 2
    expected = pack_kv(source, slots)
    for got, rows in zip(chunk_layers(chunks, exporter), expected):
        assert torch.equal(got, rows.view(torch.uint8))
    target = [torch.zeros(blocks * 4 + 4, 16, w, device="cuda").bfloat16() for w in widths]
    target_slots = token_slots(list(range(2, 2 + -(-num_tokens // 16))), num_tokens, 16)
    KVCopier(target, chunk_bytes=sum(widths) * 2 * 50).import_(target_slots, chunks)
    for got, rows in zip(pack_kv(target, target_slots), expected):
        assert torch.equal(got, rows)


def test_gpu_cache_rows_past_two_gib():
    """The one-launch gather and scatter at slots whose byte offsets pass 2**31 (a layer of
    2.4 GB), against the per-layer torch reference."""
    num_slots, width = 2**21 + 64, 1152
    layers = [torch.zeros(num_slots, width, dtype=torch.uint8, device="cuda") for _ in range(2)]
    slots = torch.tensor([5, num_slots - 1, num_slots - 40, 2**21 - 3], device="cuda")
    packed = torch.randint(0, 256, (len(slots) * 2 * width,), dtype=torch.uint8, device="cuda")
    table = CacheRowsTable(layers)
    cache_rows(table, packed, slots, to_cache=True)
    back = torch.empty_like(packed)
    cache_rows(table, back, slots, to_cache=False)
    assert torch.equal(back, packed)
    expected = torch.empty_like(packed)
    cache_rows_reference(layers, expected, slots, to_cache=False)
    assert torch.equal(expected, packed)


@pytest.mark.parametrize("run_blocks", [1, 8])
def test_gpu_pinned_chunks_by_runs_exact(run_blocks):
    """Page-locked chunks move by batched row copies where the slots run long (8 blocks of 16
    tokens: copies of 147 KB) and through staging and one kernel where they do not (one
    block: 18 KB); both exact, both directions, chunks split across runs."""
    layers, block_size, row, num_tokens = 27, 16, 576, 1000
    num_blocks = -(-num_tokens // block_size)
    source = random_caches(layers, 512, block_size, row, torch.bfloat16, seed=4)
    groups = torch.randperm(512 // run_blocks)[: -(-num_blocks // run_blocks)].tolist()
    table = [run_blocks * g + b for g in groups for b in range(run_blocks)][:num_blocks]
    slots = token_slots(table, num_tokens, block_size)
    copier = KVCopier(source, chunk_bytes=layers * row * 2 * 300)  # 300-token chunks
    assert copier.copies_directly(slots) == (run_blocks == 8)
    chunks = [
        torch.empty((end - start) * copier.token_bytes, dtype=torch.uint8, pin_memory=True)
        for start, end in copier.chunk_bounds(num_tokens)
    ]
    copier.export_into(slots, chunks)
    expected = pack_kv(source, slots)
    for got, rows in zip(chunk_layers([c.numpy() for c in chunks], copier), expected):
        assert torch.equal(got, rows.view(torch.uint8))
    target = random_caches(layers, 512, block_size, row, torch.bfloat16, seed=5)
    before = pack_kv(target, torch.arange(512 * block_size))
    KVCopier(target).import_(slots, chunks, pinned=True)
    for layer, rows in enumerate(pack_kv(target, slots)):
        assert torch.equal(rows, expected[layer])
    untouched = torch.ones(512 * block_size, dtype=torch.bool)
    untouched[slots] = False
    for layer, rows in enumerate(pack_kv(target, torch.arange(512 * block_size))):
        assert torch.equal(rows[untouched], before[layer][untouched])
