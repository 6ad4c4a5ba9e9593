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

from collections.abc import Callable

import torch

from rayinfer.engine.batch import ScheduledRequest
from rayinfer.graph_config import CudaGraphConfig
from rayinfer.layers.forward_context import ForwardContext
from rayinfer.workers.runner.decode_inputs import StaticDecodeInputs, fits_static_decode
from rayinfer.workers.runner.graph_buckets import bucket_for, graph_batch_sizes
from rayinfer.workers.runner.graph_capture import BucketGraphs

Forward = Callable[[torch.Tensor, torch.Tensor, ForwardContext], torch.Tensor]


class DecodeGraphs(BucketGraphs):
    kind = "decode"

    def __init__(
        self,
        forward: Forward,  # input_ids [T], positions [T], ctx -> hidden [T, H]
        kv_caches: list[torch.Tensor],
        config: CudaGraphConfig,
        block_size: int,
        device: torch.device,
        windowed: bool = False,  # the model keeps a window pool (StaticDecodeInputs)
    ):
        sizes = graph_batch_sizes(config.max_batch_size)
        width = config.table_width(block_size)
        inputs = StaticDecodeInputs(sizes[-1], width, block_size, kv_caches, device, windowed)
        super().__init__(forward, sizes, inputs, device)

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def bucket_of(self, requests: list[ScheduledRequest]) -> int | None:
        """The bucket a pure-decode batch (one new token per sequence) replays in, or None when
        it does not fit one (or the graphs are switched off)."""
        if not self.enabled:
            return None
        return shared_decode_bucket([requests], self.sizes, self.inputs.max_blocks_per_seq)

    def run(self, requests: list[ScheduledRequest], bucket: int | None = None) -> torch.Tensor:
        """Hidden states [n, H] of n decodes; valid until the next `run` (a view of the graph's
        static output on CUDA). `bucket`: the one a worker group agreed on (see
        `shared_decode_bucket`; with no requests the whole bucket is padding); default: the
        smallest that holds the batch."""
        bucket = bucket or bucket_for(len(requests), self.sizes)
        return self.replay(requests, bucket)[: len(requests)]  # [n, H]


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
