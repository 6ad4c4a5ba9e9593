"""DeepSeek-V4's clamped SwiGLU (`swiglu_limit`) in silu_and_mul, the fused MoE (general and
small-batch kernels, interpreter on CPU) and the layers that pass it, against float64 references
written from transformers' DeepseekV4Experts._apply_gate and DeepseekV4MLP.forward:
gate.clamp(max=limit), up.clamp(-limit, limit), silu(gate) * up."""

import pytest
import torch
import torch.nn.functional as F

from rayinfer.kernels import ops
from rayinfer.kernels.elementwise.activation import silu_and_mul
from rayinfer.kernels.moe.fused_moe import fused_moe, fused_moe_reference
from rayinfer.kernels.moe.fused_moe_small import fused_moe_small_batch
from rayinfer.layers.fused_experts import FusedExperts
from rayinfer.layers.mlp import GatedMLP

LIMIT = 0.75  # small enough that gate and up values of ~N(0, 1) are clamped often
TOLERANCES = {torch.float32: 2e-5, torch.float16: 3e-3}
TILES = {
    "plain": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4},
    "chunks": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4, "TAIL_M": 8},
}


def _apply_gate(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def _experts_reference(x, w13, w2, weights, ids, limit):
    """DeepseekV4Experts.forward in float64, token by token."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    x, w13, w2 = x.double(), w13.double(), w2.double()
    for token, (experts, gains) in enumerate(zip(ids.tolist(), weights.double())):
        for expert, gain in zip(experts, gains):
            if 0 <= expert < w13.shape[0]:
                act = _apply_gate(x[token] @ w13[expert].t(), limit)  # [I]
                out[token] += gain * (act @ w2[expert].t())
    return out


def _problem(num_tokens, hidden, inter, num_experts, top_k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5 * 2
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    weights = torch.rand(num_tokens, top_k, generator=gen)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in x])
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("shape", [(1, 2), (6, 246)], ids=["one-token", "odd"])
def test_silu_and_mul_clamps(shape, dtype):
    x = (3 * torch.randn(shape, generator=torch.Generator().manual_seed(1))).to(dtype)
    expected = _apply_gate(x.double(), LIMIT)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(silu_and_mul(x, LIMIT).double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(ops.silu_and_mul(x, LIMIT).double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("tiles", list(TILES))
@pytest.mark.parametrize("num_tokens", [1, 11])
def test_fused_moe_clamps(num_tokens, tiles, dtype):
    x, w13, w2, weights, ids = _problem(num_tokens, 48, 24, 5, 3, dtype, seed=num_tokens)
    ids[0, 0] = -1  # another rank's expert: adds nothing
    expected = _experts_reference(x, w13, w2, weights, ids, LIMIT)
    config = {"w13": TILES[tiles], "w2": TILES[tiles]}
    ours = fused_moe(x, w13, w2, weights, ids, config=config, swiglu_limit=LIMIT)
    reference = fused_moe_reference(x.float(), w13.float(), w2.float(), weights, ids, LIMIT)
    tol = TOLERANCES[dtype] * 5  # act is rounded to x's dtype between the GEMMs
    torch.testing.assert_close(ours.double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(reference.double(), expected, atol=1e-5, rtol=1e-5)
    unclamped = fused_moe(x, w13, w2, weights, ids, config=config)
    assert (unclamped.double() - expected).abs().max() > 10 * tol  # the limit bites


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
def test_small_batch_moe_clamps(dtype):
    x, w13, w2, weights, ids = _problem(2, 40, 24, 6, 3, dtype, seed=5)
    expected = _experts_reference(x, w13, w2, weights, ids, LIMIT)
    ours = fused_moe_small_batch(x, w13, w2, weights, ids, swiglu_limit=LIMIT)
    tol = TOLERANCES[dtype] * 5
    torch.testing.assert_close(ours.double(), expected, atol=tol, rtol=tol)


def test_layers_pass_the_limit():
    x, w13, w2, weights, ids = _problem(3, 32, 16, 4, 2, torch.float32, seed=2)
    experts = FusedExperts(4, 32, 16, swiglu_limit=LIMIT)
    experts.w13.data.copy_(w13)
    experts.w2.data.copy_(w2)
    expected = _experts_reference(x, w13, w2, weights, ids, LIMIT)
    torch.testing.assert_close(experts(x, weights, ids).double(), expected, atol=1e-5, rtol=1e-5)
    mlp = GatedMLP(32, 16, swiglu_limit=LIMIT)
    gate_up = mlp.gate_up_proj.weight.data.normal_(std=0.5)
    down = mlp.down_proj.weight.data.normal_(std=0.25)
    expected = _apply_gate(x.double() @ gate_up.double().t(), LIMIT) @ down.double().t()
    torch.testing.assert_close(mlp(x).double(), expected, atol=1e-5, rtol=1e-5)
