"""The CUDA graphs one runner captures, and which of them replays a step.

Three kinds, each over the engine's real KV cache (so captured after it is allocated):
- decode graphs: pure decodes, one per batch-size bucket (decode_graphs.py);
- prefill graphs: one new prompt per data-parallel replica, one per token bucket
  (prefill_graphs.py);
- piecewise graphs: any other step, one chain per token bucket, attention eager between the
  pieces; one GPU per replica only (piecewise_graphs.py).
A step replays the first kind that takes it, or runs eagerly. Ranks that share collectives must
replay the same graph, so there the group's driver picks the decode and prefill buckets for all
(ModelBatch.decode_bucket / prefill_bucket), and no step runs in pieces.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rayinfer.engine.batch import ModelBatch
from rayinfer.graph_config import CudaGraphConfig, exchange_graph_blocker
from rayinfer.layers.graph_pieces import cuts_every_attention
from rayinfer.layers.parallel import ParallelContext
from rayinfer.overlap_config import OverlapConfig
from rayinfer.workers.runner.decode_graphs import DecodeGraphs
from rayinfer.workers.runner.forward import StepForward
from rayinfer.workers.runner.piecewise_graphs import PiecewiseGraphs
from rayinfer.workers.runner.prefill_graphs import PrefillGraphs


def forward_is_capturable(config: CudaGraphConfig | None, parallel: ParallelContext) -> bool:
    """Graphs wherever the forward can be captured: collectives become NCCL kernels, but a
    token exchange through host flags or sized from the routing cannot be replayed."""
    if config is None:
        return False
    if not parallel.experts_exchange_tokens:
        return True
    return exchange_graph_blocker(parallel.ep_group.all_to_all) is None


class Replay(NamedTuple):
    kind: str  # "decode", "prefill" or "piecewise"
    bucket: int


class StepGraphs:
    def __init__(self, config: CudaGraphConfig | None, parallel: ParallelContext):
        self.config, self.parallel = config, parallel
        self.decode: DecodeGraphs | None = None
        self.prefill: PrefillGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None

    @property
    def can_capture(self) -> bool:
        return forward_is_capturable(self.config, self.parallel)

    def capture(
        self,
        model: torch.nn.Module,
        forward: StepForward,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        overlap: OverlapConfig,
        windowed: bool,
    ) -> None:
        """Capture what the config asks for and the plan and model allow (on the CPU: set up
        the same static inputs, nothing captured)."""
        config = self.config
        if not self.can_capture:
            return
        if config.max_prefill_tokens:
            self.prefill = PrefillGraphs(
                forward.in_graph, kv_caches, config.max_prefill_tokens, block_size, device, overlap
            )
            self.prefill.capture()
        pieces_fit = not self.parallel.has_collectives and cuts_every_attention(model)
        if config.max_piecewise_tokens and pieces_fit:
            self.piecewise = PiecewiseGraphs(
                model, kv_caches, config.max_piecewise_tokens, block_size, device
            )
            self.piecewise.capture()
        self.decode = DecodeGraphs(
            forward.in_graph, kv_caches, config, block_size, device, windowed
        )
        self.decode.capture()

    @property
    def capture_seconds(self) -> float | None:
        """Warm-up and capture of every graph; None without graphs."""
        captured = [g for g in (self.decode, self.prefill, self.piecewise) if g is not None]
        return sum(g.capture_seconds for g in captured) if captured else None

    def choose(self, batch: ModelBatch) -> Replay | None:
        """The graph that replays this step, or None to run it eagerly."""
        shared = self.parallel.has_collectives
        if self.decode is not None:
            bucket = batch.decode_bucket if shared else self.decode.bucket_of(batch.requests)
            if bucket is not None:
                return Replay("decode", bucket)
        if self.prefill is not None:
            bucket = batch.prefill_bucket if shared else self.prefill.bucket_of(batch.requests)
            if bucket is not None:
                return Replay("prefill", bucket)
        if self.piecewise is not None:
            bucket = self.piecewise.bucket_of(batch.requests)
            if bucket is not None:
                return Replay("piecewise", bucket)
        return None
