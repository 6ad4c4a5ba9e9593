"""KV hand-off data movement is exact: pack -> object store -> unpack into a cache with another
block size, and K/V heads merged or split between tensor-parallel layouts, from the object store
or the exporters' arenas; a full arena sends the export through the object store; `python -m
rayinfer.bench handoff` measures the arena path against the object-store path on the CPU."""

import json
import pickle

import pytest
import torch

from rayinfer.bench import handoff as bench_handoff
from rayinfer.engine_config import KVHandoffConfig
from rayinfer.workers.handoff_io import HandoffIO
from rayinfer.workers.runner.kv_cache import KVCache
from rayinfer.workers.runner.kv_transfer import (
    KVPayload,
    pack_kv,
    select_kv_heads,
    token_slots,
    unpack_kv,
)


def random_caches(num_layers, num_blocks, block_size, shape, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(num_blocks, block_size, *shape, generator=generator).to(dtype)
        for _ in range(num_layers)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(80,), (2, 4, 8)], ids=["mla-latent", "gqa"])
def test_pack_travel_unpack_is_bit_exact(ray_cluster, dtype, shape):
    source = random_caches(3, 8, 4, shape, dtype)
    source_slots = token_slots([5, 2, 7], num_tokens=11, block_size=4)
    payload = KVPayload.from_tensors(pack_kv(source, source_slots), generator_state=None)
    assert payload.num_bytes == 3 * 11 * torch.Size(shape).numel() * source[0].element_size()
    travelled = ray_cluster.get(ray_cluster.put(payload))
    assert pickle.loads(pickle.dumps(payload)).shape == payload.shape
    target = [torch.zeros(16, 3, *shape, dtype=dtype) for _ in range(3)]  # block size 3
    target_slots = token_slots([9, 0, 4, 11], num_tokens=11, block_size=3)
    unpack_kv(target, target_slots, travelled.kv)
    for source_layer, target_layer in zip(source, target):
        flat_source = source_layer.view(-1, *shape)[source_slots]
        flat_target = target_layer.view(-1, *shape)[target_slots]
        assert torch.equal(flat_source.view(torch.uint8), flat_target.view(torch.uint8))


def test_heads_split_two_ways_merge_and_reslice_exactly():
    full = torch.randn(5, 2, 4, 8)  # [N, 2, heads, D] of one layer
    halves = [
        KVPayload.from_tensors(
            [full[:, :, 2 * r : 2 * r + 2]], generator_state=None, kv_heads=(2 * r, 2)
        )
        for r in range(2)
    ]
    assert torch.equal(select_kv_heads(halves, (0, 4))[0], full)  # tp=2 -> tp=1
    assert torch.equal(select_kv_heads(halves, (1, 2))[0], full[:, :, 1:3])  # straddles both
    whole = [KVPayload.from_tensors([full], generator_state=None, kv_heads=(0, 4))]
    assert torch.equal(select_kv_heads(whole, (3, 1))[0], full[:, :, 3:4])  # tp=1 -> tp=4


def test_mismatched_layout_is_refused():
    payload = KVPayload.from_tensors([torch.zeros(2, 80)], generator_state=None)
    with pytest.raises(ValueError, match="token shape"):
        unpack_kv([torch.zeros(4, 2, 96)], token_slots([0], 2, 2), payload.kv)
    with pytest.raises(ValueError, match="layers"):
        unpack_kv([torch.zeros(4, 2, 80)] * 2, token_slots([0], 2, 2), payload.kv)


def test_heads_of_two_arenas_merge_into_one_rank_exactly():
    """A tp=2 prefill's two arena exports (its K/V heads split) into a tp=1 decode cache."""
    layers = [torch.randn(4, 4, 2, 4, 8) for _ in range(2)]  # [blocks, block, 2, heads, D]
    exporters = [HandoffIO(is_cuda=False) for _ in range(2)]
    importer = HandoffIO(is_cuda=False)
    try:
        headers = [
            io.export(
                KVCache(
                    [t[:, :, :, 2 * r : 2 * r + 2].contiguous() for t in layers], 4, (2 * r, 2)
                ),
                [3, 1],
                6,
                None,
            )  # fmt: skip
            for r, io in enumerate(exporters)
        ]
        assert all(h.arena is not None for h in headers)
        target = KVCache([torch.zeros(3, 8, 2, 4, 8) for _ in range(2)], 8, (0, 4))
        importer.import_(target, [2], headers)
        slots = token_slots([3, 1], 6, 4)
        for source, landed in zip(layers, target.layers):
            assert torch.equal(landed.view(-1, 2, 4, 8)[16:22], source.view(-1, 2, 4, 8)[slots])
    finally:
        for io in (*exporters, importer):
            io.close()


def test_a_full_arena_sends_the_export_through_the_object_store(ray_cluster):
    layers = [torch.randn(8, 16, 4096) for _ in range(2)]  # 32 KiB per token: 64 tokens = 2 MiB
    exporter = HandoffIO(is_cuda=False, config=KVHandoffConfig(arena_bytes=1 << 20))
    importer = HandoffIO(is_cuda=False)
    try:
        small = exporter.export(KVCache(layers, 16, None), [0], 8, None)
        assert small.arena is not None  # 256 KiB fits
        big = exporter.export(KVCache(layers, 16, None), [7, 2, 5, 0], 64, None)
        assert big.arena is None and big.timings["path"] == "object_store"
        assert all(isinstance(chunk, ray_cluster.ObjectRef) for chunk in big.chunks)
        target = KVCache([torch.zeros(8, 16, 4096) for _ in range(2)], 16, None)
        assert importer.import_(target, [1, 3, 4, 6], [big]).timings["path"] == "object_store"
        expected = pack_kv(layers, token_slots([7, 2, 5, 0], 64, 16))
        assert all(torch.equal(a, b) for a, b in zip(pack_kv(target.layers, token_slots(
            [1, 3, 4, 6], 64, 16)), expected))  # fmt: skip
    finally:
        exporter.close()
        importer.close()


def test_bench_handoff_runs_every_path_on_the_cpu(ray_cluster, tmp_path):
    out = tmp_path / "handoff.json"
    argv = ["--tokens", "70", "--layers", "3", "--row", "64", "--chunk-mb", "1",
            "--repeats", "1", "--json", str(out)]  # fmt: skip
    assert bench_handoff.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["path"]) for r in rows] == [
        ("per-layer", "per-layer"), ("object-store", "object_store"), ("shm", "shm"),
    ]  # fmt: skip
    assert all(r["exact"] for r in rows)
    shm = rows[2]
    assert shm["export_put_s"] == 0 and shm["export_copy_s"] > 0 and shm["import_copy_s"] > 0
    assert all(r["export_s"] > 0 and r["import_s"] > 0 for r in rows)
