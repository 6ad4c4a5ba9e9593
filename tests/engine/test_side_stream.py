"""The shared experts' handle (layers/side_stream.py): on CPU, and wherever it is switched off,
fn(x) is computed when its result is asked for, on the caller's stream; the switch is checked."""

import pytest
import torch

from rayinfer.layers import side_stream
from rayinfer.layers.moe import MoE, RoutingMethod


def test_on_cpu_the_work_waits_for_its_result(monkeypatch):
    calls = []

    def double(x):
        calls.append(x.shape[0])
        return 2 * x

    handle = side_stream.later(double, torch.ones(4096, 2), may_run_beside=True)
    assert isinstance(handle, side_stream.Later) and calls == []
    assert torch.equal(handle.result(), torch.full((4096, 2), 2.0)) and calls == [4096]


@pytest.mark.parametrize("value, expected", [("256", 256), ("0", 0), ("off", None)])
def test_the_switch(monkeypatch, value, expected):
    monkeypatch.setenv(side_stream.BESIDE_ENV, value)
    assert side_stream.beside_from_tokens() == expected


def test_a_bad_switch_names_itself_and_the_valid_values(monkeypatch):
    monkeypatch.setenv(side_stream.BESIDE_ENV, "yes")
    with pytest.raises(ValueError, match="RAYINFER_SHARED_EXPERTS_BESIDE_FROM.*token count.*off"):
        side_stream.beside_from_tokens()


def small_moe_and_tokens() -> tuple[MoE, torch.Tensor]:
    """A 4-expert top-2 MoE block with shared experts, random weights, and 5 tokens."""
    torch.manual_seed(0)
    routing = RoutingMethod(top_k=2, scoring="softmax", renormalize=True)
    moe = MoE(16, 4, 8, routing, shared_intermediate_size=8)
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return moe, torch.randn(5, 16)


def test_a_moe_block_adds_its_shared_experts_through_the_handle():
    moe, x = small_moe_and_tokens()
    handle = moe.start_shared_experts(x)
    assert torch.allclose(moe.finish(handle, torch.zeros(5, 16)), moe.shared_experts(x))
    assert moe.finish(None, x) is x


class OneRank:
    """A world of one rank for comm.moe's dispatch and combine."""

    rank, world_size = 0, 1

    def all_to_all(self, out, inp, out_splits, in_splits, **kw):
        out.copy_(inp)


class LoggingExchange:
    """A one-rank expert-parallel group (what MoE layers call, as a LayerGroup) that logs its
    exchanges."""

    rank, size, all_to_all = 0, 1, {}  # no exchange options: local_first off

    def __init__(self, log):
        from rayinfer.comm import moe as comm_moe

        self.log, self.comm_moe, self.comm = log, comm_moe, OneRank()

    def dispatch(self, x, topk_ids, topk_weights, num_experts, on_packed=None, **kw):
        def packed():
            self.log.append("packed")
            if on_packed is not None:
                on_packed()

        received = self.comm_moe.dispatch(
            self.comm, x, topk_ids, topk_weights, num_experts, tokens_per_rank=[x.shape[0]],
            dedup=False, on_packed=packed,
        )  # fmt: skip
        self.log.append("dispatch")
        return received

    def combine(self, expert_out, handle, addends=(), **kw):
        self.log.append(f"combine+{len(addends)}")
        return self.comm_moe.combine(self.comm, expert_out, handle, addends)


@pytest.mark.parametrize("beside_dispatch", [True, False])
def test_the_shared_experts_start_beside_the_dispatch_or_the_combine(beside_dispatch):
    """The staged MoE (two-batch overlap's) starts the shared experts once, after the packing or
    after the routed experts, and the block's output is the plain forward's either way."""
    from dataclasses import replace

    moe, x = small_moe_and_tokens()
    expected = moe(x)
    log = []
    moe.parallel = replace(moe.parallel, ep_group=LoggingExchange(log))
    start_shared = moe.start_shared_experts
    moe.start_shared_experts = lambda x: log.append("shared") or start_shared(x)
    out = moe.experts_and_combine(moe.dispatch_tokens(x, shared_beside_dispatch=beside_dispatch))
    if beside_dispatch:  # on CPU they run at the end (side_stream.Later): added after combine
        assert log == ["packed", "shared", "dispatch", "combine+0"]
    else:
        assert log == ["packed", "dispatch", "shared", "combine+0"]
    assert torch.allclose(out, expected, atol=1e-6)


