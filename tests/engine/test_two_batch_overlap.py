"""Splitting a step into two micro-batches: the split point and the split contexts."""

from rayinfer.layers.forward_context import (
    ForwardContext,
    build_attention_metadata,
    split_forward_context,
)


def test_split_contexts_cover_the_batch_exactly():
    metadata = build_attention_metadata([3, 1, 2], [3, 5, 4], [[0], [1, 2], [3]], block_size=4)
    first, second = split_forward_context(ForwardContext(metadata, []), 3)
    assert first.attn.query_start_loc.tolist() == [0, 3]
    assert second.attn.query_start_loc.tolist() == [0, 1, 3]
    assert first.attn.slot_mapping.tolist() + second.attn.slot_mapping.tolist() == (
        metadata.slot_mapping.tolist()
    )
    assert second.attn.block_tables.tolist() == [[1, 2], [3, -1]]
    assert second.attn.seq_lens_cpu == [5, 4] and second.attn.query_lens_cpu == [1, 2]
    _, empty = split_forward_context(ForwardContext(metadata, []), 6)
    assert empty.attn.num_seqs == 0 and empty.attn.slot_mapping.numel() == 0


def test_a_sequence_cut_by_the_split_becomes_two_chunks():
    """Seq 0 has 3 new tokens after 2 cached; a split after its first new token gives a chunk of 1
    (context 3) and a chunk of 2 (context 5) that reads the first through the cache."""
    metadata = build_attention_metadata([3, 1], [5, 4], [[0, 1], [2]], block_size=4)
    first, second = split_forward_context(ForwardContext(metadata, []), 1)
    assert first.attn.query_lens_cpu == [1] and first.attn.seq_lens_cpu == [3]
    assert second.attn.query_lens_cpu == [2, 1] and second.attn.seq_lens_cpu == [5, 4]
    assert second.attn.block_tables.tolist() == [[0, 1], [2, -1]]
    assert second.attn.query_start_loc.tolist() == [0, 2, 3]
    assert first.attn.slot_mapping.tolist() == metadata.slot_mapping.tolist()[:1]


def test_micro_batch_sizes_and_when_to_overlap():
    import torch

    from rayinfer.layers.two_batch_overlap import MIN_TOKENS_TO_OVERLAP_ON_CUDA, worth_overlapping
    from rayinfer.overlap_config import OverlapConfig

    # an empty half computes one placeholder token; peers derive these from the step's counts
    sizes = OverlapConfig().micro_batch_sizes
    assert [sizes(t) for t in (1, 2, 7)] == [(1, 1), (1, 1), (3, 4)]
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    small, large = MIN_TOKENS_TO_OVERLAP_ON_CUDA - 1, MIN_TOKENS_TO_OVERLAP_ON_CUDA
    assert not worth_overlapping([small, 5], cuda)
    assert worth_overlapping([5, large], cuda)  # one rank's long step decides for all
    assert worth_overlapping([1], cpu)  # CPU lanes check the logic at any size


def test_the_first_micro_batch_share_is_a_setting():
    import pytest

    from rayinfer.config import ConfigError
    from rayinfer.overlap_config import OverlapConfig

    overlap = OverlapConfig(first_share=0.6)
    assert overlap.micro_batch_sizes(10) == (6, 4) and overlap.first_micro_batch_tokens(10) == 6
    assert overlap.micro_batch_sizes(1) == (1, 1)  # the empty first one computes a placeholder
    for bad in (1, 0, "half", True):
        with pytest.raises(ConfigError, match=r"overlap\.first_share=.*between 0 and 1"):
            OverlapConfig(first_share=bad)
