"""Continuous batching with chunked prefill under a per-step token budget.

Each step the running sequences go first, in arrival order: a decoding sequence needs one token,
a sequence still in prefill takes as much of its prompt as the budget leaves. Waiting sequences
are admitted after them while budget, sequence slots and cache blocks last. When the cache is
full, the most recently admitted running sequence is preempted: its blocks are freed and it is
recomputed later from its prompt and the tokens it already generated.

The cache may be split into partitions, one per data-parallel attention replica, each with its own
blocks: a sequence is placed in a partition when first admitted and stays there (its KV and
sampling state live on that replica). Each replica runs its own batch, so the token budget and
the sequence limit hold per partition, as in vLLM's and SGLang's data-parallel attention: two
16k-token prompts on dp=2 are prefilled in one step, one per replica. A new sequence goes to the
partition with budget and seats left that has the most free blocks.

With `waiting_served_ratio` set, a step that would only decode admits no new prompt until enough
are waiting or the oldest has waited `max_waiting_steps` steps (SchedulerConfig). Plain Python,
no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from rayinfer.engine.block_manager import BlockManager
from rayinfer.engine.sequence import Sequence, SequenceStatus
from rayinfer.engine_config import SchedulerConfig


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens computed for it this step, starting at seq.num_computed_tokens
    samples: bool  # whether this step reaches the end of the sequence, so a token is sampled

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int) -> ScheduledSequence:
        return cls(seq, num_new_tokens, seq.num_computed_tokens + num_new_tokens == seq.num_tokens)

    @property
    def is_decode(self) -> bool:
        """One token after generated ones; else a prompt's chunk (or a recompute's)."""
        return self.num_new_tokens == 1 and bool(self.seq.output_token_ids)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_managers: BlockManager | list[BlockManager]):
        self.config = config
        self.block_managers = (
            list(block_managers) if isinstance(block_managers, list) else [block_managers]
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.held_steps = 0  # steps in a row that held waiting prompts back (waiting_served_ratio)

    @property
    def block_manager(self) -> BlockManager:
        """The cache's only partition (without data-parallel attention)."""
        if len(self.block_managers) != 1:
            raise AttributeError("the cache has several partitions; use manager_of(seq)")
        return self.block_managers[0]

    def manager_of(self, seq: Sequence) -> BlockManager:
        return self.block_managers[seq.kv_partition]

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSequence]:
        budgets = [self.config.max_num_batched_tokens] * len(self.block_managers)
        seats = [self.config.max_num_seqs] * len(self.block_managers)
        scheduled: list[ScheduledSequence] = []
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            partition = seq.kv_partition
            seats[partition] -= 1
            budget = budgets[partition]
            if budget == 0:
                continue
            num_tokens = len(seq.prompt_token_ids) + len(seq.output_token_ids)
            computed = seq.num_computed_tokens
            num_new = min(num_tokens - computed, budget)
            # A decode whose token fits the last block needs no block (most steps): no checks.
            fits = (
                computed + num_new
                <= len(seq.block_table) * self.block_managers[partition].block_size
            )
            if fits or self._make_room(seq, num_new):
                if not fits:
                    self.manager_of(seq).allocate_slots(seq, num_new)
                samples = computed + num_new == num_tokens
                scheduled.append(ScheduledSequence(seq, num_new, samples))
                budgets[partition] -= num_new
        if self.waiting and self._holds_prompts(scheduled):
            self.held_steps += 1
            return scheduled
        self.held_steps = 0
        while self.waiting:
            seq = self.waiting[0]
            partition = self._partition_for(seq, budgets, seats)
            if partition is None:
                break
            admitted = self._admit(seq, partition, budgets[partition])
            if admitted is None:
                break
            self.waiting.popleft()
            scheduled.append(admitted)
            budgets[partition] -= admitted.num_new_tokens
            seats[partition] -= 1
        return scheduled

    def _holds_prompts(self, scheduled: list[ScheduledSequence]) -> bool:
        """Whether this step keeps the waiting prompts waiting: it would decode and nothing else,
        too few prompts wait for their ratio to the decodes, and none has waited its limit."""
        ratio = self.config.waiting_served_ratio
        if ratio <= 0 or not scheduled or self.held_steps >= self.config.max_waiting_steps:
            return False
        if not all(s.is_decode for s in scheduled):
            return False  # a prompt's chunk runs this step anyway: the waiting ones may join it
        return len(self.waiting) < ratio * len(scheduled)

    def roomiest_partition(self) -> int:
        """The partition with the most free blocks (the first of equals)."""
        free = [manager.num_free_blocks for manager in self.block_managers]
        return free.index(max(free))

    def _partition_for(self, seq: Sequence, budgets: list[int], seats: list[int]) -> int | None:
        """Where `seq` can be admitted this step: its own partition if it has one (a preempted
        sequence), else the open partition with the most free blocks; None if none is open."""
        if seq.kv_partition is not None:
            p = seq.kv_partition
            return p if budgets[p] > 0 and seats[p] > 0 else None
        open_ones = [p for p in range(len(budgets)) if budgets[p] > 0 and seats[p] > 0]
        if not open_ones:
            return None
        return max(open_ones, key=lambda p: (self.block_managers[p].num_free_blocks, -p))

    def _admit(self, seq: Sequence, partition: int, budget: int) -> ScheduledSequence | None:
        first_time = seq.kv_partition is None
        seq.kv_partition = partition
        manager = self.manager_of(seq)
        manager.allocate_cached_prefix(seq)
        num_new = min(seq.num_uncomputed_tokens, budget)
        if not manager.can_allocate_slots(seq, num_new):
            manager.num_prefix_hit_tokens -= seq.num_cached_tokens
            manager.free(seq)
            seq.num_cached_tokens = 0
            if first_time:
                seq.kv_partition = None
            return None
        manager.allocate_slots(seq, num_new)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return ScheduledSequence.of(seq, num_new)

    def _make_room(self, seq: Sequence, num_new: int) -> bool:
        """Preempt the latest sequences of `seq`'s partition until it fits; False if `seq` went."""
        manager = self.manager_of(seq)
        while not manager.can_allocate_slots(seq, num_new):
            victim = next(s for s in reversed(self.running) if s.kv_partition == seq.kv_partition)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.manager_of(seq).free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, keep_blocks: bool = False) -> None:
        """End a sequence; `keep_blocks` leaves its KV in the cache until `release` (hand-off)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not keep_blocks:
            self.release(seq)

    def release(self, seq: Sequence) -> None:
        if seq.kv_partition is not None:
            self.manager_of(seq).free(seq)
