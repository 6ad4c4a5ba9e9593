"""One model across several CPU workers (Ray actors, gloo through rayinfer's collective backend):
every parallel plan gives the single-worker greedy tokens, and a prefill under one plan hands its
KV off to a decode under another.

Starting a worker group costs ~6 s on 2 cores (~13 s for 4 workers: each worker process imports
torch), its steps here well under a second. So the checks that need the same group share it: a
class-scoped fixture starts it once for the tests of its class and shuts it down after the last.
Those groups run with enable_prefix_caching=False, so that each test's prompts are prefilled
whole, as on a fresh engine (prefix caching is the driver's bookkeeping: no plan changes it)."""

import re

import pytest

import rayinfer
from rayinfer import ParallelPlan, SamplingParams
from tests.models.harness import (
    TINY_DENSE,
    TINY_MLA,
    make_dsa_checkpoint,
    make_hf_checkpoint,
    make_prompts,
    make_v4_checkpoint,
)

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

DEEPSEEK_V3 = dict(TINY_MLA, q_lora_rank=24, n_group=4, topk_group=2, n_shared_experts=1)
QWEN3_MOE = dict(
    TINY_DENSE,
    num_key_value_heads=4,  # so that tp=4 splits the K/V heads too
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        "deepseek_v3": make_hf_checkpoint(
            tmp_path_factory.mktemp("ds"), "deepseek_v3", **DEEPSEEK_V3
        ),
        "qwen3_moe": make_hf_checkpoint(tmp_path_factory.mktemp("q3"), "qwen3_moe", **QWEN3_MOE),
        # DSA with full and shared indexer layers; index_topk 6 is below the longer prompts
        "glm_moe_dsa": make_dsa_checkpoint(
            tmp_path_factory.mktemp("glm"), "glm_moe_dsa", indexer_types=["full", "shared", "full"]
        ),
        # DeepSeek-V4: sliding, CSA and HCA layers, a hash-routed MoE layer
        "deepseek_v4": make_v4_checkpoint(tmp_path_factory.mktemp("v4")),
    }


@pytest.fixture(scope="module")
def prompts():
    return make_prompts(128, lengths=(5, 19, 3, 11))


@pytest.fixture(scope="module")
def single_worker_tokens(checkpoints, prompts):
    return {
        family: [
            o.token_ids for o in rayinfer.LLM(str(path), device="cpu").generate(prompts, GREEDY)
        ]
        for family, path in checkpoints.items()
    }


def make_llm(path, plan, overlap=False, all_to_all=None, cuda_graphs=None, **options):
    return rayinfer.LLM(
        str(path),
        device="cpu",
        parallel=plan,
        two_batch_overlap=overlap,
        all_to_all=all_to_all,
        cuda_graphs=cuda_graphs,
        **options,
    )


@pytest.fixture(scope="class")
def shared_group(request, ray_cluster, checkpoints):
    """The LLM of the class's GROUP = (family, plan, options), started once for its tests."""
    family, plan, options = request.cls.GROUP
    llm = make_llm(checkpoints[family], plan, enable_prefix_caching=False, **options)
    yield llm
    llm.shutdown()


def run_plan(
    path, plan, prompts, overlap=False, all_to_all=None, cuda_graphs=None, steps=None, **options
) -> list[list[int]]:
    llm = make_llm(path, plan, overlap, all_to_all, cuda_graphs, **options)
    try:
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        if steps is not None:
            steps.update(llm.engine.executor.step_counts)
        return tokens
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "family, plan",
    [
        # deepseek_v3, glm_moe_dsa and deepseek_v4 under tp=2: TestTensorParallelPrefill;
        # deepseek_v3 under dp=2 ep=2: TestDataParallelGroup
        ("qwen3_moe", ParallelPlan(tp=2, ep=2)),  # GQA heads split, experts split in the TP group
        ("qwen3_moe", ParallelPlan(dp=2)),  # two replicas inside one group, no communication
        ("deepseek_v3", ParallelPlan(tp=2, dp=2, ep=4)),  # 4 workers: EP spans both DP replicas
        ("qwen3_moe", ParallelPlan(tp=4, ep=2)),  # 4 workers: two EP groups inside one TP group
        ("glm_moe_dsa", ParallelPlan(tp=2, dp=2, ep=4)),  # 4 workers, DP attention with DSA
        ("deepseek_v4", ParallelPlan(tp=2, dp=2, ep=4)),  # 4 workers: DP attention, EP experts
    ],
    ids=str,
)
def test_plan_gives_the_single_worker_tokens(
    ray_cluster, checkpoints, prompts, single_worker_tokens, family, plan
):
    assert run_plan(checkpoints[family], plan, prompts) == single_worker_tokens[family]


