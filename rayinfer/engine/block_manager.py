"""The paged KV cache's bookkeeping: which blocks each sequence holds, and a prefix cache.

A full block is identified by a hash chained over every token before and in it, so two prompts
that share a prefix share its blocks. Freed blocks keep their hash until they are reused, so a
later request with the same prefix finds them (least recently freed are reused first).
Plain Python, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from rayinfer.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None


def chained_block_hash(prev_hash: int | None, token_ids: list[int]) -> int:
    return hash((prev_hash, tuple(token_ids)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_id_by_hash: dict[int, int] = {}
        self.num_prefix_hit_tokens = 0  # tokens served from the prefix cache, over all requests
        self._num_hashed_blocks: dict[str, int] = {}  # request_id -> leading blocks with a hash

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / len(self.blocks)

    def allocate_cached_prefix(self, seq: Sequence) -> None:
        """Give a newly admitted sequence the cached blocks of its longest cached prefix."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return  # (prompt log-probabilities need every prompt position computed)
        prev_hash = None
        # Keep at least one token to compute so the request gets logits for its next token.
        max_cached_blocks = (seq.num_tokens - 1) // self.block_size
        for index in range(max_cached_blocks):
            tokens = seq.token_slice(index * self.block_size, (index + 1) * self.block_size)
            prev_hash = chained_block_hash(prev_hash, tokens)
            block_id = self.block_id_by_hash.get(prev_hash)
            if block_id is None:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size
        self._num_hashed_blocks[seq.request_id] = len(seq.block_table)
        self.num_prefix_hit_tokens += seq.num_cached_tokens

    def can_allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = seq.num_blocks_needed(self.block_size, seq.num_computed_tokens + num_new_tokens)
        return needed - len(seq.block_table) <= self.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table so the next `num_new_tokens` tokens have cache slots."""
        needed = seq.num_blocks_needed(self.block_size, seq.num_computed_tokens + num_new_tokens)
        while len(seq.block_table) < needed:
            block_id = next(iter(self.free_block_ids))
            self._take(block_id)
            self._forget_hash(self.blocks[block_id])
            seq.block_table.append(block_id)

    def mark_computed(self, seq: Sequence) -> None:
        """Publish the hashes of blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        num_hashed = self._num_hashed_blocks.get(seq.request_id, 0)
        if num_full <= num_hashed:  # no block filled up this step (most decode steps)
            return
        prev_hash = self.blocks[seq.block_table[num_hashed - 1]].hash if num_hashed else None
        for index in range(num_hashed, num_full):
            tokens = seq.token_slice(index * self.block_size, (index + 1) * self.block_size)
            prev_hash = chained_block_hash(prev_hash, tokens)
            block = self.blocks[seq.block_table[index]]
            if prev_hash not in self.block_id_by_hash:
                block.hash = prev_hash
                self.block_id_by_hash[prev_hash] = block.block_id
            elif block.hash != prev_hash:
                # Same content already cached in another block: chain through a private hash
                # so that this block is never offered to others.
                block.hash = prev_hash
        self._num_hashed_blocks[seq.request_id] = max(num_full, num_hashed)

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._num_hashed_blocks.pop(seq.request_id, None)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def _forget_hash(self, block: Block) -> None:
        if block.hash is not None and self.block_id_by_hash.get(block.hash) == block.block_id:
            del self.block_id_by_hash[block.hash]
        block.hash = None
