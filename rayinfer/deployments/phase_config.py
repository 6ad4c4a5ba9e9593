"""One phase's section of the Serve app's config (`prefill.*`, `decode.*`, `engine.*`): its
workers, batching, graphs and autoscaling, and the typed configs its workers take as they are;
and the ingress's section."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from rayinfer.config import ConfigError, ParallelPlan
from rayinfer.deployments.config_args import Resources, Strict, parse_bool_or_auto
from rayinfer.engine_config import check_gpu_memory_utilization
from rayinfer.exchange_config import AllToAllConfig
from rayinfer.kernels.backends import KernelBackends
from rayinfer.overlap_config import OverlapConfig
from rayinfer.process_config import ProcessConfig


class AutoscalingConfig(Strict):
    """Serve's `autoscaling_config` for one deployment; on one machine the default is 1 replica."""

    min_replicas: int = Field(1, ge=0, description="fewest replicas kept running")
    max_replicas: int = Field(1, ge=1, description="most replicas (each holds its own workers)")
    initial_replicas: int | None = Field(None, ge=0, description="replicas at start (default min)")
    target_ongoing_requests: float = Field(
        16, gt=0, description="requests per replica the autoscaler aims for"
    )
    upscale_delay_s: float = Field(30.0, ge=0, description="load must last this long to scale up")
    downscale_delay_s: float = Field(300.0, ge=0, description="idle this long to scale down")
    look_back_period_s: float = Field(30.0, gt=0, description="window the load is averaged over")
    metrics_interval_s: float = Field(10.0, gt=0, description="how often replicas report load")

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas={self.min_replicas} exceeds max_replicas={self.max_replicas}"
            )
        initial = self.initial_replicas
        if initial is not None and not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(
                f"initial_replicas={initial} must lie in [min_replicas, max_replicas] = "
                f"[{self.min_replicas}, {self.max_replicas}]"
            )
        return self

    def to_serve(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class PhaseConfig(Strict):
    """One phase (prefill, decode, or the colocated engine that does both): its workers per
    replica, batching limits and autoscaling."""

    tp: int = Field(1, ge=1, description="tensor-parallel workers per replica")
    dp: int = Field(1, ge=1, description="data-parallel attention workers per replica")
    ep: int = Field(1, ge=1, description="expert-parallel degree (divides tp*dp)")
    two_batch_overlap: bool | None = Field(
        None,
        description="overlap one micro-batch's MoE all-to-all with the other's compute "
        "(default: on for GPU plans whose experts exchange tokens, steps of >= 12288 tokens)",
    )
    gpus_per_worker: float | None = Field(
        None,
        gt=0,
        le=1,
        description="GPU share of each worker (default 1; shared automatically when the machine "
        "has fewer GPUs than both phases' minimum replicas need)",
    )
    max_ongoing_requests: int = Field(64, ge=1, description="requests one replica accepts at once")
    max_queued_requests: int = Field(
        512, ge=1, description="requests waiting for a replica before the ingress answers 503"
    )
    max_num_seqs: int = Field(64, ge=1, description="sequences batched in one engine step")
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget of one step")
    waiting_served_ratio: float = Field(
        0.0,
        ge=0,
        description="while sequences decode, hold new prompts back until they number this many "
        "times the decodes (or the oldest waited max_waiting_steps steps), so that they share "
        "their mixed steps and decode is interrupted less often; 0: admit at once",
    )
    max_waiting_steps: int = Field(
        20, ge=1, description="steps a prompt held back by waiting_served_ratio waits at most"
    )
    num_kv_blocks: int | None = Field(None, ge=1, description="KV cache blocks per replica")
    gpu_memory_utilization: float | None = Field(
        None,
        description="on GPUs, size the KV cache to fill this fraction in (0, 1] of each "
        "worker's GPU memory (after a profiling step; default 0.9): of the whole GPU, or of its "
        "gpus_per_worker share when workers share one. num_kv_blocks wins when set; on the CPU "
        "the cache holds max(4 x max_model_len, 16384) tokens",
    )
    cpus_per_worker: float = Field(
        0.5, gt=0, description="CPUs a worker reserves on a machine without GPUs"
    )
    cuda_graphs: bool | Literal["auto"] = Field(
        "auto",
        description="replay steps from CUDA graphs captured at start: true, false or auto (on "
        "GPUs where the forward can be captured: not with all_to_all.dedup=true when experts "
        "exchange tokens). The decode phase replays its decode steps; the prefill phase its "
        "steps of one new prompt per replica (see max_graph_prefill_tokens)",
    )
    max_graph_batch_size: int = Field(
        256, ge=1, description="largest decode batch captured (capped by max_num_seqs)"
    )
    max_graph_prefill_tokens: int | None = Field(
        None,
        ge=0,
        description="longest new prompt (tokens per replica) prefilled from a CUDA graph, capped "
        "by max_num_batched_tokens; 0: none; default: 8192 for the prefill and engine phases, 0 "
        "for decode",
    )
    max_graph_piecewise_tokens: int | None = Field(
        None,
        ge=0,
        description="largest other step (decodes beside prompt chunks, several prompts; tokens "
        "per replica) replayed from CUDA graphs cut at each attention, capped by "
        "max_num_batched_tokens, one GPU per replica; 0: none; default: 4096 for the prefill and "
        "engine phases, 0 for decode",
    )
    fp8_weights: bool | None = Field(
        None, description="this phase's fp8_weights (default: the top-level fp8_weights)"
    )
    resources: Resources = Field(
        default_factory=dict,
        description="custom Ray resources (name -> amount) each worker of a replica reserves "
        "beside its CPU/GPU, to pin the phase to the nodes offering them (`ray start "
        "--resources='{\"decode_box\": 8}'`; on the command line decode.resources.decode_box=1). "
        "A replica and its workers stay on one node (STRICT_PACK); build fails when no alive "
        "node holds a whole replica",
    )
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    all_to_all: AllToAllConfig = Field(
        default_factory=AllToAllConfig,
        description="the MoE token exchange when experts are split across data-parallel ranks "
        "(ep > 1 with dp > 1): schedule, transport, use_fp8, dedup, local_first and host.* "
        "(rayinfer/exchange_config.py)",
    )
    overlap: OverlapConfig = Field(
        default_factory=OverlapConfig,
        description="the two-batch overlap's split and the shared experts' place beside the "
        "exchange (rayinfer/overlap_config.py)",
    )
    kernels: KernelBackends = Field(
        default_factory=KernelBackends,
        description="which kernel serves ops with several (rayinfer/kernels/backends.py)",
    )
    process: ProcessConfig = Field(
        default_factory=ProcessConfig,
        description="NUMA binding, GC freeze and the profiler's host recording of each worker "
        "(rayinfer/process_config.py)",
    )

    @field_validator("cuda_graphs", mode="before")
    @classmethod
    def _parse_cuda_graphs(cls, value: Any) -> bool | str:
        return parse_bool_or_auto(value)

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _check_gpu_memory_utilization(cls, value: float | None) -> float | None:
        try:
            return check_gpu_memory_utilization(value)
        except ConfigError:
            raise ValueError(
                "must be a fraction in (0, 1]: the share of each GPU's total memory that weights, "
                "activations and the KV cache may use (e.g. 0.9)"
            ) from None

    @property
    def plan(self) -> ParallelPlan:
        return ParallelPlan(tp=self.tp, dp=self.dp, ep=self.ep)

    def uses_fp8_weights(self, app_default: bool) -> bool:
        """This phase's fp8_weights: its own when set, else the app's top-level one."""
        return app_default if self.fp8_weights is None else self.fp8_weights

    @property
    def num_workers(self) -> int:
        return self.tp * self.dp


class IngressConfig(Strict):
    num_replicas: int = Field(
        1,
        ge=1,
        description="ingress replicas behind Serve's proxy; with two or more, one's death "
        "leaves the others answering new requests while Serve replaces it (the streams it "
        "carried still end)",
    )
    max_ongoing_requests: int = Field(256, ge=1, description="requests one ingress replica serves")
    max_queued_requests: int = Field(
        1024, ge=1, description="requests waiting for a replica before HTTP answers 503"
    )
    max_queue_wait_s: float | None = Field(
        30.0,
        gt=0,
        description="longest a new request may be estimated to wait before the engines start "
        "it (first decode token); beyond it the ingress answers 503 with Retry-After "
        "(deployments/admission.py). Keep it below clients' timeouts; null: no bound",
    )
    max_replica_wait_s: float | None = Field(
        60.0,
        gt=0,
        description="longest a request waits for a Prefill, Decode or Engine replica to take "
        "it, while none runs (a replacement starting, or none can: its node died and no other "
        "offers its resources) or all are full; past it the ingress answers 503 (an error event "
        "once streaming). null: no bound (autoscaling from zero replicas waits for the first)",
    )
    resources: Resources = Field(
        default_factory=dict,
        description="custom Ray resources the ingress replica reserves, to pin it to the nodes "
        "offering them (ingress.resources.node:__internal_head__=0.01: the head node)",
    )
