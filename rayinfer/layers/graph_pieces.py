"""Attention outside the CUDA graphs of a mixed step: a forward captured in pieces.

A step that mixes decodes with prompt chunks cannot be captured whole: its attention takes its
work from the host (which sequences decode, each chunk's cached prefix). Everything around it (the
projections, norms, MoE) depends on the token count alone. So, as vLLM's piecewise graphs do, such
a step is captured per token-count bucket as a chain of graphs cut at every layer's attention:
piece 0, attention 0 (eager, over the step's own metadata), piece 1, attention 1, ..., piece L
(workers/runner/piecewise_graphs.py).

An attention layer marks its cut with `attend_outside_graphs(ctx, attend, *operands)`: operands
are per-token tensors [T, ...], its inputs and the output it writes; `attend(ctx, *operands)`
reads the step's metadata and writes its results into them. Without pieces (ctx.pieces None) that
is a plain call. Within pieces, the operands are first copied into staging buffers shared by every
layer and bucket (one set for the largest bucket: no graph keeps a layer's tensors alive), and the
layer goes on with the staged copies, so the next piece reads the output where `attend` wrote it.
`attend` then sees the staged operands' first n rows, n the step's real tokens (the rest is the
bucket's padding: zero outputs, no cache writes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from rayinfer.layers.forward_context import ForwardContext

Attend = Callable[..., None]  # attend(ctx, *operands): writes into its output operands


class Pieces(Protocol):
    """What a forward in pieces does at a layer's attention (see the module docstring)."""

    def cut(
        self, attend: Attend, operands: tuple[torch.Tensor, ...], layer: int | None = None
    ) -> tuple[torch.Tensor, ...]: ...


def attend_outside_graphs(
    ctx: ForwardContext, attend: Attend, *operands: torch.Tensor, layer: int | None = None
):
    """Run `attend(ctx, *operands)` now, or, in a forward captured in pieces, outside the graphs;
    returns the operands the layer goes on with (the staged copies within pieces). layer: the
    attention's layer, whose cache writes precede its cut: once it has attended the step's
    context is told (`ForwardContext.layer_cached`), in a replay too."""
    if ctx.pieces is None:
        attend(ctx, *operands)
        ctx.layer_cached(layer)
        return operands
    return ctx.pieces.cut(attend, operands, layer)


def cuts_every_attention(model: torch.nn.Module) -> bool:
    """Whether every attention module of the model marks its cut (`attends_outside_graphs`),
    so that a forward in pieces holds no attention inside a graph."""
    flags = [
        m.attends_outside_graphs for m in model.modules() if hasattr(m, "attends_outside_graphs")
    ]
    return bool(flags) and all(flags)


class StagingBuffers:
    """Per operand slot (its place in the call, dtype and row shape): one [max_tokens, ...] buffer,
    shared by every layer (a layer's attention has consumed its operands before the next layer's
    piece writes them) and by every bucket (one step replays at a time)."""

    def __init__(self, max_tokens: int, device: torch.device):
        self.max_tokens, self.device = max_tokens, device
        self.buffers: dict[tuple, torch.Tensor] = {}

    def stage(self, operands: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Copies of the operands [T, ...] in the buffers' first T rows."""
        staged = []
        for slot, tensor in enumerate(operands):
            key = (slot, tensor.dtype, tuple(tensor.shape[1:]))
            buffer = self.buffers.get(key)
            if buffer is None:
                shape = (self.max_tokens, *tensor.shape[1:])
                buffer = self.buffers[key] = torch.empty(
                    shape, dtype=tensor.dtype, device=self.device
                )
            view = buffer[: tensor.shape[0]]
            view.copy_(tensor)
            staged.append(view)
        return tuple(staged)


class RecordedCut:
    """One attention between two pieces: the call, its staged operands [T, ...] and its layer."""

    def __init__(self, attend: Attend, operands: tuple[torch.Tensor, ...], layer: int | None):
        self.attend, self.operands, self.layer = attend, operands, layer

    def run(self, step_ctx: ForwardContext, num_tokens: int) -> None:
        self.attend(step_ctx, *(tensor[:num_tokens] for tensor in self.operands))
        step_ctx.layer_cached(self.layer)


class EagerPieces:
    """The pieces run eagerly (the CPU's replay, and warm-up before capture): each cut stages its
    operands and attends at once over the step's metadata and its first num_tokens rows."""

    def __init__(self, staging: StagingBuffers, step_ctx: ForwardContext, num_tokens: int):
        self.staging, self.step_ctx, self.num_tokens = staging, step_ctx, num_tokens

    def cut(self, attend: Attend, operands, layer: int | None = None):
        staged = self.staging.stage(operands)
        RecordedCut(attend, staged, layer).run(self.step_ctx, self.num_tokens)
        return staged


class CapturedPieces:
    """Captures a forward as a chain of CUDA graphs sharing one memory pool: call `begin`, run
    the forward (each cut ends the running graph, records the attention and begins the next),
    then `end`. Runs on the caller's (non-default) capture stream."""

    def __init__(self, staging: StagingBuffers, pool):
        self.staging, self.pool = staging, pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.cuts: list[RecordedCut] = []

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def end(self) -> None:
        self.graphs[-1].capture_end()

    def cut(self, attend: Attend, operands, layer: int | None = None):
        staged = self.staging.stage(operands)  # inside the running piece
        self.end()
        self.cuts.append(RecordedCut(attend, staged, layer))
        self.begin()
        return staged

    def replay(self, step_ctx: ForwardContext, num_tokens: int) -> None:
        """Every piece in order, each attention eagerly between them, over the step's metadata."""
        for graph, cut in zip(self.graphs, self.cuts):
            graph.replay()
            cut.run(step_ctx, num_tokens)
        self.graphs[-1].replay()
