"""The decode kernels behind switches are wired into ops as KernelBackends says (run here under
Triton's interpreter by treating the CPU tensors as if they were on CUDA): with fused_routing (on
by default) / small_batch_moe (opt-in), ops calls them with the arguments in the right order and
returns what the references return."""

import pytest
import torch

from rayinfer.kernels import ops
from rayinfer.kernels.backends import DEFAULT_BACKENDS, KernelBackends
from rayinfer.kernels.moe.fused_moe import fused_moe_reference
from rayinfer.kernels.moe.moe_routing import moe_routing_reference


@pytest.fixture
def as_if_on_cuda(monkeypatch):
    monkeypatch.setattr(ops, "_on_cuda", lambda x: True)
    return monkeypatch


def test_routing_kernel_is_on_and_small_batch_moe_off_by_default():
    assert DEFAULT_BACKENDS.fused_routing and not DEFAULT_BACKENDS.small_batch_moe
    for key in ("fused_routing", "small_batch_moe"):
        with pytest.raises(ValueError, match=rf"kernels\.{key}=1; use one of"):
            KernelBackends(**{key: 1})


@pytest.mark.parametrize("fused", [True, False])
def test_fused_routing_flag_routes_through_the_kernel(as_if_on_cuda, fused):
    called = []
    kernel = ops.moe_routing_triton
    as_if_on_cuda.setattr(ops, "moe_routing_triton", lambda *a: called.append(1) or kernel(*a))
    gen = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(5, 16, generator=gen), torch.randn(16, generator=gen) * 0.3
    args = (logits, 4, "sigmoid", True, 4, 2, bias, 2.5)
    backends = KernelBackends(fused_routing=fused)
    ours, expected = ops.moe_routing(*args, backends=backends), moe_routing_reference(*args)
    assert bool(called) == fused and torch.equal(ours.topk_ids, expected.topk_ids)
    torch.testing.assert_close(ours.topk_weights, expected.topk_weights)


def test_small_batch_moe_flag_takes_only_few_slots(as_if_on_cuda):
    backends = KernelBackends(small_batch_moe=True)
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
    out = ops.fused_moe(x, w13, w2, weights, ids, backends=backends)
    assert taken
    torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, weights, ids))
    many = torch.randint(0, 8, (9, 2))  # 18 slots: the general path
    general = ops.fused_moe(torch.randn(9, 24), w13, w2, torch.rand(9, 2), many, backends=backends)
    assert general == "general path"
    assert ops.fused_moe(x, w13, w2, weights, ids) == "general path"  # off by default