class RanBeside:
    """A handle like side_stream.Beside's (whose result is queued already), on CPU."""

    runs_beside = True

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def test_shared_experts_that_ran_beside_are_added_in_the_combines_pass():
    """The combine's summing kernel adds what ran beside (one read and write of [T, H] less than
    adding it afterwards), and the block's output is the plain forward's."""
    from dataclasses import replace

    moe, x = small_moe_and_tokens()
    expected = moe(x)
    log = []
    moe.parallel = replace(moe.parallel, ep_group=LoggingExchange(log))
    moe.start_shared_experts = lambda x: RanBeside(moe.shared_experts(x))
    out = moe.experts_and_combine(moe.dispatch_tokens(x))
    assert log == ["packed", "dispatch", "combine+1"]
    assert torch.allclose(out, expected, atol=1e-6)


def test_where_the_overlap_puts_each_lanes_shared_experts_is_a_setting(monkeypatch):
    from rayinfer.layers import two_batch_overlap as tbo

    assert tbo.shared_experts_beside_combine() == (False, False)  # default: beside dispatch
    monkeypatch.setenv(tbo.SHARED_EXPERTS_ENV, "second-at-combine")
    assert tbo.shared_experts_beside_combine() == (False, True)
    monkeypatch.setenv(tbo.SHARED_EXPERTS_ENV, "later")
    with pytest.raises(ValueError, match="RAYINFER_OVERLAP_SHARED_EXPERTS.*dispatch, second"):
        tbo.shared_experts_beside_combine()


def test_local_first_by_default_where_every_rank_has_enough_tokens():
    """all_to_all.local_first=None (the default) runs a rank's experts on its own tokens beside
    the exchange only where every rank's call has LOCAL_FIRST_MIN_TOKENS (one choice for all
    ranks: it shapes the exchange); True and False decide alone; the deduplicated exchange never
    does it."""
    from dataclasses import replace
    from types import SimpleNamespace

    from rayinfer.layers.moe import LOCAL_FIRST_MIN_TOKENS

    moe, x = small_moe_and_tokens()
    group = SimpleNamespace(rank=0, size=2, all_to_all={"dedup": False})
    moe.parallel = replace(moe.parallel, ep_group=group)
    routing = moe.route(x)
    enough = LOCAL_FIRST_MIN_TOKENS

    def runs_local(tokens_per_rank, **options):
        group.all_to_all = {"dedup": False, **options}
        return moe._local_experts(x, routing, tokens_per_rank) is not None

    assert runs_local([enough, enough])
    assert not runs_local([enough, enough - 1])  # the other rank has too few: neither does it
    assert not runs_local(None)  # counts unknown: no all-tokens exchange
    assert runs_local([5, 7], local_first=True)
    assert not runs_local([enough, enough], local_first=False)
    assert not runs_local([enough, enough], dedup=True, local_first=True)


def test_local_first_starts_lower_inside_a_graph_capture(monkeypatch):
    """While a CUDA graph is captured (a prefill graph: no host work per launch) the default
    threshold is LOCAL_FIRST_MIN_TOKENS_IN_GRAPH; eagerly, LOCAL_FIRST_MIN_TOKENS."""
    from rayinfer.layers import moe as moe_module

    assert moe_module.local_first_min_tokens() == moe_module.LOCAL_FIRST_MIN_TOKENS  # no capture
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert moe_module.local_first_min_tokens() == moe_module.LOCAL_FIRST_MIN_TOKENS_IN_GRAPH
    assert moe_module.LOCAL_FIRST_MIN_TOKENS_IN_GRAPH < moe_module.LOCAL_FIRST_MIN_TOKENS
