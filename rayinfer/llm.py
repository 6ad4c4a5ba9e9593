"""The offline API: `LLM(model).generate(prompts, params)`, plus the prefill/decode split."""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from rayinfer.config import ConfigError, ParallelPlan
from rayinfer.engine.chat_prompt import ChatOptions, encode_conversation
from rayinfer.engine.kv_handoff import KVHandoff
from rayinfer.engine.model_source import resolve_device, resolve_dtype
from rayinfer.engine.outputs import RequestFailedError, RequestOutput
from rayinfer.engine.sampling_params import SamplingParams
from rayinfer.engine_args import EngineArgs, as_config, local_executor
from rayinfer.engine_config import KVHandoffConfig
from rayinfer.exchange_config import AllToAllConfig
from rayinfer.graph_config import (
    DEFAULT_MAX_PIECEWISE_GRAPH_TOKENS,
    DEFAULT_MAX_PREFILL_GRAPH_TOKENS,
)
from rayinfer.kernels.backends import KernelBackends
from rayinfer.overlap_config import OverlapConfig
from rayinfer.process_config import ProcessConfig


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
    all_to_all: the MoE exchange between workers, an AllToAllConfig or a mapping of its fields,
    e.g. {"transport": "host"} (copy through pinned host memory, for GPUs without peer-to-peer),
    {"use_fp8": True}, {"dedup": True/False}, {"local_first": True/False}, {"host": {"protocol":
    "cpu"}} (rayinfer/exchange_config.py). overlap (OverlapConfig), kernels (KernelBackends) and
    process (ProcessConfig) likewise; docs/configuration.md lists every field.
    waiting_served_ratio, max_waiting_steps: while sequences decode, hold new prompts back until
    they number waiting_served_ratio x the decodes or the oldest has waited max_waiting_steps
    steps (engine_config.SchedulerConfig; 0, the default, admits them at once).
    kv_handoff: how `prefill`'s KV leaves a multi-worker plan's workers (KVHandoffConfig, or a
    mapping: {"path": "object_store"}; the default "auto" copies it into each worker's
    shared-memory arena, which an importer on the same Ray node maps).
    cuda_graphs: replay pure-decode steps of up to min(max_num_seqs, max_graph_batch_size)
    sequences from CUDA graphs captured at start (None: on for CUDA runs whose forward can be
    captured; with several workers their collectives are captured (NCCL kernels, or the
    host-staged exchange's replayable copies) and every data-parallel replica pads its decodes
    to the bucket of the largest, which rules out the deduplicated token exchange, see
    graph_config.graph_blocker; the capture time is
    `LLM.graph_capture_seconds`). With them, a step whose every replica prefills one new prompt
    of up to min(max_graph_prefill_tokens, max_num_batched_tokens) tokens runs from a graph too,
    padded to a token bucket (0 turns prefill graphs off; see workers/runner/prefill_graphs.py).
    On one GPU per replica, any other step of up to min(max_graph_piecewise_tokens,
    max_num_batched_tokens) tokens (decodes beside prompt chunks, several prompts) replays from
    graphs cut at each layer's attention, which runs eagerly between them (0: off; DSA and V4
    models: off; see workers/runner/piecewise_graphs.py).
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
        waiting_served_ratio: float = 0.0,
        max_waiting_steps: int = 20,
        enable_prefix_caching: bool = True,
        parallel: ParallelPlan | None = None,
        two_batch_overlap: bool | None = None,
        load_format: str = "safetensors",
        all_to_all: AllToAllConfig | dict | None = None,
        cuda_graphs: bool | None = None,
        max_graph_batch_size: int = 256,
        max_graph_prefill_tokens: int = DEFAULT_MAX_PREFILL_GRAPH_TOKENS,
        max_graph_piecewise_tokens: int = DEFAULT_MAX_PIECEWISE_GRAPH_TOKENS,
        fp8_weights: bool = False,
        index_cache_dtype: str = "auto",
        overlap: OverlapConfig | dict | None = None,
        kernels: KernelBackends | dict | None = None,
        process: ProcessConfig | dict | None = None,
        kv_handoff: KVHandoffConfig | dict | None = None,
    ):
        self.args = EngineArgs(
            model=model,
            device=device,
            dtype=dtype,
            load_format=load_format,
            fp8_weights=fp8_weights,
            index_cache_dtype=index_cache_dtype,
            max_model_len=max_model_len,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            waiting_served_ratio=waiting_served_ratio,
            max_waiting_steps=max_waiting_steps,
            parallel=parallel or ParallelPlan(),
            two_batch_overlap=two_batch_overlap,
            cuda_graphs=cuda_graphs,
            max_graph_batch_size=max_graph_batch_size,
            max_graph_prefill_tokens=max_graph_prefill_tokens,
            max_graph_piecewise_tokens=max_graph_piecewise_tokens,
            all_to_all=as_config(AllToAllConfig, all_to_all, "all_to_all"),
            overlap=as_config(OverlapConfig, overlap, "overlap"),
            kernels=as_config(KernelBackends, kernels, "kernels"),
            process=as_config(ProcessConfig, process, "process"),
            kv_handoff=as_config(KVHandoffConfig, kv_handoff, "kv_handoff"),
        )
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        use_gpus = self.device.type == "cuda"
        spec = self.args.worker_spec(self.device.type, num_threads=0 if use_gpus else 1)
        spec = replace(spec, dtype=self.dtype)
        self.spec = spec  # what its workers run, as the args made it
        self.model_config = spec.model_config
        self.tokenizer = _load_tokenizer(tokenizer or self.args.model_path)
        prefix = f"rayinfer-llm-{id(self):x}"
        self.engine = self.args.build(spec, lambda s: local_executor(s, prefix), self.tokenizer)
        self.cache_config = self.engine.cache_config  # the block count the executor allocated
        self._request_ids = itertools.count()

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
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role", "content"} messages) or several, through
        the checkpoint's chat template, as the server renders a chat request's messages (tool
        calls' arguments reach the template as objects).

        As vLLM's `LLM.chat`: add_generation_prompt ends the prompt with the header of a new
        assistant turn; continue_final_message (with add_generation_prompt=False) ends it inside
        the last message, an assistant's, for the model to continue; chat_template_kwargs are
        more template variables, e.g. {"enable_thinking": False} for Qwen3's template
        (engine/chat_prompt.py lists the keys refused). A bad value raises InvalidRequestError
        naming it."""
        if self.tokenizer is None:
            raise ConfigError("this model has no tokenizer.json, so no chat template; use generate")
        options = ChatOptions.checked(
            add_generation_prompt, continue_final_message, chat_template_kwargs
        )
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [
            encode_conversation(self.tokenizer, messages, options=options)
            for messages in conversations
        ]
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
                        stop_reason=output.stop_reason,
                        finished_output=output,
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
    """The output of a request that finished at its first token: the prefill's where the
    hand-off carries it, else what the hand-off says of it."""
    if handoff.finished_output is not None:
        return handoff.finished_output
    return RequestOutput(
        handoff.request_id,
        handoff.prompt_token_ids,
        token_ids=[handoff.first_token_id],
        finish_reason=handoff.finish_reason,
        stop_reason=handoff.stop_reason,
    )


def _load_tokenizer(path):
    from rayinfer.engine.tokenizer import Tokenizer

    try:
        return Tokenizer.from_pretrained(path)
    except FileNotFoundError:
        return None
