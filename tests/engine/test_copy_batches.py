"""The hand-off's batched row copies, host side: a request's slots as runs of consecutive slots,
the copies' mean size that picks them (kv_copy.DIRECT_MIN_COPY_BYTES), and the block manager's
ascending hand-out that makes a prompt's blocks such runs. The copies themselves need a GPU
(tests/gpu/test_kv_copy.py)."""

import numpy as np
import torch

from rayinfer.engine.block_manager import BlockManager
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.engine.sequence import Sequence
from rayinfer.workers.runner.copy_batches import (
    RowCopies,
    batch_copies_available,
    mean_copy_bytes,
    slot_runs,
)
from rayinfer.workers.runner.kv_copy import KVCopier


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
    assert copier._row_copies is None and not copier._copies_directly(torch.arange(64))


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
