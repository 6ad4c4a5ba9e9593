"""The decode kernels behind flags are wired into ops as the flags say (run here under Triton's
interpreter by treating the CPU tensors as if they were on CUDA): with RAYINFER_FUSED_ROUTING
(on by default) / RAYINFER_SMALL_BATCH_MOE (opt-in) set, ops calls them with the arguments in
the right order and returns what the references return."""

import pytest
import torch

from rayinfer.kernels import ops
from rayinfer.kernels.moe.fused_moe import fused_moe_reference
from rayinfer.kernels.moe.moe_routing import moe_routing_reference


@pytest.fixture
def as_if_on_cuda(monkeypatch):
    monkeypatch.setattr(ops, "_on_cuda", lambda x: True)
    return monkeypatch


def test_routing_kernel_is_on_and_small_batch_moe_off_by_default(monkeypatch):
    import importlib

    monkeypatch.delenv("RAYINFER_FUSED_ROUTING", raising=False)
    monkeypatch.delenv("RAYINFER_SMALL_BATCH_MOE", raising=False)
    fresh = importlib.reload(ops)
    try:
        assert fresh.FUSED_ROUTING and not fresh.SMALL_BATCH_MOE
        monkeypatch.setenv("RAYINFER_FUSED_ROUTING", "0")
        assert not importlib.reload(ops).FUSED_ROUTING
    finally:
        monkeypatch.undo()
        importlib.reload(ops)


def test_fused_routing_flag_routes_through_the_kernel(as_if_on_cuda):
    as_if_on_cuda.setattr(ops, "FUSED_ROUTING", True)
    called = []
    kernel = ops.moe_routing_triton
    as_if_on_cuda.setattr(ops, "moe_routing_triton", lambda *a: called.append(1) or kernel(*a))
    gen = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(5, 16, generator=gen), torch.randn(16, generator=gen) * 0.3
    args = (logits, 4, "sigmoid", True, 4, 2, bias, 2.5)
    ours, expected = ops.moe_routing(*args), moe_routing_reference(*args)
    assert called and torch.equal(ours.topk_ids, expected.topk_ids)
    torch.testing.assert_close(ours.topk_weights, expected.topk_weights)


def test_small_batch_moe_flag_takes_only_few_slots(as_if_on_cuda):
    as_if_on_cuda.setattr(ops, "SMALL_BATCH_MOE", True)
    taken = []
    small = ops.fused_moe_small_batch
    as_if_on_cuda.setattr(
        ops, "fused_moe_small_batch", lambda *a, **kw: taken.append(1) or small(*a, **kw)
    )
    as_if_on_cuda.setattr(ops, "fused_moe_triton", lambda *a, **kw: "general path")
    gen = torch.Generator().manual_seed(1)
    w13 = torch.randn(8, 32, 24, generator=gen) / 5
    w2 = torch.randn(8, 24, 16, generator=gen) / 4
    x, weights = torch.randn(1, 24, generator=gen), torch.rand(1, 2, generator=gen)
    ids = torch.tensor([[3, 5]])
    out = ops.fused_moe(x, w13, w2, weights, ids)
    assert taken
    torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, weights, ids))
    many = torch.randint(0, 8, (9, 2))  # 18 slots: the general path
    assert ops.fused_moe(torch.randn(9, 24), w13, w2, torch.rand(9, 2), many) == "general path"
