"""Block manager: allocation, freeing and the prefix cache, without torch."""

from rayinfer.engine.block_manager import BlockManager
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.engine.sequence import Sequence


def make_seq(request_id: str, tokens: list[int]) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams())


def compute_all(manager: BlockManager, seq: Sequence) -> None:
    num_new = seq.num_uncomputed_tokens
    manager.allocate_slots(seq, num_new)
    seq.num_computed_tokens += num_new
    manager.mark_computed(seq)


def test_allocate_and_free_return_every_block():
    manager = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a", list(range(10)))
    manager.allocate_cached_prefix(seq)
    assert manager.can_allocate_slots(seq, 10)
    compute_all(manager, seq)
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 5
    manager.free(seq)
    assert manager.num_free_blocks == 8 and seq.block_table == []


def test_shared_prefix_reuses_full_blocks_and_counts_them():
    manager = BlockManager(num_blocks=16, block_size=4)
    first = make_seq("a", list(range(10)))
    manager.allocate_cached_prefix(first)
    compute_all(manager, first)
    second = make_seq("b", list(range(9)) + [99, 98])
    manager.allocate_cached_prefix(second)
    assert second.num_cached_tokens == 8
    assert second.block_table == first.block_table[:2]
    assert manager.num_prefix_hit_tokens == 8
    assert manager.blocks[first.block_table[0]].ref_count == 2


def test_prefix_cache_survives_free_until_block_is_reused():
    manager = BlockManager(num_blocks=4, block_size=4)
    first = make_seq("a", list(range(8)) + [1])
    manager.allocate_cached_prefix(first)
    compute_all(manager, first)
    manager.free(first)
    again = make_seq("b", list(range(8)) + [2])
    manager.allocate_cached_prefix(again)
    assert again.num_cached_tokens == 8


def test_fully_cached_prompt_still_computes_its_last_token():
    manager = BlockManager(num_blocks=8, block_size=4)
    first = make_seq("a", list(range(8)))
    manager.allocate_cached_prefix(first)
    compute_all(manager, first)
    same = make_seq("b", list(range(8)))
    manager.allocate_cached_prefix(same)
    assert same.num_cached_tokens == 4  # the last block is recomputed in a block of its own
    assert same.num_uncomputed_tokens == 4


def test_disabled_prefix_cache_shares_nothing():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    first = make_seq("a", list(range(9)))
    manager.allocate_cached_prefix(first)
    compute_all(manager, first)
    second = make_seq("b", list(range(9)))
    manager.allocate_cached_prefix(second)
    assert second.num_cached_tokens == 0
