"""The hand-off's batched row copies, host side: a request's slots as runs of consecutive slots,
the copies' mean size that picks them (kv_copy.DIRECT_MIN_COPY_BYTES), and the block manager's
ascending hand-out that makes a prompt's blocks such runs. The copies themselves need a GPU
(tests/gpu/test_kv_copy.py)."""

import ctypes

import numpy as np
import pytest
import torch

from rayinfer.engine.block_manager import BlockManager
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.engine.sequence import Sequence
from rayinfer.workers.runner import copy_batches, kv_copy
from rayinfer.workers.runner.copy_batches import (
    RowCopies,
    batch_copies_available,
    mean_copy_bytes,
    slot_runs,
)
from rayinfer.workers.runner.kv_copy import KVCopier
from rayinfer.workers.runner.kv_transfer import layer_rows, pack_kv, token_slots


def test_slot_runs_split_where_slots_stop_being_consecutive():
    tokens, first, lengths = slot_runs(np.array([5, 6, 7, 20, 21, 3, 4, 4]))
    assert tokens.tolist() == [0, 3, 5, 7]
    assert first.tolist() == [5, 20, 3, 4]
    assert lengths.tolist() == [3, 2, 2, 1]
    assert [a.tolist() for a in slot_runs(np.array([], dtype=np.int64))] == [[], [], []]
    assert mean_copy_bytes(np.arange(100), token_bytes=30, num_layers=3) == 1000.0
    assert mean_copy_bytes(np.arange(100)[::-1], token_bytes=30, num_layers=3) == 10.0


def test_no_batched_copies_on_the_cpu():
    assert not batch_copies_available(torch.device("cpu"))
    copier = KVCopier([torch.zeros(4, 16, 8) for _ in range(2)])
    assert copier._row_copies is None and not copier.copies_directly(torch.arange(64))


def test_row_copies_address_each_layer_and_run():
    rows = [torch.zeros(64, 12, dtype=torch.uint8), torch.zeros(64, 4, dtype=torch.uint8)]
    copies = RowCopies(rows)
    assert copies.row_bytes.ravel().tolist() == [12, 4]
    assert copies.cache_base.ravel().tolist() == [r.data_ptr() for r in rows]


def test_a_sequence_takes_its_new_blocks_in_ascending_order():
    manager = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=False)
    first = Sequence("a", list(range(40)), SamplingParams(max_tokens=4))
    manager.allocate_slots(first, 40)
    manager.free(first)  # released last block first: the free list now runs 9, 8, ..., 0
    second = Sequence("b", list(range(40)), SamplingParams(max_tokens=4))
    manager.allocate_slots(second, 40)
    assert second.block_table == list(range(10))  # one run, not ten


class _HostStream:
    def synchronize(self) -> None:
        pass


def _memmove_batch(dsts, srcs, sizes, stream) -> None:
    """cuMemcpyBatchAsync's effect on host addresses (what the driver does on the GPU)."""
    for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
        ctypes.memmove(dst, src, size)


@pytest.mark.parametrize("widths", [(24, 24, 24), (40, 8, 40)])
def test_kv_copier_by_runs_moves_the_right_bytes(monkeypatch, widths):
    """KVCopier's batched-copy branch (export into chunks, import from them, chunks split across
    runs) with the driver's batch done by memmove on host memory: the addresses, sizes and
    chunk pieces are right; tests/gpu/test_kv_copy.py runs the real driver call."""
    monkeypatch.setattr(copy_batches, "_batch_copy", _memmove_batch)
    monkeypatch.setattr(copy_batches, "_make_context_current", lambda device_index: None)
    monkeypatch.setattr(kv_copy, "DIRECT_MIN_COPY_BYTES", 1)
    generator = torch.Generator().manual_seed(len(widths))
    caches = [torch.randint(0, 256, (32, 4, w), generator=generator, dtype=torch.uint8)
              for w in widths]  # fmt: skip
    table = [9, 10, 11, 3, 4, 20, 21, 22, 23, 0]
    slots = token_slots(table, 37, 4)
    copier = _direct_copier(caches, chunk_tokens=10)
    assert copier.copies_directly(slots)
    chunks = [torch.zeros((end - start) * sum(widths), dtype=torch.uint8)
              for start, end in copier.chunk_bounds(37)]  # fmt: skip
    copier.export_into(slots, chunks)
    expected = pack_kv(caches, slots)
    got = [torch.cat(parts) for parts in zip(*(layer_rows(c, copier.layer_bytes) for c in chunks))]
    for layer, rows in zip(got, expected):
        assert torch.equal(layer, rows.reshape(37, -1))

    targets = [torch.zeros_like(cache) for cache in caches]
    target_slots = token_slots([30, 31, 5, 6, 7, 8, 12, 13, 14, 15], 37, 4)
    importer = _direct_copier(targets, chunk_tokens=7)  # pieces shorter than the chunks
    importer.import_(target_slots, chunks, pinned=True)
    for target, rows in zip(pack_kv(targets, target_slots), expected):
        assert torch.equal(target, rows)
    assert sum(int(t.sum()) for t in targets) == sum(int(r.sum()) for r in expected)


def _direct_copier(caches, chunk_tokens: int) -> KVCopier:
    """A KVCopier over host caches taking its batched-copy branch, as on a GPU."""
    copier = KVCopier(caches)
    copier.chunk_tokens = chunk_tokens
    copier.is_cuda = True
    copier._stream = _HostStream()
    copier._row_copies = RowCopies(copier.rows)
    return copier


def test_a_refused_batch_stages_instead(monkeypatch):
    """Where the driver refuses the batch, the copier stages that copy and every later one
    (here on host memory, whose staged branch is the CPU one)."""

    def refuse(dsts, srcs, sizes, stream):
        raise RuntimeError("cuMemcpyBatchAsync failed (CUresult 1) on 3 copies")

    monkeypatch.setattr(copy_batches, "_batch_copy", refuse)
    monkeypatch.setattr(copy_batches, "_make_context_current", lambda device_index: None)
    caches = [torch.arange(8 * 4 * 6, dtype=torch.uint8).view(8, 4, 6)]
    copier = _direct_copier(caches, chunk_tokens=32)
    monkeypatch.setattr(kv_copy, "DIRECT_MIN_COPY_BYTES", 1)
    assert not copier._directly(copier._export_by_runs, torch.arange(8), [torch.zeros(48)])
    assert copier._row_copies is None and not copier.copies_directly(torch.arange(8))
