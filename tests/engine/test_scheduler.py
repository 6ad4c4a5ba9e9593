"""Scheduler: token budget, chunked prefill, admission limits and preemption, without torch."""

import pytest

from rayinfer.config import ConfigError
from rayinfer.engine.block_manager import BlockManager
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.engine.scheduler import Scheduler
from rayinfer.engine.sequence import Sequence, SequenceStatus
from rayinfer.engine_config import SchedulerConfig


def make_scheduler(num_blocks=32, block_size=4, budget=16, max_seqs=8) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64)
    return Scheduler(config, BlockManager(num_blocks, block_size))


def run_step(scheduler: Scheduler, next_token: int = 7):
    """Mimic the engine: advance computed tokens and append a token where one is sampled."""
    scheduled = scheduler.schedule()
    for item in scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        scheduler.block_manager.mark_computed(item.seq)
        if samples:
            item.seq.output_token_ids.append(next_token)
    return scheduled


def test_long_prompt_is_prefilled_in_chunks_within_the_budget():
    scheduler = make_scheduler(budget=8)
    seq = Sequence("a", list(range(20)), SamplingParams())
    scheduler.add(seq)
    chunks = [run_step(scheduler) for _ in range(3)]
    assert [c[0].num_new_tokens for c in chunks] == [8, 8, 4]
    assert [c[0].samples for c in chunks] == [False, False, True]
    assert seq.output_token_ids == [7]


def test_decodes_go_first_and_new_prompts_fill_the_rest():
    scheduler = make_scheduler(budget=10)
    first = Sequence("a", list(range(6)), SamplingParams())
    scheduler.add(first)
    run_step(scheduler)
    second = Sequence("b", list(range(30)), SamplingParams())
    scheduler.add(second)
    scheduled = run_step(scheduler)
    assert [(s.seq.request_id, s.num_new_tokens) for s in scheduled] == [("a", 1), ("b", 9)]


def test_max_num_seqs_limits_admission():
    scheduler = make_scheduler(max_seqs=2)
    for name in "abc":
        scheduler.add(Sequence(name, [1, 2, 3], SamplingParams()))
    scheduled = run_step(scheduler)
    assert [s.seq.request_id for s in scheduled] == ["a", "b"]
    assert [s.request_id for s in scheduler.waiting] == ["c"]


def test_full_cache_preempts_the_latest_sequence_and_recomputes_it():
    scheduler = make_scheduler(num_blocks=4, block_size=4, budget=64)
    first = Sequence("a", list(range(8)), SamplingParams())
    second = Sequence("b", list(range(100, 108)), SamplingParams())
    scheduler.add(first)
    scheduler.add(second)
    run_step(scheduler)  # both prefilled: 2 blocks each, cache full
    assert first.num_tokens == 9 and second.num_tokens == 9
    scheduled = run_step(scheduler)  # `a` needs a third block: `b` is preempted
    assert [s.seq.request_id for s in scheduled] == ["a"]
    assert second.status == SequenceStatus.WAITING and second.num_computed_tokens == 0
    assert scheduler.num_preemptions == 1
    scheduler.finish(first, "stop")
    scheduled = run_step(scheduler)
    # Recompute covers prompt + output; its first block is still in the prefix cache.
    assert scheduled[0].seq is second
    assert second.num_cached_tokens == 4 and scheduled[0].num_new_tokens == 9 - 4


def test_waiting_sequence_that_does_not_fit_stays_waiting():
    scheduler = make_scheduler(num_blocks=2, block_size=4, budget=64)
    first = Sequence("a", list(range(7)), SamplingParams())
    scheduler.add(first)
    run_step(scheduler)
    blocked = Sequence("b", list(range(5)), SamplingParams())
    scheduler.add(blocked)
    scheduled = run_step(scheduler)
    assert [s.seq.request_id for s in scheduled] == ["a"]
    assert blocked.status == SequenceStatus.WAITING and blocked.block_table == []


def test_partitions_place_sequences_by_free_blocks_and_preempt_within_their_own():
    """Two cache partitions (data-parallel attention replicas) of 4 blocks each hold four
    2-block sequences that one partition alone could not."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    scheduler = Scheduler(config, [BlockManager(4, 4), BlockManager(4, 4)])
    seqs = [Sequence(str(i), list(range(10 * i, 10 * i + 8)), SamplingParams()) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    run_step_partitioned(scheduler)
    assert [s.kv_partition for s in seqs] == [0, 1, 0, 1]
    assert all(s.num_computed_tokens == 8 for s in seqs) and scheduler.num_preemptions == 0
    scheduled = run_step_partitioned(scheduler)  # each needs a third block: one per partition goes
    assert scheduler.num_preemptions == 2
    assert {s.request_id for s in scheduler.waiting} == {"2", "3"}
    assert [s.seq.request_id for s in scheduled] == ["0", "1"]
    assert seqs[2].kv_partition == 0 and seqs[3].kv_partition == 1  # they come back to their own


def run_step_partitioned(scheduler: Scheduler):
    scheduled = scheduler.schedule()
    for item in scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        scheduler.manager_of(item.seq).mark_computed(item.seq)
        if item.samples:
            item.seq.output_token_ids.append(7)
    return scheduled


def test_each_partition_has_its_own_token_budget_and_sequence_limit():
    """Data-parallel replicas run their own batches: two prompts as long as the budget are
    prefilled in one step, one per replica (with one shared budget the second waited a step
    while its replica idled); the sequence limit holds per replica too."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    scheduler = Scheduler(config, [BlockManager(16, 4), BlockManager(16, 4)])
    long = [Sequence(f"long{i}", list(range(16)), SamplingParams()) for i in range(2)]
    for seq in long:
        scheduler.add(seq)
    scheduled = run_step_partitioned(scheduler)
    assert [(s.seq.request_id, s.num_new_tokens) for s in scheduled] == [
        ("long0", 16),
        ("long1", 16),
    ]
    assert [s.kv_partition for s in long] == [0, 1]
    short = [Sequence(f"short{i}", [1, 2, 3], SamplingParams()) for i in range(3)]
    for seq in short:
        scheduler.add(seq)
    scheduled = run_step_partitioned(scheduler)  # two decodes + one new prompt per replica
    assert sorted(s.seq.request_id for s in scheduled) == ["long0", "long1", "short0", "short1"]
    assert sorted(s.kv_partition for s in short[:2]) == [0, 1]
    assert [s.request_id for s in scheduler.waiting] == ["short2"]  # both replicas hold 2 seqs


