"""Turns a ModelBatch into tensors, runs the model over the paged cache and samples next tokens.

One ModelRunner lives on each device (in-process, or inside a Ray worker actor). It owns the
model's weights, the KV cache (kv_cache.py), the forward of a step (forward.py) and the requests'
sampling state (sampling.py); with a CudaGraphConfig, also the CUDA graphs (step_graphs.py,
captured once the cache exists), which replay every step that fits them.

With a KVMemoryConfig on CUDA (`gpu_memory_utilization`), the cache's block count comes from the
GPU's memory instead of the CacheConfig: `kv_blocks_that_fit` runs one profiling step of the
largest batch after the weights are loaded (see kv_memory.py), then `allocate_kv` allocates the
cache and captures the graphs. A multi-worker group calls the two itself, allocating every
worker's cache with the smallest count any worker found (`allocate_kv=False`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from itertools import accumulate

import numpy as np
import torch

from rayinfer.config import ConfigError, ModelConfig
from rayinfer.engine.batch import ModelBatch, SampledTokens
from rayinfer.engine_config import CacheConfig, KVMemoryConfig
from rayinfer.graph_config import CudaGraphConfig
from rayinfer.kernels.backends import DEFAULT_BACKENDS, KernelBackends
from rayinfer.kernels.dsa.dsa_index_fp8 import check_fp8_index_device
from rayinfer.kernels.fp8.fp8_support import require_fp8_device
from rayinfer.layers.forward_context import ForwardContext, build_attention_metadata
from rayinfer.layers.layer_options import configure_layers
from rayinfer.layers.parallel import SINGLE, ParallelContext
from rayinfer.layers.sampler import log_probabilities
from rayinfer.layers.two_batch_overlap import supports_two_batch_overlap
from rayinfer.models.dummy import build_dummy_model
from rayinfer.models.loader import load_model
from rayinfer.overlap_config import DEFAULT_OVERLAP, OverlapConfig
from rayinfer.workers.runner.decode_graphs import DecodeGraphs
from rayinfer.workers.runner.forward import StepForward
from rayinfer.workers.runner.kv_cache import KVCache, new_kv_caches
from rayinfer.workers.runner.kv_memory import (
    CUDA_GRAPH_RESERVE_BYTES,
    SAFETY_MARGIN_BYTES,
    activation_peak_bytes,
    kv_bytes_per_block,
    num_kv_blocks_for_memory,
    worker_memory,
)
from rayinfer.workers.runner.kv_transfer import KVPayload
from rayinfer.workers.runner.logprobs import prompt_logprobs, sampled_logprobs
from rayinfer.workers.runner.piecewise_graphs import PiecewiseGraphs
from rayinfer.workers.runner.prefill_graphs import PrefillGraphs
from rayinfer.workers.runner.sampling import RequestSampler
from rayinfer.workers.runner.step_graphs import StepGraphs, forward_is_capturable
from rayinfer.workers.runner.step_timeline import StepTimeline, StepTimelines


def supports_memory_sizing(device: torch.device) -> bool:
    """Whether the cache can be sized from the device's memory (CUDA's allocator statistics)."""
    return device.type == "cuda"


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: torch.device | str,
        dtype: torch.dtype,
        parallel: ParallelContext = SINGLE,
        two_batch_overlap: bool | None = None,
        load_format: str = "safetensors",
        cuda_graphs: CudaGraphConfig | None = None,
        kv_memory: KVMemoryConfig | None = None,
        allocate_kv: bool = True,
        fp8_weights: bool = False,
        overlap: OverlapConfig = DEFAULT_OVERLAP,
        kernels: KernelBackends = DEFAULT_BACKENDS,
    ):
        self.model_config = model_config
        self.cache_config = cache_config
        self.device = torch.device(device)
        self.dtype = dtype
        self.parallel = parallel
        if model_config.index_keys_fp8:
            check_fp8_index_device(self.device)
        if fp8_weights:
            require_fp8_device(
                self.device, "fp8_weights=true",
                "use fp8_weights=false (the checkpoint's FP8 weights are dequantized at load)",
            )  # fmt: skip
        # the widest layer's row (what a hand-off carries per layer), and each layer's own
        self.kv_shape = model_config.kv_shape_per_token_on_rank(parallel.tp_size, dtype.itemsize)
        self.kv_shapes = model_config.kv_shapes_on_rank(parallel.tp_size, dtype.itemsize)
        if self.windowed and cache_config.num_window_blocks <= 0:
            raise ConfigError(
                f"num_window_blocks={cache_config.num_window_blocks}: this model keeps window "
                "state (window_span "
                f"{model_config.window_span} tokens); size it with "
                "engine_config.window_blocks_needed"
            )
        self.kv_heads = None  # (first, count) of the K/V heads cached here; None for MLA's latent
        if not model_config.kv_is_replicated:
            self.kv_heads = (parallel.tp_rank * self.kv_shape[1], self.kv_shape[1])
        if load_format == "dummy":
            self.model = build_dummy_model(
                model_config, dtype, self.device, parallel, fp8_weights=fp8_weights
            )
        else:
            self.model = load_model(model_config, dtype, self.device, parallel, fp8_weights)
        configure_layers(self.model, kernels, overlap)
        self.overlap = overlap
        if two_batch_overlap is None:  # measured faster where GPUs' experts exchange tokens
            two_batch_overlap = self.device.type == "cuda" and parallel.experts_exchange_tokens
        two_batch_overlap = two_batch_overlap and supports_two_batch_overlap(self.model)
        self.forward = StepForward(
            self.model, parallel, self.device, cache_config.block_size, two_batch_overlap, overlap,
            self.windowed,
        )  # fmt: skip
        self.sampler = RequestSampler(
            model_config, self.device.type == "cuda", parallel.tp_group, self.device
        )
        self.cuda_graphs = cuda_graphs
        # Sizing the cache from memory needs CUDA's allocator statistics; elsewhere the
        # CacheConfig's count stands.
        self.kv_memory = kv_memory if supports_memory_sizing(self.device) else None
        self.kv_cache: KVCache | None = None  # made by allocate_kv
        self.graphs = StepGraphs(cuda_graphs, parallel)  # captured by allocate_kv
        self.timelines = StepTimelines(self.device)  # the last steps' host and GPU times
        if allocate_kv:
            num_blocks = self.kv_blocks_that_fit() if self.kv_memory else cache_config.num_blocks
            self.allocate_kv(num_blocks)

    def allocate_kv(self, num_blocks: int) -> None:
        """Allocate the cache with num_blocks blocks, then capture the graphs over it."""
        if num_blocks != self.cache_config.num_blocks:
            self.cache_config = replace(self.cache_config, num_blocks=num_blocks)
        layers = self._new_kv_caches(num_blocks, self.cache_config.num_window_blocks)
        num_layers = self.model_config.num_layers
        self.kv_cache = KVCache(
            layers[:num_layers], self.cache_config.block_size, self.kv_heads,
            window_layers=layers[num_layers:], window_span=self.model_config.window_span,
        )  # fmt: skip
        self.graphs = StepGraphs(self.cuda_graphs, self.parallel)
        self.graphs.capture(
            self.model, self.forward, self.kv_caches, self.cache_config.block_size, self.device,
            self.overlap, self.windowed,
        )  # fmt: skip

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """Per layer [num_blocks, block_size, *kv_shape], then per layer its window cache where
        the model keeps a window pool (ForwardContext); [] before `allocate_kv`."""
        if self.kv_cache is None:
            return []
        return self.kv_cache.layers + self.kv_cache.window_layers

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        return self.graphs.decode

    @property
    def prefill_graphs(self) -> PrefillGraphs | None:
        return self.graphs.prefill

    @property
    def piecewise_graphs(self) -> PiecewiseGraphs | None:
        return self.graphs.piecewise

    @property
    def graph_capture_seconds(self) -> float | None:
        """Warm-up and capture of the CUDA graphs; None without graphs."""
        return self.graphs.capture_seconds

    @property
    def prefill_graph_sizes(self) -> list[int]:
        """Token buckets of the prefill graphs ([] without them)."""
        return [] if self.prefill_graphs is None else self.prefill_graphs.sizes

    @property
    def captures_decode_graphs(self) -> bool:
        """Whether this plan's forward can be captured (step_graphs.forward_is_capturable)."""
        return forward_is_capturable(self.cuda_graphs, self.parallel)

    def kv_blocks_that_fit(self, kv_memory: KVMemoryConfig | None = None) -> int | None:
        """KV blocks this device can hold under `kv_memory` (default: the runner's; None without
        one, e.g. off CUDA), measured by a profiling step of the largest batch; a ConfigError when
        not even one max_model_len sequence fits."""
        kv_memory = kv_memory or self.kv_memory
        if kv_memory is None:
            return None
        block_size = self.cache_config.block_size
        peak = self._profile_activation_peak(kv_memory)
        share = kv_memory.gpu_share  # the profiling cache is freed by now
        total, in_use = worker_memory(self.device, share)
        reserve = SAFETY_MARGIN_BYTES + self.window_pool_bytes
        if self.captures_decode_graphs:
            reserve += CUDA_GRAPH_RESERVE_BYTES
            if self.cuda_graphs.max_prefill_tokens:  # their pool: at most a step's activations
                reserve += peak
            if self.cuda_graphs.max_piecewise_tokens:  # theirs, and the attentions' operands
                reserve += peak
        return num_kv_blocks_for_memory(
            total_bytes=total,
            utilization=kv_memory.gpu_memory_utilization,
            non_kv_bytes=in_use,
            activation_peak_bytes=peak,
            bytes_per_block=kv_bytes_per_block(
                self.model_config, self.parallel.tp_size, self.dtype.itemsize, block_size
            ),
            block_size=block_size,
            max_model_len=kv_memory.max_model_len,
            reserve_bytes=reserve,
            key=kv_memory.key,
            gpu_share=share,
        )

    @property
    def windowed(self) -> bool:
        """Whether the model keeps a window pool (engine/block_manager.py)."""
        return self.model_config.window_span > 0

    @property
    def window_pool_bytes(self) -> int:
        """The window pool's allocation (0 without one)."""
        per_block = self.cache_config.block_size * self.model_config.window_row_width
        blocks = self.cache_config.num_window_blocks if self.windowed else 0
        return self.model_config.num_layers * blocks * per_block * self.dtype.itemsize

    def _profile_activation_peak(self, kv_memory: KVMemoryConfig) -> int:
        """The profiling step's peak beyond the weights and its cache: the step reads one
        max_model_len sequence's context from a cache of just that size, freed on return."""
        num_blocks = -(-kv_memory.max_model_len // self.cache_config.block_size)
        window_table = self._profile_window_table(kv_memory)
        caches = self._new_kv_caches(num_blocks, sum(b >= 0 for b in window_table))
        return activation_peak_bytes(lambda: self._profile_step(caches, kv_memory), self.device)

    @torch.inference_mode()
    def _profile_step(self, caches: list[torch.Tensor], kv_memory: KVMemoryConfig) -> None:
        """The largest step the scheduler can form: max_num_batched_tokens new tokens (a prefill
        chunk) at the end of a max_model_len context, so attention reads the longest context
        (MLA's prefill rebuilds K and V of all of it), then logits for max_num_seqs rows. Every
        worker of a group runs it at once, so the collectives of tp / ep plans match."""
        context = kv_memory.max_model_len
        num_tokens = min(kv_memory.max_num_batched_tokens, context)
        block_size = self.cache_config.block_size
        table = list(range(-(-context // block_size)))
        metadata = build_attention_metadata(
            [num_tokens], [context], [table], block_size, self.device,
            window_tables=[self._profile_window_table(kv_memory)] if self.windowed else None,
        )  # fmt: skip
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(context - num_tokens, context, device=self.device)
        hidden = self.forward(input_ids, positions, ForwardContext(metadata, caches))  # [T, H]
        rows = min(kv_memory.max_num_seqs, num_tokens)
        self.model.compute_logits(hidden[-rows:])  # [rows, V] float32

    def _profile_window_table(self, kv_memory: KVMemoryConfig) -> list[int]:
        """The profiling step's window table: blocks for its chunk and the window span before
        it, none ([]) without a window pool."""
        if not self.windowed:
            return []
        context, block_size = kv_memory.max_model_len, self.cache_config.block_size
        num_tokens = min(kv_memory.max_num_batched_tokens, context)
        first = max(context - num_tokens - self.model_config.window_span, 0) // block_size
        return [-1] * first + list(range(-(-context // block_size) - first))

    def _new_kv_caches(self, num_blocks: int, num_window_blocks: int = 0) -> list[torch.Tensor]:
        """Per layer its cache, then (a window pool) per layer its window cache."""
        num_layers, block_size = self.model_config.num_layers, self.cache_config.block_size
        caches = new_kv_caches(self.kv_shapes, num_blocks, block_size, self.dtype, self.device)
        if self.windowed:
            widths = ((self.model_config.window_row_width,),) * num_layers
            caches += new_kv_caches(
                widths, num_window_blocks, block_size, self.dtype, self.device,
                key="num_window_blocks",
            )  # fmt: skip
        return caches

    @torch.inference_mode()
    def execute(
        self, batch: ModelBatch, on_layer_cached: Callable[[int], None] | None = None
    ) -> SampledTokens:
        """Run one step; returns the next token of every request with `samples`, in order (and
        their log-probabilities where asked). on_layer_cached: told each layer's index once its
        cache writes are queued, where the forward runs its attentions eagerly (eager, in
        pieces; ForwardContext.on_layer_cached)."""
        timeline = self.timelines.begin(batch.num_tokens)
        try:
            return self._execute(batch, timeline, on_layer_cached)
        finally:
            self.timelines.end(timeline)

    def _execute(self, batch: ModelBatch, timeline: StepTimeline, on_layer_cached=None):
        requests = batch.requests
        replay = self.graphs.choose(batch)
        if not requests and replay is None:
            self.forward.idle(self.kv_caches, batch.ep_tokens)
            return SampledTokens([])
        kind, bucket = replay or (None, None)
        if kind == "prefill":  # one new prompt (or none: padding), from a graph
            hidden = self.prefill_graphs.run(requests, bucket)  # [n, H]
            last_rows = [hidden.shape[0] - 1] if requests and requests[0].samples else []
        elif kind == "piecewise":  # any other step, from graphs cut at each attention
            hidden = self.piecewise_graphs.run(requests, bucket, on_layer_cached)  # [n, H]
            ends = accumulate(len(r.token_ids) for r in requests)
            last_rows = [end - 1 for r, end in zip(requests, ends) if r.samples]
        elif kind == "decode":  # pure decodes, from a graph: one row per request
            hidden = self.decode_graphs.run(requests, bucket)  # [B, H]
            last_rows = [row for row, r in enumerate(requests) if r.samples]
        else:
            hidden, last_rows = self.forward.eager(
                requests, self.kv_caches, batch.ep_tokens, timeline, on_layer_cached
            )
        if kind is not None:
            timeline.inputs_ready = timeline.received  # the replay copies its own inputs
            timeline.mark("queued")
        prompt = None
        if kind != "decode":  # a decode graph's rows hold no prompt tokens
            prompt = prompt_logprobs(hidden, requests, self.model.compute_logits)
        if not last_rows:
            return SampledTokens([], prompt_logprobs=prompt)
        sampling = [r for r in requests if r.samples]
        # On a GPU the forward is still running: the host fills the grammar masks meanwhile.
        masks = self.sampler.masks(sampling)
        # Every row samples in a pure decode: no index tensor to build and copy to the device.
        last = hidden if len(last_rows) == hidden.shape[0] else hidden[last_rows]
        logits = self.model.compute_logits(last)  # [B, V] float32
        wanted = [r.params.logprobs for r in sampling]
        raw = log_probabilities(logits, wanted)  # before penalties and masks change the logits
        tokens, failed = self.sampler.sample(logits, sampling, masks)
        errors = {sampling[row].request_id: why for row, why in failed.items()} or None
        if raw is None:
            return SampledTokens(tokens, prompt_logprobs=prompt, errors=errors)
        return SampledTokens(tokens, sampled_logprobs(raw, tokens, wanted), prompt, errors)

    @property
    def kv_bytes_per_token(self) -> int:
        """Every layer's cache row of one token on this rank."""
        return sum(math.prod(shape) for shape in self.kv_shapes) * self.dtype.itemsize

    def export_kv_chunks(
        self,
        request_id: str,
        block_table: list[int],
        num_tokens: int,
        window_table: list[int] | None = None,
    ) -> tuple[KVPayload, Iterator[np.ndarray]]:
        """A request's first num_tokens tokens of KV: the payload without its chunks, and the
        chunks as they are copied out (each valid until the next is taken; kv_copy.py)."""
        state = self.sampler.generator_state(request_id)
        return self.kv_cache.export_chunks(block_table, num_tokens, state, window_table)

    def export_kv(
        self,
        request_id: str,
        block_table: list[int],
        num_tokens: int,
        window_table: list[int] | None = None,
    ) -> KVPayload:
        """The KV as an in-memory payload (the chunks copied out of the reused buffers)."""
        header, chunks = self.export_kv_chunks(request_id, block_table, num_tokens, window_table)
        return header.with_chunks([chunk.copy() for chunk in chunks])

    def import_kv(
        self,
        request_id: str,
        block_table: list[int],
        payload: KVPayload | list[KVPayload],
        window_table: list[int] | None = None,
    ) -> None:
        """Write a hand-off into these blocks; a list holds the shards of every prefill rank,
        from which this rank takes its own K/V heads (any prefill plan to any decode plan)."""
        payloads = payload if isinstance(payload, list) else [payload]
        state = self.kv_cache.import_payloads(block_table, payloads, window_table)
        if state is not None:
            self.sampler.restore_generator(request_id, state)

    def free_requests(self, request_ids: list[str]) -> None:
        self.sampler.free(request_ids)
