"""Pure-decode steps through CUDA graphs: one graph per batch-size bucket, captured at start.

Each decode step of a MoE model launches about 43 kernels per layer; at small batches the host
spends ~30 ms launching what the GPU runs in ~4 ms. A graph launches the whole forward at once.
Per bucket (`graph_buckets`), the model forward over `StaticDecodeInputs` is warmed up (Triton
compiles), then captured; the graphs share one memory pool (largest first) and read the engine's
real KV cache tensors, so capture runs after the cache is allocated. A step copies its batch
into the static buffers, pads it to its bucket, replays, and slices the hidden states of the real
rows; logits and sampling stay outside the graph.

What runs inside must not synchronize with the host nor take shapes from data: the split-K
decode attention splits by the bucket and max_model_len (the padded block tables), MLA's absorbed
decode reads the device context lengths, and fused MoE sorts into its worst-case padded size and
reads the real row count on the device. Collectives are captured too (NCCL kernels): in a worker
group every rank replays the bucket the driver agreed on for the step (`shared_decode_bucket`),
an idle data-parallel replica on padding, and the experts' exchange sends every token to every
rank, so its sizes are the bucket's.

On the CPU nothing is captured: `run` pads the batch the same way and runs the forward eagerly
over the static inputs, so the padding, the slicing and the static buffers are testable there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from rayinfer.engine.batch import ScheduledRequest
from rayinfer.engine.decode_inputs import GraphStep, StaticDecodeInputs, fits_static_decode
from rayinfer.engine.graph_buckets import bucket_for, graph_batch_sizes
from rayinfer.engine.graph_capture import capture_buckets
from rayinfer.graph_config import CudaGraphConfig
from rayinfer.layers.forward_context import ForwardContext

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor]


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,  # input_ids [T], positions [T], ctx -> hidden [T, H]
        kv_caches: list[torch.Tensor],
        config: CudaGraphConfig,
        block_size: int,
        device: torch.device,
    ):
        self.forward = forward
        self.sizes = graph_batch_sizes(config.max_batch_size)
        width = config.table_width(block_size)
        self.inputs = StaticDecodeInputs(self.sizes[-1], width, block_size, kv_caches, device)
        self.device = device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # b -> [b, H]
        self.enabled = True  # False: the runner takes its eager path (benchmarks compare both)
        self.capture_seconds = 0.0

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def bucket_of(self, requests: list[ScheduledRequest]) -> int | None:
        """The bucket a pure-decode batch (one new token per sequence) replays in, or None when
        it does not fit one (or the graphs are switched off)."""
        if not self.enabled:
            return None
        return shared_decode_bucket([requests], self.sizes, self.inputs.max_blocks_per_seq)

    def capture(self) -> None:
        """Warm up and capture every bucket, largest first (one shared pool); CUDA only."""
        if self.device.type != "cuda":
            return
        self.graphs, self.capture_seconds = capture_buckets(
            self.forward, self.sizes, self.inputs.fill_padding, self.device
        )
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
            len(self.sizes), self.sizes, self.capture_seconds,
        )  # fmt: skip

    def run(self, requests: list[ScheduledRequest], bucket: int | None = None) -> torch.Tensor:
        """Hidden states [n, H] of n decodes; valid until the next `run` (a view of the graph's
        static output on CUDA). `bucket`: the one a worker group agreed on (see
        `shared_decode_bucket`; with no requests the whole bucket is padding); default: the
        smallest that holds the batch."""
        bucket = bucket or bucket_for(len(requests), self.sizes)
        step: GraphStep = self.inputs.fill(requests, bucket)
        captured = self.graphs.get(bucket)
        if captured is None:
            hidden = self.forward(*step)  # [b, H]: the CPU, or before capture
        else:
            graph, hidden = captured
            graph.replay()
        return hidden[: len(requests)]


def shared_decode_bucket(
    shares: list[list[ScheduledRequest]], sizes: list[int], max_blocks_per_seq: int
) -> int | None:
    """The one bucket in which every share (a data-parallel replica's requests) runs this step
    as padded decodes, or None when some share cannot (a prefill chunk, a table wider than
    max_model_len, more sequences than the largest bucket, or nothing to run at all). Empty
    shares are allowed: they replay the bucket on padding."""
    largest = max(map(len, shares), default=0)
    if not 0 < largest <= sizes[-1]:
        return None
    if not all(fits_static_decode(r, max_blocks_per_seq) for share in shares for r in share):
        return None
    return bucket_for(largest, sizes)
