"""The shared experts' handle (layers/side_stream.py): on CPU, and wherever it is switched off,
fn(x) is computed when its result is asked for, on the caller's stream; OverlapConfig checks the
switch."""

import pytest
import torch

from rayinfer.config import ConfigError
from rayinfer.exchange_config import AllToAllConfig
from rayinfer.layers import side_stream
from rayinfer.layers.moe import MoE, RoutingMethod
from rayinfer.overlap_config import OverlapConfig


def test_on_cpu_the_work_waits_for_its_result(monkeypatch):
    calls = []

    def double(x):
        calls.append(x.shape[0])
        return 2 * x

    handle = side_stream.later(double, torch.ones(4096, 2), may_run_beside=True)
    assert isinstance(handle, side_stream.Later) and calls == []
    assert torch.equal(handle.result(), torch.full((4096, 2), 2.0)) and calls == [4096]


@pytest.mark.parametrize("value", [256, 0, None])
def test_the_switch(value):
    assert OverlapConfig(shared_experts_beside_from=value).shared_experts_beside_from == value


@pytest.mark.parametrize("bad", ["yes", -1, True, 2.5])
def test_a_bad_switch_names_itself_and_the_valid_values(bad):
    expected = r"overlap\.shared_experts_beside_from=.*number of tokens >= 0, or None"
    with pytest.raises(ConfigError, match=expected):
        OverlapConfig(shared_experts_beside_from=bad)


def test_below_the_threshold_the_work_keeps_the_plain_order(monkeypatch):
    """On a GPU tensor outside capture, `later` runs beside from `beside_from` tokens on and
    in the plain order below it or with None (the Beside class is replaced: no GPU here)."""
    monkeypatch.setattr(side_stream, "Beside", lambda fn, x, reads: "beside")
    x = torch.ones(300, 2)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert side_stream.later(lambda t: t, x, True, beside_from=256) == "beside"
    assert isinstance(side_stream.later(lambda t: t, x, True, beside_from=512), side_stream.Later)
    assert isinstance(side_stream.later(lambda t: t, x, True, beside_from=None), side_stream.Later)


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

    rank, size, all_to_all = 0, 1, AllToAllConfig(local_first=False)

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


def test_where_the_overlap_puts_each_lanes_shared_experts_is_a_setting():
    assert OverlapConfig().shared_experts_beside_combine == (False, False)  # beside dispatch
    second = OverlapConfig(shared_experts="second-at-combine")
    assert second.shared_experts_beside_combine == (False, True)
    with pytest.raises(ConfigError, match=r"overlap\.shared_experts='later'.*dispatch, second"):
        OverlapConfig(shared_experts="later")


def test_local_first_by_default_where_every_rank_has_enough_tokens():
    """all_to_all.local_first=None (the default) runs a rank's experts on its own tokens beside
    the exchange only where every rank's call has LOCAL_FIRST_MIN_TOKENS (one choice for all
    ranks: it shapes the exchange); True and False decide alone; the deduplicated exchange never
    does it."""
    from dataclasses import replace
    from types import SimpleNamespace

    from rayinfer.layers.moe import LOCAL_FIRST_MIN_TOKENS

    moe, x = small_moe_and_tokens()
    group = SimpleNamespace(rank=0, size=2, all_to_all=AllToAllConfig(dedup=False))
    moe.parallel = replace(moe.parallel, ep_group=group)
    routing = moe.route(x)
    enough = LOCAL_FIRST_MIN_TOKENS

    def runs_local(tokens_per_rank, **options):
        group.all_to_all = AllToAllConfig(**{"dedup": False, **options})
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
