"""The paged KV cache's bookkeeping: which blocks each sequence holds, and a prefix cache.

A full block is identified by a hash chained over every token before and in it, so two prompts
that share a prefix share its blocks. Freed blocks keep their hash until they are reused, so a
later request with the same prefix finds them (least recently freed are reused first).

A model whose per-token state is needed only for a bounded span of recent tokens (DeepSeek-V4's
hybrid cache: the sliding window's raw keys and the compressors' open groups) keeps that state in
a second pool, the window pool, with a table per sequence aligned to its block table
(`Sequence.window_table`, -1 where the block's window state has been released or never held).
A sequence holds window blocks only for its last `window_span` tokens and for the tokens a step
computes; older ones go back to the pool as soon as the step that passed them is done, keeping
their hash, so a later prefix hit can take them if they are still there (the hit ends where the
window blocks before it are all cached). Plain Python, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from rayinfer.engine.sequence import Sequence

NO_BLOCK = -1  # a window-table entry whose window state is not held


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None


def chained_block_hash(prev_hash: int | None, token_ids: list[int]) -> int:
    return hash((prev_hash, tuple(token_ids)))


class BlockPool:
    """Blocks, their free list (least recently freed first) and the hash -> block map."""

    def __init__(self, num_blocks: int):
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_id_by_hash: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_block_ids)

    def take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_block_ids[block_id]
        block.ref_count += 1

    def take_fresh(self) -> int:
        """A free block, its old hash forgotten."""
        block_id = next(iter(self.free_block_ids))
        self.take(block_id)
        self.forget_hash(self.blocks[block_id])
        return block_id

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block_id] = None

    def publish(self, block_id: int, block_hash: int) -> None:
        """Give a block the hash of its content; offered to others unless another block holds
        the same content already (then its hash is private: never matched)."""
        self.blocks[block_id].hash = block_hash
        self.block_id_by_hash.setdefault(block_hash, block_id)

    def forget_hash(self, block: Block) -> None:
        if block.hash is not None and self.block_id_by_hash.get(block.hash) == block.block_id:
            del self.block_id_by_hash[block.hash]
        block.hash = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_window_blocks: int = 0,
        window_span: int = 0,
    ):
        """num_window_blocks, window_span: the window pool's size and how many tokens before a
        step's first one it reads (0: no window pool)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.window_span = window_span
        self.window_pool = BlockPool(num_window_blocks) if window_span > 0 else None
        self.num_prefix_hit_tokens = 0  # tokens served from the prefix cache, over all requests
        self._num_hashed_blocks: dict[str, int] = {}  # request_id -> leading blocks with a hash

    @property
    def blocks(self) -> list[Block]:
        return self.pool.blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / len(self.blocks)

    def allocate_cached_prefix(self, seq: Sequence) -> None:
        """Give a newly admitted sequence the cached blocks of its longest cached prefix."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return  # (prompt log-probabilities need every prompt position computed)
        hashes = []
        # Keep at least one token to compute so the request gets logits for its next token.
        max_cached_blocks = (seq.num_tokens - 1) // self.block_size
        for index in range(max_cached_blocks):
            tokens = seq.token_slice(index * self.block_size, (index + 1) * self.block_size)
            block_hash = chained_block_hash(hashes[-1] if hashes else None, tokens)
            if block_hash not in self.pool.block_id_by_hash:
                break
            hashes.append(block_hash)
        num_cached = self._cached_with_window(hashes)
        for index in range(num_cached):
            block_id = self.pool.block_id_by_hash[hashes[index]]
            self.pool.take(block_id)
            seq.block_table.append(block_id)
        if self.window_pool is not None:
            first_window = self._first_window_block(num_cached * self.block_size)
            seq.window_table = [NO_BLOCK] * first_window
            for index in range(first_window, num_cached):
                block_id = self.window_pool.block_id_by_hash[hashes[index]]
                self.window_pool.take(block_id)
                seq.window_table.append(block_id)
        seq.num_computed_tokens = seq.num_cached_tokens = num_cached * self.block_size
        self._num_hashed_blocks[seq.request_id] = num_cached
        self.num_prefix_hit_tokens += seq.num_cached_tokens

    def _cached_with_window(self, hashes: list[int]) -> int:
        """The longest run of the cached blocks `hashes` whose window state (the blocks of the
        last window_span tokens before its end) is cached too."""
        if self.window_pool is None:
            return len(hashes)
        cached = self.window_pool.block_id_by_hash
        for num_blocks in range(len(hashes), 0, -1):
            first = self._first_window_block(num_blocks * self.block_size)
            if all(hashes[index] in cached for index in range(first, num_blocks)):
                return num_blocks
        return 0

    def _first_window_block(self, start: int) -> int:
        """The first block a step that starts at token `start` reads window state from."""
        return max(start - self.window_span, 0) // self.block_size

    def can_allocate_slots(
        self, seq: Sequence, num_new_tokens: int, imported: bool = False
    ) -> bool:
        """Whether `allocate_slots` (same arguments) can take the blocks it needs."""
        end = seq.num_computed_tokens + num_new_tokens
        needed = seq.num_blocks_needed(self.block_size, end)
        if needed - len(seq.block_table) > self.num_free_blocks:
            return False
        if self.window_pool is None:
            return True
        start = end if imported else seq.num_computed_tokens
        return self._window_blocks_needed(seq, end, start) <= self.window_pool.num_free

    def _window_blocks_needed(self, seq: Sequence, end: int, start: int) -> int:
        """Window blocks to take so that tokens [start - window_span, end) have window state."""
        first = self._first_window_block(start)
        last = seq.num_blocks_needed(self.block_size, end)
        table = seq.window_table
        return sum(1 for i in range(first, last) if i >= len(table) or table[i] == NO_BLOCK)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, imported: bool = False) -> None:
        """Grow the block table so the next `num_new_tokens` tokens have cache slots.

        imported: the tokens arrive with their KV (a hand-off) instead of being computed, so
        window state is needed for the last window_span of them only."""
        end = seq.num_computed_tokens + num_new_tokens
        needed = seq.num_blocks_needed(self.block_size, end)
        # The blocks the free list gives (least recently freed first: a freed sequence's last
        # block first) in ascending order, so that a prompt's blocks form long runs of
        # consecutive slots, which the KV hand-off copies one run per layer.
        fresh = [self.pool.take_fresh() for _ in range(needed - len(seq.block_table))]
        seq.block_table.extend(sorted(fresh))
        if self.window_pool is None:
            return
        first = self._first_window_block(end if imported else seq.num_computed_tokens)
        table = seq.window_table
        table.extend([NO_BLOCK] * (needed - len(table)))
        for index in range(first, needed):
            if table[index] == NO_BLOCK:
                table[index] = self.window_pool.take_fresh()

    def mark_computed(self, seq: Sequence) -> None:
        """Publish the hashes of blocks that became full of computed tokens (their window
        blocks' too), then give back the window blocks that no later step reads."""
        if self.enable_prefix_caching:
            self._publish_full_blocks(seq)
        if self.window_pool is not None:
            self._release_passed_window(seq)

    def _publish_full_blocks(self, seq: Sequence) -> None:
        num_full = seq.num_computed_tokens // self.block_size
        num_hashed = self._num_hashed_blocks.get(seq.request_id, 0)
        if num_full <= num_hashed:  # no block filled up this step (most decode steps)
            return
        prev_hash = self.blocks[seq.block_table[num_hashed - 1]].hash if num_hashed else None
        for index in range(num_hashed, num_full):
            tokens = seq.token_slice(index * self.block_size, (index + 1) * self.block_size)
            prev_hash = chained_block_hash(prev_hash, tokens)
            self.pool.publish(seq.block_table[index], prev_hash)
            if self.window_pool is not None and seq.window_table[index] != NO_BLOCK:
                self.window_pool.publish(seq.window_table[index], prev_hash)
        self._num_hashed_blocks[seq.request_id] = max(num_full, num_hashed)

    def _release_passed_window(self, seq: Sequence) -> None:
        table = seq.window_table
        first = min(self._first_window_block(seq.num_computed_tokens), len(table))
        for index in range(first - 1, -1, -1):
            if table[index] == NO_BLOCK:
                break  # released by an earlier step, like every one before it
            self.window_pool.release(table[index])  # (its hash kept for prefix hits)
            table[index] = NO_BLOCK

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self.pool.release(block_id)
        if self.window_pool is not None:
            for block_id in reversed(seq.window_table):
                if block_id != NO_BLOCK:
                    self.window_pool.release(block_id)
        seq.block_table = []
        seq.window_table = []
        seq.num_computed_tokens = 0
        self._num_hashed_blocks.pop(seq.request_id, None)