@pytest.mark.parametrize(
    "family, plan",
    [
        # deepseek_v3 under dp=2 ep=2: TestOverlappedDataParallelGroup
        ("qwen3_moe", ParallelPlan(tp=2, dp=2, ep=4)),
        ("deepseek_v3", ParallelPlan()),  # one worker: micro-batches without communication
        ("glm_moe_dsa", ParallelPlan(dp=2, ep=2)),  # each half keeps its indexer selection
        ("qwen3_moe", ParallelPlan()),  # GQA: a prompt cut in two chunks reads its own prefix
    ],
    ids=str,
)
def test_two_batch_overlap_gives_the_same_tokens(
    ray_cluster, checkpoints, prompts, single_worker_tokens, family, plan
):
    tokens = run_plan(checkpoints[family], plan, prompts, overlap=True)
    assert tokens == single_worker_tokens[family]


def test_host_staged_exchange_gives_the_same_tokens(
    ray_cluster, checkpoints, prompts, single_worker_tokens
):
    """Experts exchange tokens through shared host memory (the transport for GPUs without P2P)."""
    plan = ParallelPlan(dp=2, ep=2)
    tokens = run_plan(checkpoints["deepseek_v3"], plan, prompts, all_to_all={"transport": "host"})
    assert tokens == single_worker_tokens["deepseek_v3"]


@pytest.mark.parametrize(
    "family, plan, transport, overlap",
    [
        ("deepseek_v3", ParallelPlan(dp=2, ep=2), "dist", False),
        ("deepseek_v3", ParallelPlan(dp=2, ep=2), "dist", True),
        ("deepseek_v3", ParallelPlan(dp=2, ep=2), "host", False),
        ("deepseek_v3", ParallelPlan(dp=2, ep=2), "host", True),  # a transport channel per lane
        ("qwen3_moe", ParallelPlan(tp=2, dp=2, ep=4), "host", True),  # TP pairs share tokens
    ],
    ids=str,
)
def test_all_tokens_exchange_gives_the_same_tokens(
    ray_cluster, checkpoints, prompts, single_worker_tokens, family, plan, transport, overlap
):
    """Every token to every EP rank (dedup=False; the default where nearly every token needs
    every rank): token counts learned once per step, no device sync inside the layers."""
    tokens = run_plan(
        checkpoints[family],
        plan,
        prompts,
        overlap=overlap,
        all_to_all={"dedup": False, "transport": transport},
    )
    assert tokens == single_worker_tokens[family]


@pytest.mark.parametrize(
    "family, plan, transport, overlap",
    [
        ("deepseek_v3", ParallelPlan(dp=2, ep=2), "dist", False),
        ("deepseek_v3", ParallelPlan(dp=2, ep=2), "host", True),
        ("qwen3_moe", ParallelPlan(tp=2, dp=2, ep=4), "host", True),  # 4 ranks: 3 peers each
    ],
    ids=str,
)
def test_local_first_experts_give_the_same_tokens(
    ray_cluster, checkpoints, prompts, single_worker_tokens, family, plan, transport, overlap
):
    """all_to_all.local_first: each rank's experts run on its own tokens straight from x,
    beside the exchange, which carries them to the other ranks only; combine adds the own
    share."""
    options = {"dedup": False, "transport": transport, "local_first": True}
    tokens = run_plan(checkpoints[family], plan, prompts, overlap=overlap, all_to_all=options)
    assert tokens == single_worker_tokens[family]


