"""Splitting a step into two micro-batches: the split point and the split contexts."""

from rayinfer.layers.forward_context import (
    ForwardContext,
    build_attention_metadata,
    split_forward_context,
)
from rayinfer.layers.two_batch_overlap import balanced_split


def test_balanced_split_halves_the_tokens():
    assert balanced_split([4, 4, 4, 4]) == 2
    assert balanced_split([10, 1, 1]) == 1
    assert balanced_split([1, 1, 10]) == 2
    assert balanced_split([7]) == 0  # one sequence: the first micro-batch is empty
    assert balanced_split([]) == 0


def test_split_contexts_cover_the_batch_exactly():
    metadata = build_attention_metadata([3, 1, 2], [3, 5, 4], [[0], [1, 2], [3]], block_size=4)
    first, second = split_forward_context(ForwardContext(metadata, []), 1)
    assert first.attn.query_start_loc.tolist() == [0, 3]
    assert second.attn.query_start_loc.tolist() == [0, 1, 3]
    assert first.attn.slot_mapping.tolist() + second.attn.slot_mapping.tolist() == (
        metadata.slot_mapping.tolist()
    )
    assert second.attn.block_tables.tolist() == [[1, 2], [3, -1]]
    assert second.attn.seq_lens_cpu == [5, 4] and second.attn.query_lens_cpu == [1, 2]
    _, empty = split_forward_context(ForwardContext(metadata, []), 3)
    assert empty.attn.num_seqs == 0 and empty.attn.slot_mapping.numel() == 0
