"""The offline API: `LLM(model).generate(prompts, params)`, plus the prefill/decode split."""

from __future__ import annotations

import itertools

import torch

from rayinfer.config import (
    CacheConfig,
    ConfigError,
    KVMemoryConfig,
    ModelConfig,
    ParallelPlan,
    SchedulerConfig,
    check_all_to_all,
    check_gpu_memory_utilization,
)
from rayinfer.engine.engine import LLMEngine
from rayinfer.engine.kv_handoff import KVHandoff
from rayinfer.engine.model_source import resolve_device, resolve_dtype, resolve_model_path
from rayinfer.engine.outputs import RequestFailedError, RequestOutput
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.graph_config import DEFAULT_MAX_PREFILL_GRAPH_TOKENS, cuda_graph_config
from rayinfer.models.dummy import LOAD_FORMATS
from rayinfer.models.fp8 import check_fp8_weights
from rayinfer.models.loader import check_has_fp8_weights, checkpoint_files


class LLM:
    """Runs a model in this process.

    model: "tiny" (the built-in DeepSeek-V3-style model) or a Hugging Face checkpoint folder.
    device: "auto" (CUDA when visible, else CPU), "cpu" or "cuda". dtype: None picks float32 on
    the CPU and bfloat16 on GPUs. parallel: how several workers (one Ray actor per GPU) split the
    model; two_batch_overlap: overlap the MoE all-to-all of one micro-batch with the other's
    compute (for plans whose experts exchange tokens; None, the default, turns it on there on
    GPUs, for steps of at least 12288 tokens on some rank: measured faster from there).
    load_format "dummy" draws random weights instead of reading safetensors (a folder with
    config.json is enough; for benchmarks).
    all_to_all: options of the MoE exchange between workers, e.g. {"transport": "host"} (copy
    through pinned host memory, for GPUs without peer-to-peer), {"use_fp8": True}, or
    {"dedup": True/False} (each token only to the ranks of its experts, or every token to every
    expert-parallel rank with no device sync; default: all tokens where nearly all need every
    rank anyway, see rayinfer.comm.moe), {"local_first": True/False} (with all tokens, a rank's
    experts run on its own tokens beside the exchange, which skips the rank itself; default: for
    calls of >= 16384 tokens on every rank, 4096 inside a prefill graph, see rayinfer.layers.moe).
    cuda_graphs: replay pure-decode steps of up to min(max_num_seqs, max_graph_batch_size)
    sequences from CUDA graphs captured at start (None: on for CUDA runs whose forward can be
    captured; with several workers their collectives are captured (NCCL kernels, or the
    host-staged exchange's replayable copies) and every data-parallel replica pads its decodes
    to the bucket of the largest, which rules out the deduplicated token exchange, see
    graph_config.graph_blocker; the capture time is
    `LLM.graph_capture_seconds`). With them, a step whose every replica prefills one new prompt
    of up to min(max_graph_prefill_tokens, max_num_batched_tokens) tokens runs from a graph too,
    padded to a token bucket (0 turns prefill graphs off; see workers/runner/prefill_graphs.py).
    num_kv_blocks: KV cache blocks of block_size tokens (per data-parallel replica); None sizes
    the cache for max(4 x max_model_len, 16384) tokens, or, with gpu_memory_utilization (a
    fraction in (0, 1], CUDA only), fills that share of each GPU's memory left after the weights,
    a profiling step of max_num_batched_tokens tokens and a reserve (workers/runner/kv_memory.py).
    fp8_weights: keep a DeepSeek V2/V3 checkpoint's FP8 block-scaled weights in FP8 and multiply
    them in FP8 with activations quantized per token (W8A8); False (the default) dequantizes them
    to `dtype` at load. True fails (ConfigError) for a checkpoint without FP8 weights or a tensor-
    parallel split that cuts a 128x128 block. Not verified end to end on a GPU (docs/models.md).
    index_cache_dtype: how DeepSeek Sparse Attention models (DeepSeek-V3.2, GLM-5) cache their
    indexer keys: "auto" (the default) in `dtype`, "fp8_e4m3" as FP8 with one float32 scale per
    token (DeepSeek's production format; GLM-5's bf16 row 642 wide instead of 704, see
    kernels/dsa/dsa_index_fp8.py); a ConfigError for other values or models.
    """

    def __init__(
        self,
        model: str = "tiny",
        *,
        device: str = "auto",
        dtype: str | torch.dtype | None = None,
        tokenizer: str | None = None,
        max_model_len: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        gpu_memory_utilization: float | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        parallel: ParallelPlan | None = None,
        two_batch_overlap: bool | None = None,
        load_format: str = "safetensors",
        all_to_all: dict | None = None,
        cuda_graphs: bool | None = None,
        max_graph_batch_size: int = 256,
        max_graph_prefill_tokens: int = DEFAULT_MAX_PREFILL_GRAPH_TOKENS,
        fp8_weights: bool = False,
        index_cache_dtype: str = "auto",
    ):
        path = resolve_model_path(model)
        model_config = ModelConfig.from_pretrained(path)
        self.model_config = model_config.with_index_cache_dtype(index_cache_dtype)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        max_model_len = max_model_len or min(self.model_config.max_position_embeddings, 8192)
        check_gpu_memory_utilization(gpu_memory_utilization)
        given_blocks = num_kv_blocks is not None
        if num_kv_blocks is None:
            num_kv_blocks = -(-max(4 * max_model_len, 16384) // block_size)
        self.cache_config = CacheConfig(block_size, num_kv_blocks, enable_prefix_caching)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs, max(max_num_batched_tokens, 1), max_model_len
        )
        self.kv_memory = None  # given num_kv_blocks wins; off CUDA the runner ignores it
        if gpu_memory_utilization is not None and not given_blocks:
            self.kv_memory = KVMemoryConfig(
                gpu_memory_utilization,
                self.scheduler_config.max_num_batched_tokens,
                max_model_len,
                max_num_seqs,
            )
        self.tokenizer = _load_tokenizer(tokenizer or path)
        parallel = parallel or ParallelPlan()
        parallel.check_fits(self.model_config)
        if fp8_weights not in (True, False):
            raise ConfigError(f"fp8_weights={fp8_weights!r}; use True or False")
        if fp8_weights:
            check_fp8_weights(self.model_config, parallel.tp)
            if load_format != "dummy":
                check_has_fp8_weights(checkpoint_files(path), path)
        self.fp8_weights = fp8_weights
        self.two_batch_overlap = two_batch_overlap
        if load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format={load_format!r}; use one of {', '.join(LOAD_FORMATS)}")
        self.load_format = load_format
        self.all_to_all = check_all_to_all(all_to_all)
        self.cuda_graphs = cuda_graph_config(
            cuda_graphs,
            is_cuda=self.device.type == "cuda",
            plan=parallel,
            max_num_seqs=max_num_seqs,
            max_graph_batch_size=max_graph_batch_size,
            max_model_len=max_model_len,
            all_to_all=self.all_to_all,
            max_prefill_tokens=min(
                max_graph_prefill_tokens, self.scheduler_config.max_num_batched_tokens
            ),
            model=self.model_config,
        )
        executor = self._make_executor(parallel)
        self.engine = LLMEngine(
            self.model_config, self.cache_config, self.scheduler_config, executor, self.tokenizer
        )
        self.cache_config = self.engine.cache_config  # the block count the executor allocated
        self._request_ids = itertools.count()

    def _make_executor(self, plan: ParallelPlan):
        """One device in-process; several workers (one Ray actor per GPU) for a larger plan."""
        if plan.num_workers == 1:
            from rayinfer.workers.in_process import InProcessExecutor

            return InProcessExecutor(
                self.model_config,
                self.cache_config,
                self.device,
                self.dtype,
                self.two_batch_overlap,
                self.load_format,
                self.cuda_graphs,
                self.kv_memory,
                self.fp8_weights,
            )
        import ray

        from rayinfer.workers.group import WorkerGroup
        from rayinfer.workers.worker import WorkerSpec

        if not ray.is_initialized():
            ray.init()
        use_gpus = self.device.type == "cuda"
        spec = WorkerSpec(
            self.model_config,
            self.cache_config,
            device=self.device.type,
            dtype=self.dtype,
            num_threads=0 if use_gpus else 1,
            plan=plan,
            two_batch_overlap=self.two_batch_overlap,
            load_format=self.load_format,
            all_to_all=self.all_to_all,
            cuda_graphs=self.cuda_graphs,
            kv_memory=self.kv_memory,
            fp8_weights=self.fp8_weights,
        )
        prefix = f"rayinfer-llm-{id(self):x}"
        return WorkerGroup(prefix, spec, use_gpus=use_gpus, cpus_per_worker=0.25)

    @property
    def graph_capture_seconds(self) -> float | None:
        """Warm-up and capture of the graphs at start (a worker's); None without graphs."""
        return self.engine.executor.graph_capture_seconds

    def start_profile(self, path: str) -> None:
        """Profile the engine steps from now on with torch.profiler (every worker of a
        multi-worker plan); `stop_profile` writes `<path>[-rank<r>].txt` (operators by device
        time) and `.json` (a Chrome trace), and returns the tables' paths."""
        self.engine.executor.start_profile(path)

    def stop_profile(self) -> list[str]:
        return self.engine.executor.stop_profile()

    def shutdown(self) -> None:
        """Stop the workers (a multi-worker plan's Ray actors)."""
        self.engine.executor.shutdown()

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); outputs in prompt order."""
        prompts, params_list = _broadcast(prompts, params)
        request_ids = self._add_all(prompts, params_list, prefill_only=False)
        finished = self._run_until_done(request_ids)
        return [finished[r] for r in request_ids]

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"} messages) or several, through
        the checkpoint's chat template."""
        if self.tokenizer is None:
            raise ConfigError("this model has no tokenizer.json, so no chat template; use generate")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.encode_chat(messages) for messages in conversations]
        return self.generate(prompts, params)

    def prefill(self, prompts, params=None) -> list[KVHandoff]:
        """Prefill every prompt; each result carries the first token and the request's KV."""
        prompts, params_list = _broadcast(prompts, params)
        request_ids = self._add_all(prompts, params_list, prefill_only=True)
        finished = self._run_until_done(request_ids)
        failed = next((o for o in finished.values() if o.finish_reason == "error"), None)
        if failed is not None:  # no hand-offs at all, rather than a list with holes
            for request_id in request_ids:
                self.engine.abort(request_id)
            raise RequestFailedError(failed.request_id, failed.error)
        handoffs = []
        for request_id in request_ids:
            output = finished[request_id]
            if output.finish_reason == "prefilled":
                handoffs.append(self.engine.take_handoff(request_id))
            else:
                handoffs.append(
                    KVHandoff(
                        request_id,
                        output.prompt_token_ids,
                        output.token_ids[0],
                        payload=None,
                        finish_reason=output.finish_reason,
                    )
                )
        return handoffs

    def decode(self, handoffs: list[KVHandoff], params=None) -> list[RequestOutput]:
        """Continue prefilled requests (from this or another LLM) to their end."""
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(handoffs)
        )
        request_ids = []
        for handoff, request_params in zip(handoffs, params_list):
            if handoff.finish_reason is None:
                self.engine.add_prefilled_request(handoff, request_params)
            request_ids.append(handoff.request_id)
        finished = self._run_until_done([h.request_id for h in handoffs if h.finish_reason is None])
        return [finished.get(h.request_id) or _finished_output(h) for h in handoffs]

    def _add_all(self, prompts, params_list, prefill_only: bool) -> list[str]:
        request_ids = []
        for prompt, request_params in zip(prompts, params_list):
            request_id = f"llm-{next(self._request_ids)}"
            self.engine.add_request(request_id, prompt, request_params, prefill_only)
            request_ids.append(request_id)
        return request_ids

    def _run_until_done(self, request_ids: list[str]) -> dict[str, RequestOutput]:
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        while wanted - finished.keys():
            for output in self.engine.step():
                if output.finished and output.request_id in wanted:
                    finished[output.request_id] = output
        return finished


def _broadcast(prompts, params):
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if isinstance(params, list):
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        return list(prompts), params
    return list(prompts), [params or SamplingParams()] * len(prompts)


def _finished_output(handoff: KVHandoff) -> RequestOutput:
    return RequestOutput(
        handoff.request_id,
        handoff.prompt_token_ids,
        token_ids=[handoff.first_token_id],
        finish_reason=handoff.finish_reason,
    )


def _load_tokenizer(path):
    from rayinfer.engine.tokenizer import Tokenizer

    try:
        return Tokenizer.from_pretrained(path)
    except FileNotFoundError:
        return None
