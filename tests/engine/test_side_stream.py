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


def test_a_moe_block_adds_its_shared_experts_through_the_handle():
    torch.manual_seed(0)
    routing = RoutingMethod(top_k=2, scoring="softmax", renormalize=True)
    moe = MoE(16, 4, 8, routing, shared_intermediate_size=8)
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.2)
    x = torch.randn(5, 16)
    handle = moe.start_shared_experts(x)
    assert torch.allclose(moe.finish(handle, torch.zeros(5, 16)), moe.shared_experts(x))
    assert moe.finish(None, x) is x
