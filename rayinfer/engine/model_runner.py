"""Turns a ModelBatch into tensors, runs the model over the paged cache and samples next tokens.

One ModelRunner lives on each device (in-process, or inside a Ray worker actor). It owns the
model's weights, the KV cache tensors and the per-request sampling generators; with a
CudaGraphConfig, also the decode graphs (captured here, after the cache exists), which run every
pure-decode batch that fits them.

With a KVMemoryConfig on CUDA (`gpu_memory_utilization`), the cache's block count comes from the
GPU's memory instead of the CacheConfig: `kv_blocks_that_fit` runs one profiling step of the
largest batch after the weights are loaded (see kv_memory.py), then `allocate_kv` allocates the
cache and captures the graphs. A multi-worker group calls the two itself, allocating every
worker's cache with the smallest count any worker found (`allocate_kv=False`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from itertools import accumulate, chain

import numpy as np
import torch

from rayinfer.config import ConfigError, ModelConfig
from rayinfer.engine.batch import ModelBatch, SampledLogprobs, SampledTokens, ScheduledRequest
from rayinfer.engine.decode_graphs import DecodeGraphs
from rayinfer.engine.grammar_matchers import GrammarMasks, GrammarMatchers
from rayinfer.engine.kv_copy import KVCopier
from rayinfer.engine.kv_memory import (
    CUDA_GRAPH_RESERVE_BYTES,
    SAFETY_MARGIN_BYTES,
    activation_peak_bytes,
    kv_bytes_per_block,
    num_kv_blocks_for_memory,
    worker_memory,
)
from rayinfer.engine.kv_transfer import (
    KVPayload,
    check_layout,
    payload_for_heads,
    token_slots,
    unpack_kv,
)
from rayinfer.engine.prefill_graphs import PrefillGraphs
from rayinfer.engine.step_timeline import StepTimeline, StepTimelines
from rayinfer.engine_config import CacheConfig, KVMemoryConfig
from rayinfer.graph_config import CudaGraphConfig, exchange_graph_blocker
from rayinfer.kernels.backends import DEFAULT_BACKENDS, KernelBackends
from rayinfer.kernels.dsa_index_fp8 import check_fp8_index_device
from rayinfer.kernels.host_lists import device_ints
from rayinfer.layers.forward_context import (
    ForwardContext,
    build_attention_metadata,
    idle_forward_inputs,
    token_positions,
)
from rayinfer.layers.layer_options import configure_layers
from rayinfer.layers.parallel import SINGLE, ParallelContext
from rayinfer.layers.sampler import (
    NO_TOKEN,
    SampledRows,
    apply_logit_bias,
    apply_penalties,
    apply_token_bitmask,
    gather_logprobs,
    log_probabilities,
    sample_tokens,
)
from rayinfer.layers.two_batch_overlap import (
    forward_two_batch_overlap,
    supports_two_batch_overlap,
    worth_overlapping,
)
from rayinfer.models.dummy import build_dummy_model
from rayinfer.models.loader import load_model
from rayinfer.overlap_config import DEFAULT_OVERLAP, OverlapConfig


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
        self.kv_shape = model_config.kv_shape_per_token_on_rank(parallel.tp_size, dtype.itemsize)
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
        self.two_batch_overlap = two_batch_overlap and supports_two_batch_overlap(self.model)
        self.generators: dict[str, torch.Generator] = {}
        self.grammars = GrammarMatchers(
            model_config.path, model_config.vocab_size, model_config.eos_token_ids,
            pin=self.device.type == "cuda",
        )  # fmt: skip
        self.cuda_graphs = cuda_graphs
        # Sizing the cache from memory needs CUDA's allocator statistics; elsewhere the
        # CacheConfig's count stands.
        self.kv_memory = kv_memory if supports_memory_sizing(self.device) else None
        self.kv_caches: list[torch.Tensor] = []
        self._kv_copier: KVCopier | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.timelines = StepTimelines(self.device)  # the last steps' host and GPU times
        if allocate_kv:
            num_blocks = self.kv_blocks_that_fit() if self.kv_memory else cache_config.num_blocks
            self.allocate_kv(num_blocks)

    def allocate_kv(self, num_blocks: int) -> None:
        """Allocate the cache with num_blocks blocks, then capture the graphs over it."""
        if num_blocks != self.cache_config.num_blocks:
            self.cache_config = replace(self.cache_config, num_blocks=num_blocks)
        self.kv_caches = self._new_kv_caches(num_blocks)
        self._kv_copier = None  # over the new cache
        self.prefill_graphs = self._capture_prefill_graphs(self.cuda_graphs)
        self.decode_graphs = self._capture_decode_graphs(self.cuda_graphs)

    @property
    def graph_capture_seconds(self) -> float | None:
        """Warm-up and capture of the decode and prefill graphs; None without graphs."""
        captured = [g for g in (self.decode_graphs, self.prefill_graphs) if g is not None]
        return sum(g.capture_seconds for g in captured) if captured else None

    @property
    def prefill_graph_sizes(self) -> list[int]:
        """Token buckets of the prefill graphs ([] without them)."""
        return [] if self.prefill_graphs is None else self.prefill_graphs.sizes

    @property
    def captures_decode_graphs(self) -> bool:
        """Graphs wherever the forward can be captured: collectives become NCCL kernels, but a
        token exchange through host flags or sized from the routing cannot be replayed."""
        if self.cuda_graphs is None:
            return False
        parallel = self.parallel
        if not parallel.experts_exchange_tokens:
            return True
        return exchange_graph_blocker(parallel.ep_group.all_to_all) is None

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
        reserve = SAFETY_MARGIN_BYTES
        if self.captures_decode_graphs:
            reserve += CUDA_GRAPH_RESERVE_BYTES
            if self.cuda_graphs.max_prefill_tokens:  # their pool: at most a step's activations
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

    def _profile_activation_peak(self, kv_memory: KVMemoryConfig) -> int:
        """The profiling step's peak beyond the weights and its cache: the step reads one
        max_model_len sequence's context from a cache of just that size, freed on return."""
        caches = self._new_kv_caches(-(-kv_memory.max_model_len // self.cache_config.block_size))
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
            [num_tokens], [context], [table], block_size, self.device
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(context - num_tokens, context, device=self.device)
        hidden = self._forward(input_ids, positions, ForwardContext(metadata, caches))  # [T, H]
        rows = min(kv_memory.max_num_seqs, num_tokens)
        self.model.compute_logits(hidden[-rows:])  # [rows, V] float32

    def _capture_decode_graphs(self, config: CudaGraphConfig | None) -> DecodeGraphs | None:
        if config is None or not self.captures_decode_graphs:
            return None
        graphs = DecodeGraphs(
            self._graph_forward, self.kv_caches, config, self.cache_config.block_size, self.device
        )
        graphs.capture()
        return graphs

    def _capture_prefill_graphs(self, config: CudaGraphConfig | None) -> PrefillGraphs | None:
        if config is None or not config.max_prefill_tokens or not self.captures_decode_graphs:
            return None
        graphs = PrefillGraphs(
            self._graph_forward,
            self.kv_caches,
            config.max_prefill_tokens,
            self.cache_config.block_size,
            self.device,
            self.overlap,
        )
        graphs.capture()
        return graphs

    def _new_kv_caches(self, num_blocks: int) -> list[torch.Tensor]:
        shape = (num_blocks, self.cache_config.block_size, *self.kv_shape)
        try:
            return [
                torch.zeros(shape, dtype=self.dtype, device=self.device)
                for _ in range(self.model_config.num_layers)
            ]
        except (torch.OutOfMemoryError, RuntimeError) as error:
            if not isinstance(error, torch.OutOfMemoryError) and "alloc" not in str(error):
                raise
            size = torch.Size(shape).numel() * self.dtype.itemsize * self.model_config.num_layers
            raise ConfigError(
                f"the KV cache (num_kv_blocks={num_blocks} x block_size="
                f"{self.cache_config.block_size} tokens, {size / 2**30:.1f} GiB) does not fit on "
                f"{self.device}; lower num_kv_blocks or max_model_len"
            ) from None

    @torch.inference_mode()
    def execute(self, batch: ModelBatch) -> SampledTokens:
        """Run one step; returns the next token of every request with `samples`, in order (and
        their log-probabilities where asked)."""
        timeline = self.timelines.begin(batch.num_tokens)
        try:
            return self._execute(batch, timeline)
        finally:
            self.timelines.end(timeline)

    def _execute(self, batch: ModelBatch, timeline: StepTimeline) -> SampledTokens:
        requests = batch.requests
        bucket = self._graph_bucket(batch)
        prefill_bucket = None if bucket is not None else self._prefill_bucket(batch)
        if not requests and bucket is None and prefill_bucket is None:
            self._idle_forward(batch.ep_tokens)
            return SampledTokens([])
        if prefill_bucket is not None:  # one new prompt (or none: padding), from a graph
            hidden = self.prefill_graphs.run(requests, prefill_bucket)  # [n, H]
            timeline.inputs_ready = timeline.received  # the replay copies its own inputs
            timeline.mark("queued")
            last_rows = [hidden.shape[0] - 1] if requests and requests[0].samples else []
        else:
            hidden, last_rows = self._forward_batch(requests, bucket, batch.ep_tokens, timeline)
        prompt_logprobs = self._prompt_logprobs(hidden, requests) if bucket is None else None
        if not last_rows:
            return SampledTokens([], prompt_logprobs=prompt_logprobs)
        sampling = [r for r in requests if r.samples]
        # On a GPU the forward is still running: the host fills the grammar masks meanwhile.
        masks = self.grammars.masks(sampling) if GrammarMatchers.needed(sampling) else None
        # Every row samples in a pure decode: no index tensor to build and copy to the device.
        last = hidden if len(last_rows) == hidden.shape[0] else hidden[last_rows]
        logits = self.model.compute_logits(last)  # [B, V] float32
        wanted = [r.params.logprobs for r in sampling]
        raw = log_probabilities(logits, wanted)  # before penalties and masks change the logits
        tokens, failed = self._sample(logits, sampling, masks)
        errors = {sampling[row].request_id: why for row, why in failed.items()} or None
        if raw is None:
            return SampledTokens(tokens, prompt_logprobs=prompt_logprobs, errors=errors)
        logprobs = gather_logprobs(*raw, [max(t, 0) for t in tokens], wanted)  # NO_TOKEN: any id
        return SampledTokens(
            tokens, [None if lp is None else SampledLogprobs(*lp) for lp in logprobs],
            prompt_logprobs, errors,
        )  # fmt: skip

    def _prompt_logprobs(
        self, hidden: torch.Tensor, requests: list[ScheduledRequest], rows_at_once: int = 256
    ) -> dict[str, tuple[int, list[SampledLogprobs]]] | None:
        """Log-probabilities of the prompt tokens that this step's prefill rows predict, for the
        requests that asked (hidden [T, H] in batch order). Logits are made `rows_at_once` rows
        at a time: a whole chunk's [T, V] float32 would be gigabytes at large vocabularies."""
        if not any(r.prompt_logprob_targets for r in requests):
            return None
        found, first_row = {}, 0
        for request in requests:
            targets = request.prompt_logprob_targets
            if targets:
                k = request.params.prompt_logprobs
                entries = []
                for start in range(0, len(targets), rows_at_once):
                    part = targets[start : start + rows_at_once]
                    rows = hidden[first_row + start : first_row + start + len(part)]
                    log_probs = torch.log_softmax(self.model.compute_logits(rows).float(), -1)
                    picked = gather_logprobs(log_probs, list(range(len(part))), part,
                                             [k] * len(part))  # fmt: skip
                    entries += [SampledLogprobs(*entry) for entry in picked]
                found[request.request_id] = (request.start_position, entries)
            first_row += len(request.token_ids)
        return found

    def _sample(
        self, logits: torch.Tensor, sampling: list[ScheduledRequest], masks: GrammarMasks | None
    ) -> SampledRows:
        """[B, V] logits (penalized and masked in place) -> the next token of each sampling
        request. A request whose generator cannot be made (its seed), whose grammar cannot be
        used or whose row cannot be sampled fails alone (`errors`, by row); the others sample as
        they would without it."""
        if masks is not None:
            apply_token_bitmask(logits, masks.bitmask, masks.rows)
        if any(r.params.logit_bias for r in sampling):
            apply_logit_bias(logits, [r.params.logit_bias for r in sampling])
        if any(r.output_token_ids for r in sampling):
            apply_penalties(
                logits,
                [r.output_token_ids for r in sampling],
                [r.params.presence_penalty for r in sampling],
                [r.params.frequency_penalty for r in sampling],
            )
        generators, setup_errors = [], {}
        for row, request in enumerate(sampling):
            try:
                generators.append(self._generator(request.request_id, request.params))
            except (RuntimeError, ValueError, OverflowError) as error:  # torch refused the seed
                generators.append(None)
                setup_errors[row] = f"seed={request.params.seed!r}: {error}"
        temperatures = [0 if row in setup_errors else r.params.temperature
                        for row, r in enumerate(sampling)]  # fmt: skip
        rows = sample_tokens(
            logits,
            temperatures,
            [r.params.top_k for r in sampling],
            [r.params.top_p for r in sampling],
            generators,
        )
        if masks is not None:
            setup_errors.update(masks.errors)
        for row in setup_errors:
            rows.token_ids[row] = NO_TOKEN
        errors = {**rows.errors, **setup_errors}
        if masks is not None:
            errors.update(self.grammars.accept(sampling, masks, rows.token_ids))
        return SampledRows(rows.token_ids, errors)

    def _graph_bucket(self, batch: ModelBatch) -> int | None:
        """The decode graph bucket this step replays, or None to run eagerly. Ranks that talk
        must run the same graph, so with collectives the group's driver decides it for all."""
        if self.decode_graphs is None:
            return None
        if self.parallel.has_collectives:
            return batch.decode_bucket
        return self.decode_graphs.bucket_of(batch.requests)

    def _prefill_bucket(self, batch: ModelBatch) -> int | None:
        """The prefill graph bucket this step replays, or None; chosen like `_graph_bucket`."""
        if self.prefill_graphs is None:
            return None
        if self.parallel.has_collectives:
            return batch.prefill_bucket
        return self.prefill_graphs.bucket_of(batch.requests)

    def _forward_batch(
        self,
        requests: list[ScheduledRequest],
        bucket: int | None,
        ep_tokens: list[int] | None,
        timeline: StepTimeline,
    ) -> tuple[torch.Tensor, list[int]]:
        """Hidden states [T, H] of the step's tokens and the row of each sampling request's last
        token; a pure decode with a `bucket` replays that CUDA graph. ep_tokens: every EP rank's
        token count, when known. timeline: the step's, marked as its inputs and forward queue."""
        if bucket is not None:
            hidden = self.decode_graphs.run(requests, bucket)  # [B, H]: one row per request
            timeline.inputs_ready = timeline.received  # the replay copies its own inputs
            timeline.mark("queued")
            return hidden, [row for row, r in enumerate(requests) if r.samples]
        query_lens = [len(r.token_ids) for r in requests]
        seq_lens = [r.seq_len for r in requests]
        positions = token_positions(query_lens, seq_lens)  # [T] int64, numpy
        metadata = build_attention_metadata(
            query_lens,
            seq_lens,
            [r.block_table for r in requests],
            self.cache_config.block_size,
            self.device,
            positions,
        )
        ctx = ForwardContext(attn=metadata, kv_caches=self.kv_caches)
        tokens = chain.from_iterable(r.token_ids for r in requests)
        input_ids = np.fromiter(tokens, dtype=np.int64, count=positions.shape[0])
        input_ids = device_ints(torch.from_numpy(input_ids), torch.int64, self.device)
        positions = device_ints(torch.from_numpy(positions), torch.int64, self.device)
        timeline.mark("inputs_ready")
        hidden = self._forward(input_ids, positions, ctx, ep_tokens)  # [T, H]
        timeline.mark("queued")
        ends = accumulate(len(r.token_ids) for r in requests)  # on the host: no device sync
        return hidden, [end - 1 for r, end in zip(requests, ends) if r.samples]

    def _idle_forward(self, ep_tokens: list[int] | None = None) -> None:
        """A rank with no requests this step still joins its peers' collectives (DP replicas
        whose experts exchange tokens), with one placeholder token that writes no cache."""
        if not self.parallel.has_collectives:
            return
        empty = build_attention_metadata([], [], [], self.cache_config.block_size, self.device)
        input_ids, positions, ctx = idle_forward_inputs(
            ForwardContext(empty, self.kv_caches), self.device
        )
        self._forward(input_ids, positions, ctx, ep_tokens)

    def _forward(self, input_ids, positions, ctx, ep_tokens=None) -> torch.Tensor:
        if self.parallel.experts_exchange_tokens:
            # Every rank's token count, known before any work is queued (sent with the step, or
            # gathered once here), so that no MoE layer waits for the device to size its exchange.
            group = self.parallel.ep_group
            with group.tokens_of_step(input_ids.shape[0], self.device, known=ep_tokens):
                return self._run_model(input_ids, positions, ctx)
        return self._run_model(input_ids, positions, ctx)

    def _graph_forward(self, input_ids, positions, ctx) -> torch.Tensor:
        """The forward a graph captures (and runs on the CPU): with a token exchange,
        every rank holds the bucket's tokens and the exchange takes replayable options."""
        if not self.parallel.experts_exchange_tokens:
            return self.model(input_ids, positions, ctx)
        with self.parallel.ep_group.static_exchange(input_ids.shape[0]):
            if self._overlaps_in_graph(input_ids.shape[0], ctx):
                return forward_two_batch_overlap(
                    self.model, input_ids, positions, ctx, self.overlap
                )
            return self.model(input_ids, positions, ctx)

    def _overlaps_in_graph(self, num_tokens: int, ctx: ForwardContext) -> bool:
        """A captured prefill runs as two micro-batches where its inputs hold the halves."""
        has_halves = ctx.micro_batches is not None
        return self.two_batch_overlap and has_halves and self.overlap.overlaps_in_graph(num_tokens)

    def _run_model(self, input_ids, positions, ctx) -> torch.Tensor:
        if self.two_batch_overlap:
            ep_group = self.parallel.ep_group
            tokens = getattr(ep_group, "tokens_per_rank", None) or [input_ids.shape[0]]
            if worth_overlapping(tokens, self.device):
                return forward_two_batch_overlap(
                    self.model, input_ids, positions, ctx, self.overlap
                )
        return self.model(input_ids, positions, ctx)

    def _generator(self, request_id: str, params) -> torch.Generator | None:
        if params.is_greedy:
            return None
        if request_id not in self.generators:
            generator = torch.Generator()
            if params.seed is None:
                generator.seed()
            else:
                generator.manual_seed(params.seed)
            self.generators[request_id] = generator
        return self.generators[request_id]

    @property
    def kv_bytes_per_token(self) -> int:
        """Every layer's cache row of one token on this rank."""
        return self.model_config.num_layers * math.prod(self.kv_shape) * self.dtype.itemsize

    @property
    def kv_copier(self) -> KVCopier:
        """The hand-off's chunked copies over this cache (made at first use)."""
        if self._kv_copier is None:
            self._kv_copier = KVCopier(self.kv_caches)
        return self._kv_copier

    def export_kv_chunks(
        self, request_id: str, block_table: list[int], num_tokens: int
    ) -> tuple[KVPayload, Iterator[np.ndarray]]:
        """A request's first num_tokens tokens of KV: the payload without its chunks, and the
        chunks as they are copied out (each valid until the next is taken; kv_copy.py)."""
        slots = token_slots(block_table, num_tokens, self.cache_config.block_size)
        generator = self.generators.get(request_id)
        header = KVPayload(
            chunks=[],
            num_layers=len(self.kv_caches),
            shape=(num_tokens, *self.kv_caches[0].shape[2:]),
            dtype=self.kv_caches[0].dtype,
            generator_state=generator.get_state() if generator is not None else None,
            kv_heads=self.kv_heads,
        )
        return header, self.kv_copier.export(slots, header.timings)

    def export_kv(self, request_id: str, block_table: list[int], num_tokens: int) -> KVPayload:
        """The KV as an in-memory payload (the chunks copied out of the reused buffers)."""
        header, chunks = self.export_kv_chunks(request_id, block_table, num_tokens)
        return header.with_chunks([chunk.copy() for chunk in chunks])

    def import_kv(
        self, request_id: str, block_table: list[int], payload: KVPayload | list[KVPayload]
    ) -> None:
        """Write a hand-off into these blocks; a list holds the shards of every prefill rank,
        from which this rank takes its own K/V heads (any prefill plan to any decode plan)."""
        payloads = payload if isinstance(payload, list) else [payload]
        mine = payload_for_heads(payloads, self.kv_heads)
        slots = token_slots(block_table, mine.num_tokens, self.cache_config.block_size)
        check_layout(self.kv_caches, mine.num_layers, mine.shape[1:])
        if mine.dtype == self.kv_caches[0].dtype:
            self.kv_copier.import_(slots, mine.chunks)
        else:  # another dtype (a float32 prefill into a bfloat16 decode): convert on the way
            unpack_kv(self.kv_caches, slots, mine.kv)
        if mine.generator_state is not None:
            generator = torch.Generator()
            generator.set_state(mine.generator_state)
            self.generators[request_id] = generator

    def free_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.generators.pop(request_id, None)
        self.grammars.free(request_ids)
