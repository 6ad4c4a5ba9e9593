"""The attention metadata built in numpy equals a plain per-token Python reading of the same
batch: slots, sequence starts, context lengths and -1 padded block tables."""

import random

import pytest
import torch

from rayinfer.layers.forward_context import build_attention_metadata, token_positions


def reference(query_lens, seq_lens, tables, block_size):
    slots, positions = [], []
    for query_len, seq_len, table in zip(query_lens, seq_lens, tables):
        for position in range(seq_len - query_len, seq_len):
            positions.append(position)
            slots.append(table[position // block_size] * block_size + position % block_size)
    width = max((len(t) for t in tables), default=0)
    padded = [t + [-1] * (width - len(t)) for t in tables]
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    return positions, slots, starts, padded


@pytest.mark.parametrize("seed", range(6))
def test_metadata_matches_the_per_token_reading(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    query_lens, seq_lens, tables, free = [], [], [], list(range(4000))
    rng.shuffle(free)
    for _ in range(rng.randint(0, 7)):
        seq_len = rng.randint(1, 300)
        query_len = rng.choice([0, 1, seq_len, rng.randint(1, seq_len)])  # empty, decode, chunk
        blocks = -(-seq_len // block_size) + rng.randint(0, 2)  # tables may hold spare blocks
        tables.append([free.pop() for _ in range(blocks)])
        query_lens.append(query_len)
        seq_lens.append(seq_len)
    positions, slots, starts, padded = reference(query_lens, seq_lens, tables, block_size)
    attn = build_attention_metadata(query_lens, seq_lens, tables, block_size)
    assert token_positions(query_lens, seq_lens).tolist() == positions
    assert attn.slot_mapping.dtype == torch.int64 and attn.slot_mapping.tolist() == slots
    assert attn.query_start_loc.tolist() == starts and attn.seq_lens.tolist() == seq_lens
    assert attn.block_tables.dtype == torch.int32
    assert attn.block_tables.shape == (len(tables), max(map(len, tables), default=0))
    assert attn.block_tables.tolist() == padded
