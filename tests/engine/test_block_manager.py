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


# --- the window pool (DeepSeek-V4's hybrid cache) --------------------------------------------


def window_manager(num_window_blocks=16, **kwargs) -> BlockManager:
    """Blocks of 4 tokens; a step reads window state of the 6 tokens before it."""
    return BlockManager(16, 4, num_window_blocks=num_window_blocks, window_span=6, **kwargs)


def step(manager: BlockManager, seq: Sequence, num_new: int) -> None:
    assert manager.can_allocate_slots(seq, num_new)
    manager.allocate_slots(seq, num_new)
    seq.num_computed_tokens += num_new
    manager.mark_computed(seq)


def held(table: list[int]) -> list[int]:
    return [i for i, block in enumerate(table) if block >= 0]


def test_a_sequence_holds_window_blocks_only_for_its_last_span_of_tokens():
    manager = window_manager()
    seq = make_seq("a", list(range(30)))
    manager.allocate_cached_prefix(seq)
    manager.allocate_slots(seq, 30)  # a 30-token prefill writes the window rows of all of them
    assert held(seq.window_table) == list(range(8))
    seq.num_computed_tokens = 30
    manager.mark_computed(seq)
    assert held(seq.window_table) == [6, 7]  # tokens 24..29 hold what a step at 30 reads
    assert manager.window_pool.num_free == 14
    for _ in range(5):  # decodes: the window slides, blocks go back as it leaves them
        seq.output_token_ids.append(1)
        step(manager, seq, 1)
    assert held(seq.window_table) == [7, 8] and len(seq.window_table) == len(seq.block_table)
    manager.free(seq)
    assert manager.window_pool.num_free == 16 and manager.num_free_blocks == 16


def test_a_prefix_hit_ends_where_its_window_blocks_are_no_longer_cached():
    manager = window_manager(num_window_blocks=6)
    first = make_seq("a", list(range(24)))
    manager.allocate_cached_prefix(first)
    step(manager, first, 24)  # its window blocks 4, 5 held; 0-3 released with their hashes
    manager.free(first)
    again = make_seq("b", list(range(24)) + [7])
    manager.allocate_cached_prefix(again)  # every window block still cached: the whole prefix
    assert again.num_cached_tokens == 24 and held(again.window_table) == [4, 5]
    last, blocks = again.window_table[5], list(again.block_table)
    manager.free(again)
    # another sequence takes the window block of tokens 20-23 (its hash forgotten on reuse)
    manager.window_pool.forget_hash(manager.window_pool.blocks[last])
    late = make_seq("e", list(range(24)) + [7])
    manager.allocate_cached_prefix(late)
    # a hit at 24 needs tokens 18-23's window state: it ends at 20 (tokens 14-19's is there)
    assert late.num_cached_tokens == 20 and held(late.window_table) == [3, 4]
    assert late.block_table == blocks[:5] and len(late.window_table) == 5


def test_an_import_takes_window_blocks_for_its_last_tokens_only():
    manager = window_manager(num_window_blocks=4)
    seq = make_seq("a", list(range(40)))
    assert manager.can_allocate_slots(seq, 40, imported=True)
    assert not manager.can_allocate_slots(seq, 40)  # computing them would need 10
    manager.allocate_slots(seq, 40, imported=True)
    assert len(seq.block_table) == 10 and held(seq.window_table) == [8, 9]


def test_a_full_window_pool_refuses_more():
    manager = window_manager(num_window_blocks=3)
    seq = make_seq("a", list(range(16)))
    assert not manager.can_allocate_slots(seq, 16)  # 4 window blocks to compute 16 tokens
    assert manager.can_allocate_slots(seq, 12)