@pytest.mark.parametrize(
    "family, plan, chosen, prefill",
    [  # deepseek_v3 under dp=2 ep=2: TestDecodeGraphsAcrossDataParallelReplicas
        ("qwen3_moe", ParallelPlan(tp=2, ep=2), slice(None), "eager"),  # all-reduces captured
        ("qwen3_moe", ParallelPlan(tp=2, dp=2, ep=4), slice(None), "eager"),  # TP pairs share
    ],
    ids=["tp2-ep2", "tp2-dp2-ep4"],
)
def test_decode_graphs_across_workers_give_the_same_tokens(
    ray_cluster, checkpoints, prompts, single_worker_tokens, family, plan, chosen, prefill
):
    """cuda_graphs=True on CPU workers runs what the graphs capture, eagerly: every replica pads
    its decodes to the bucket the driver agreed on (the largest share's), an idle replica runs the
    bucket on padding, and the exchange sends every token to every rank over the bucket's
    sizes. The tokens stay the single worker's, and the steps really went that way."""
    steps = {}
    tokens = run_plan(checkpoints[family], plan, prompts[chosen], cuda_graphs=True, steps=steps)
    assert tokens == single_worker_tokens[family][chosen]
    assert steps["graph"] >= GREEDY.max_tokens - 1 and steps[prefill] >= 1


@pytest.mark.parametrize("transport", ["dist", "host"])
def test_prefill_graphs_across_workers_give_the_same_tokens(
    ray_cluster, checkpoints, prompts, single_worker_tokens, transport
):
    """One new prompt per data-parallel replica: the driver picks one token bucket for both
    (the longer prompt's), each pads its prompt to it, and the exchange sends every token to
    every rank over the bucket's sizes."""
    steps = {}
    options = {"transport": transport}
    path = checkpoints["deepseek_v3"]
    plan = ParallelPlan(dp=2, ep=2)
    tokens = run_plan(path, plan, prompts[:2], all_to_all=options, cuda_graphs=True, steps=steps)
    assert tokens == single_worker_tokens["deepseek_v3"][:2]
    assert steps["prefill_graph"] == 1 and steps["eager"] == 0


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"dedupe": False}, "all_to_all.dedupe is unknown; valid keys: schedule, transport"),
        ({"transport": "nvlink"}, "all_to_all.transport='nvlink'; use one of auto, dist, host"),
        ({"dedup": "no"}, "all_to_all.dedup='no'; use one of None, True, False"),
    ],
)
def test_bad_all_to_all_option_is_named_before_any_worker_starts(checkpoints, options, expected):
    from rayinfer.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(expected)):
        rayinfer.LLM(str(checkpoints["deepseek_v3"]), device="cpu", all_to_all=options)


@pytest.mark.parametrize(
    "family, prefill_plan, decode_plan",
    [
        ("qwen3_moe", ParallelPlan(tp=2), ParallelPlan(tp=1)),  # merge K/V heads
        ("qwen3_moe", ParallelPlan(tp=1), ParallelPlan(tp=2, ep=2)),  # split K/V heads
        # deepseek_v3, glm_moe_dsa, deepseek_v4 from tp=2 to dp=2 ep=2: TestTensorParallelPrefill
    ],
    ids=str,
)
def test_prefill_plan_hands_off_to_a_different_decode_plan(
    ray_cluster, checkpoints, prompts, single_worker_tokens, family, prefill_plan, decode_plan
):
    path = str(checkpoints[family])
    prefill = rayinfer.LLM(path, device="cpu", parallel=prefill_plan)
    decode = rayinfer.LLM(path, device="cpu", parallel=decode_plan, block_size=8)
    try:
        outputs = decode.decode(prefill.prefill(prompts, GREEDY), GREEDY)
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert [o.token_ids for o in outputs] == single_worker_tokens[family]