def _decoding(scheduler: Scheduler, names: str) -> list[Sequence]:
    """Sequences of 3-token prompts admitted and past their prefill: the next steps decode."""
    seqs = [Sequence(name, [1, 2, 3], SamplingParams()) for name in names]
    for seq in seqs:
        scheduler.add(seq)
    run_step(scheduler)
    return seqs


def held_scheduler(ratio: float, max_steps: int = 20, budget: int = 16) -> Scheduler:
    config = SchedulerConfig(8, budget, 64, waiting_served_ratio=ratio, max_waiting_steps=max_steps)
    return Scheduler(config, BlockManager(64, 4))


def test_prompts_wait_while_too_few_for_the_ratio_and_join_together():
    scheduler = held_scheduler(ratio=0.5)
    _decoding(scheduler, "abcd")
    scheduler.add(Sequence("e", [5, 6, 7], SamplingParams()))
    for _ in range(3):  # 1 waiting < 0.5 x 4 decodes: decode-only steps
        assert [s.num_new_tokens for s in run_step(scheduler)] == [1, 1, 1, 1]
    assert scheduler.held_steps == 3
    scheduler.add(Sequence("f", [5, 6, 7, 8], SamplingParams()))
    scheduled = run_step(scheduler)  # 2 waiting >= 0.5 x 4: both admitted in one step
    assert [(s.seq.request_id, s.num_new_tokens) for s in scheduled][-2:] == [("e", 3), ("f", 4)]
    assert scheduler.held_steps == 0 and not scheduler.waiting


def test_a_held_prompt_is_admitted_after_max_waiting_steps():
    scheduler = held_scheduler(ratio=10.0, max_steps=3)
    _decoding(scheduler, "ab")
    scheduler.add(Sequence("c", [5, 6, 7], SamplingParams()))
    counts = [len(run_step(scheduler)) for _ in range(4)]
    assert counts == [2, 2, 2, 3]  # held three steps, then admitted


def test_prompts_are_not_held_without_decodes_or_beside_a_prompt_chunk():
    scheduler = held_scheduler(ratio=10.0, max_steps=1, budget=12)
    scheduler.add(Sequence("a", [1, 2, 3], SamplingParams()))
    assert [s.num_new_tokens for s in run_step(scheduler)] == [3]  # no decodes: admitted at once
    scheduler.add(Sequence("long", list(range(20)), SamplingParams()))
    assert [s.seq.request_id for s in run_step(scheduler)] == ["a"]  # held: "a" only decodes
    assert [(s.seq.request_id, s.num_new_tokens) for s in run_step(scheduler)] == [
        ("a", 1),
        ("long", 11),
    ]  # admitted after max_waiting_steps
    scheduler.add(Sequence("late", [5, 6], SamplingParams()))
    # "long" is mid-prefill, so this step is mixed anyway: "late" joins it in the budget left
    scheduled = run_step(scheduler)
    assert [(s.seq.request_id, s.num_new_tokens) for s in scheduled] == [
        ("a", 1),
        ("long", 9),
        ("late", 2),
    ]
    assert scheduler.held_steps == 0


def test_holding_prompts_back_changes_no_sequence_and_drops_none():
    """The same sequences finish with the same tokens with prompts held back as without."""

    def finished(ratio):
        scheduler = held_scheduler(ratio=ratio, max_steps=4)
        seqs = [Sequence(f"r{i}", list(range(i, i + 5)), SamplingParams()) for i in range(10)]
        done, step = [], 0
        while len(done) < len(seqs):
            if step < len(seqs):
                scheduler.add(seqs[step])  # one arrives each step
            for item in run_step(scheduler, next_token=step):
                if len(item.seq.output_token_ids) == 3 and item.seq not in done:
                    scheduler.finish(item.seq, "length")
                    done.append(item.seq)
            step += 1
        return sorted(s.request_id for s in done), step

    (plain, plain_steps), (held, held_steps) = finished(0.0), finished(1.0)
    assert plain == held == sorted(f"r{i}" for i in range(10))
    assert held_steps >= plain_steps


def test_waiting_served_ratio_and_max_waiting_steps_are_checked():
    for kwargs, key in (
        (dict(waiting_served_ratio=-1.0), "waiting_served_ratio"),
        (dict(waiting_served_ratio="high"), "waiting_served_ratio"),
        (dict(max_waiting_steps=0), "max_waiting_steps"),
        (dict(max_waiting_steps=2.5), "max_waiting_steps"),
    ):
        with pytest.raises(ConfigError, match=key):
            SchedulerConfig(8, 16, 64, **kwargs)