def test_invalid_plans_list_the_valid_ones():
    with pytest.raises(ValueError, match="valid ep"):
        ParallelPlan(tp=2, ep=3)


def test_plan_that_does_not_fit_the_model_names_the_key(checkpoints):
    from rayinfer.config import ConfigError

    with pytest.raises(ConfigError, match=r"parallel.tp=3 does not divide num_attention_heads=4"):
        rayinfer.LLM(str(checkpoints["qwen3_moe"]), device="cpu", parallel=ParallelPlan(tp=3))
    with pytest.raises(ConfigError, match=r"parallel.ep=16 does not divide num_experts=8"):
        rayinfer.LLM(
            str(checkpoints["qwen3_moe"]), device="cpu", parallel=ParallelPlan(dp=16, ep=16)
        )


# dedup=None (the default): TestDataParallelGroup and TestOverlappedDataParallelGroup
@pytest.mark.parametrize(
    "overlap, dedup",
    [(False, False), (True, False)],
    ids=["plain-all-tokens", "overlap-all-tokens"],
)
def test_idle_data_parallel_rank_still_joins_the_exchange(
    ray_cluster, checkpoints, prompts, single_worker_tokens, overlap, dedup
):
    """One request for two DP replicas: the idle replica runs a placeholder token through every
    layer so that its expert exchanges pair with the busy one's (and so does an empty micro-batch
    under two-batch overlap)."""
    plan = ParallelPlan(dp=2, ep=2)
    tokens = run_plan(
        checkpoints["deepseek_v3"], plan, prompts[1:2], overlap=overlap, all_to_all={"dedup": dedup}
    )
    assert tokens == single_worker_tokens["deepseek_v3"][1:2]


def test_each_data_parallel_replica_has_its_own_cache(ray_cluster, checkpoints, prompts, tmp_path):
    """dp=2: two cache partitions of num_kv_blocks each; requests spread over both. Profiling
    a step writes one table per worker."""
    plan = ParallelPlan(dp=2, ep=2)
    llm = rayinfer.LLM(str(checkpoints["qwen3_moe"]), device="cpu", parallel=plan, num_kv_blocks=64)
    try:
        engine = llm.engine
        assert len(engine.block_managers) == 2
        for index, prompt in enumerate(prompts):
            engine.add_request(str(index), prompt, GREEDY)
        llm.start_profile(str(tmp_path / "step"))
        engine.step()
        tables = llm.stop_profile()
        assert sorted(tables) == [str(tmp_path / f"step-rank{r}.txt") for r in (0, 1)]
        assert {seq.kv_partition for seq in engine.scheduler.running} == {0, 1}
        assert all(m.num_free_blocks < 64 for m in engine.block_managers)
    finally:
        llm.shutdown()


class TestDataParallelGroup:
    """deepseek_v3 under dp=2 ep=2 (DP attention, experts by dispatch/combine), one group."""

    GROUP = ("deepseek_v3", ParallelPlan(dp=2, ep=2), {})

    def test_plan_gives_the_single_worker_tokens(self, shared_group, prompts, single_worker_tokens):
        tokens = [o.token_ids for o in shared_group.generate(prompts, GREEDY)]
        assert tokens == single_worker_tokens["deepseek_v3"]

    def test_idle_data_parallel_rank_still_joins_the_exchange(
        self, shared_group, prompts, single_worker_tokens
    ):
        """One request for two DP replicas: the idle replica runs a placeholder token through
        every layer so that its expert exchanges pair with the busy one's."""
        tokens = [o.token_ids for o in shared_group.generate(prompts[1:2], GREEDY)]
        assert tokens == single_worker_tokens["deepseek_v3"][1:2]

    def test_a_worker_group_reports_the_single_worker_logprobs(
        self, shared_group, checkpoints, prompts
    ):
        """Generated and prompt log-probabilities come back from the replicas' leaders, merged
        into batch order: equal to one in-process worker's."""
        params = [  # every other request asks: the merge must keep the others' None
            rayinfer.SamplingParams(
                max_tokens=4,
                temperature=0,
                ignore_eos=True,
                logprobs=2 if i % 2 == 0 else None,
                prompt_logprobs=1 if i % 2 == 0 else None,
            )  # fmt: skip
            for i in range(len(prompts))
        ]
        single = rayinfer.LLM(str(checkpoints["deepseek_v3"]), device="cpu").generate(
            prompts, params
        )
        grouped = shared_group.generate(prompts, params)
        for ours, theirs in zip(grouped, single):
            assert ours.token_ids == theirs.token_ids
            if theirs.logprobs is None:
                assert ours.logprobs is None and ours.prompt_logprobs is None
                continue
            for mine, expected in zip(ours.logprobs + ours.prompt_logprobs[1:],
                                      theirs.logprobs + theirs.prompt_logprobs[1:]):  # fmt: skip
                assert mine.chosen.token_id == expected.chosen.token_id
                assert mine.chosen.logprob == pytest.approx(expected.chosen.logprob, abs=1e-4)
                assert [t.token_id for t in mine.top] == [t.token_id for t in expected.top]

    def test_step_timelines_split_a_generate_call_in_order(self, shared_group, prompts):
        """Each worker's step timeline and the driver's send / results times line up on one
        clock: the breakdown of a one-step call has every phase non-negative and summing to the
        call. (Prefix caching is off: the second call prefills the whole prompts again.)"""
        import time

        from rayinfer.bench.step_breakdown import breakdown, summary_line

        executor = shared_group.engine.executor
        executor.drain_step_timelines()  # the earlier tests' steps
        shared_group.generate(prompts[:2], GREEDY)
        assert len(executor.drain_step_timelines()["driver"]) == 8  # one per token
        start = time.monotonic()
        one_token = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        shared_group.generate(prompts[:2], one_token)
        span = (start, time.monotonic())
        timelines = executor.drain_step_timelines()
        assert len(timelines["ranks"]) == 2 and len(timelines["driver"]) == 1
        for rank in timelines["ranks"]:
            (step,) = rank
            assert step["num_tokens"] in (len(prompts[0]), len(prompts[1]))  # one per replica
            times = [step[k] for k in ("received", "inputs_ready", "queued", "finished")]
            assert times == sorted(times) and step["gpu_ms"] is None  # no GPU here
            # the thread's CPU time in the queueing can't exceed its wall time
            assert 0 <= step["queue_cpu_ms"] <= 1e3 * (step["queued"] - step["received"]) + 1
        parts = breakdown(span, timelines)
        phases = ["engine", "send", "inputs", "queue", "wait", "return"]
        assert all(parts[phase] >= 0 for phase in phases), parts
        # the slowest rank's phases and the engine's own time cover the call (ranks overlap)
        assert sum(parts[phase] for phase in phases) >= parts["total"] - parts["skew"] - 1e-6
        assert "step ms (median): engine" in summary_line([parts])


class TestOverlappedDataParallelGroup:
    """deepseek_v3 under dp=2 ep=2 with two-batch overlap: dispatch/combine overlapped with
    attention, one group."""

    GROUP = ("deepseek_v3", ParallelPlan(dp=2, ep=2), {"overlap": True})

    def test_two_batch_overlap_gives_the_same_tokens(
        self, shared_group, prompts, single_worker_tokens
    ):
        tokens = [o.token_ids for o in shared_group.generate(prompts, GREEDY)]
        assert tokens == single_worker_tokens["deepseek_v3"]

    def test_idle_data_parallel_rank_still_joins_the_exchange(
        self, shared_group, prompts, single_worker_tokens
    ):
        """One request for two DP replicas under two-batch overlap: the idle replica's empty
        micro-batches run a placeholder token so that its exchanges pair with the busy one's."""
        tokens = [o.token_ids for o in shared_group.generate(prompts[1:2], GREEDY)]
        assert tokens == single_worker_tokens["deepseek_v3"][1:2]


class TestDecodeGraphsAcrossDataParallelReplicas:
    """As test_decode_graphs_across_workers_give_the_same_tokens, for deepseek_v3 under
    dp=2 ep=2, one group: the step counts are this test's calls' (the group's counts go up)."""

    GROUP = ("deepseek_v3", ParallelPlan(dp=2, ep=2), {"cuda_graphs": True})

    def run(self, llm, prompts) -> tuple[list[list[int]], dict[str, int]]:
        before = dict(llm.engine.executor.step_counts)
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        after = llm.engine.executor.step_counts
        return tokens, {kind: after[kind] - before[kind] for kind in after}

    def test_every_replica_pads_to_the_agreed_bucket(
        self, shared_group, prompts, single_worker_tokens
    ):
        """The exchange is captured; the prompts' prefill runs eagerly."""
        tokens, steps = self.run(shared_group, prompts)
        assert tokens == single_worker_tokens["deepseek_v3"]
        assert steps["graph"] >= GREEDY.max_tokens - 1 and steps["eager"] >= 1

    def test_an_idle_replica_replays_padding(self, shared_group, prompts, single_worker_tokens):
        """One prompt: the idle replica replays the bucket on padding, in decode and in the
        prefill (one prompt, so a prefill graph)."""
        tokens, steps = self.run(shared_group, prompts[1:2])
        assert tokens == single_worker_tokens["deepseek_v3"][1:2]
        assert steps["graph"] >= GREEDY.max_tokens - 1 and steps["prefill_graph"] >= 1


@pytest.mark.parametrize(
    "family",
    [
        "deepseek_v3",  # heads split, latent replicated, experts all-reduced; latent, any layout
        "glm_moe_dsa",  # every rank runs the (replicated) indexer; indexer keys travel
        "deepseek_v4",  # one K/V head: attention replicated, vocab split; pooled entries travel
    ],
    scope="class",
)
class TestTensorParallelPrefill:
    """A tp=2 group gives the single-worker tokens, and its prefill hands off to a dp=2 ep=2
    decode (as test_prefill_plan_hands_off_to_a_different_decode_plan)."""

    @pytest.fixture(scope="class")
    def shared_group(self, ray_cluster, checkpoints, family):
        llm = make_llm(checkpoints[family], ParallelPlan(tp=2), enable_prefix_caching=False)
        yield llm
        llm.shutdown()

    def test_plan_gives_the_single_worker_tokens(
        self, shared_group, prompts, single_worker_tokens, family
    ):
        tokens = [o.token_ids for o in shared_group.generate(prompts, GREEDY)]
        assert tokens == single_worker_tokens[family]

    def test_prefill_hands_off_to_a_data_parallel_decode(
        self, shared_group, checkpoints, prompts, single_worker_tokens, family
    ):
        path = str(checkpoints[family])
        decode = rayinfer.LLM(path, device="cpu", parallel=ParallelPlan(dp=2, ep=2), block_size=8)
        try:
            outputs = decode.decode(shared_group.prefill(prompts, GREEDY), GREEDY)
        finally:
            decode.shutdown()
        assert [o.token_ids for o in outputs] == single_worker_tokens[family]


def test_preempted_requests_on_a_worker_group_give_the_single_worker_tokens(
    ray_cluster, checkpoints, prompts, single_worker_tokens
):
    """A tiny cache preempts sequences: their tables restart, so the workers get them whole
    again (the group otherwise sends only each step's new blocks)."""
    llm = rayinfer.LLM(
        str(checkpoints["deepseek_v3"]),
        device="cpu",
        parallel=ParallelPlan(dp=2, ep=2),
        block_size=4,
        num_kv_blocks=10,
        max_model_len=32,
        enable_prefix_caching=False,
    )
    try:
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        preemptions = llm.engine.scheduler.num_preemptions
    finally:
        llm.shutdown()
    assert preemptions > 0
    assert tokens == single_worker_tokens["deepseek_v3"]
