"""The Serve application's configuration: what `serve run rayinfer.app:build key=value ...` takes.

Arguments arrive as dotted keys (`decode.autoscaling.max_replicas=2`, values as strings) from the
CLI, or as nested mappings with typed values from a Serve config YAML. `AppConfig.from_args`
accepts both; every unknown or invalid key fails with a message naming it and what is allowed.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from rayinfer.config import (
    ALL_TO_ALL_CHOICES,
    ConfigError,
    ParallelPlan,
    check_gpu_memory_utilization,
)
from rayinfer.graph_config import graph_blocker


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Resources Ray itself accounts for, which a phase's other fields already ask for.
RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
ResourceAmount = Annotated[float, Field(gt=0)]


def parse_resources(value: Any) -> Any:
    """A JSON object given as one string (`decode.resources='{"decode_box": 1}'`) as a mapping;
    anything else as given (dotted keys arrive as a mapping already)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(
                'use a JSON object such as {"decode_box": 1}, or one dotted key per resource '
                "(decode.resources.decode_box=1)"
            ) from None
    return value


def check_resource_names(resources: dict[str, float]) -> dict[str, float]:
    for name in resources:
        if not name or name in RAY_BUILTIN_RESOURCES:
            raise ValueError(
                f"{name!r} is not a custom resource; a worker's CPUs and GPUs are "
                "cpus_per_worker and gpus_per_worker"
            )
    return resources


# A phase's or the ingress's custom Ray resources: a mapping, or one JSON string of it
Resources = Annotated[
    dict[str, ResourceAmount],
    BeforeValidator(parse_resources),
    AfterValidator(check_resource_names),
]


def parse_bool_or_auto(value: Any) -> bool | str:
    """CLI strings and YAML values alike: true/false (1/0, on/off, yes/no) or auto."""
    if isinstance(value, bool) or value is None:
        return "auto" if value is None else value
    words = {"true": True, "1": True, "on": True, "yes": True, "false": False, "0": False,
             "off": False, "no": False, "auto": "auto"}  # fmt: skip
    parsed = words.get(str(value).strip().lower())
    if parsed is None:
        raise ValueError("use true, false or auto")
    return parsed


class AutoscalingConfig(_Strict):
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


class AllToAllConfig(_Strict):
    """How a phase's workers exchange MoE tokens when its experts are split across data-parallel
    ranks (`ep` > 1 with `dp` > 1); see rayinfer.comm."""

    transport: Literal[ALL_TO_ALL_CHOICES["transport"]] = Field(
        "auto",
        description="dist: NCCL (gloo on CPU); host: GPU -> pinned host memory -> GPU copies, for "
        "GPUs without peer-to-peer; auto: the cost model's pick",
    )
    schedule: Literal[ALL_TO_ALL_CHOICES["schedule"]] = "auto"
    use_fp8: bool = Field(
        False, description="send dispatched activations as FP8 e4m3 with one scale per token"
    )
    dedup: bool | None = Field(
        None,
        description="true: each token only to the ranks of its experts (one device sync per "
        "layer); false: every token to every rank (no sync); default: false where nearly every "
        "token needs every rank",
    )
    local_first: bool | None = Field(
        None,
        description="a rank's experts run on its own tokens beside the exchange, which then "
        "skips the rank itself (all-tokens exchange only); default: where every rank has >= "
        "16384 tokens in the call (4096 inside a prefill CUDA graph)",
    )

    def options(self) -> dict[str, Any]:
        """The options LLM(all_to_all=...) and the workers take."""
        return self.model_dump()


class PhaseConfig(_Strict):
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
    all_to_all: AllToAllConfig = Field(default_factory=AllToAllConfig)

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


class IngressConfig(_Strict):
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


def _default_decode() -> PhaseConfig:
    return PhaseConfig(max_ongoing_requests=128, max_num_seqs=128, max_num_batched_tokens=1024)


def _default_engine() -> PhaseConfig:
    """Decode's batch width with the offline engine's 8192-token prefill budget: a colocated
    replica runs mixed steps of both."""
    return PhaseConfig(max_ongoing_requests=128, max_num_seqs=128, max_num_batched_tokens=8192)


DISAGGREGATED_PHASES = ("prefill", "decode")
COLOCATED_PHASES = ("engine",)


def phases_of(disaggregate: bool | str) -> tuple[str, ...]:
    """The config sections a mode serves with ('auto': either pair, until resolved at build)."""
    if disaggregate == "auto":
        return DISAGGREGATED_PHASES + COLOCATED_PHASES
    return DISAGGREGATED_PHASES if disaggregate else COLOCATED_PHASES


class AppConfig(_Strict):
    """Everything `rayinfer.app.build` accepts."""

    model: str = Field("tiny", description="'tiny' or a Hugging Face checkpoint folder")
    tokenizer: str | None = Field(None, description="tokenizer folder (default: the model's)")
    served_model_name: str | None = Field(None, description="name clients pass as `model`")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    fp8_weights: bool = Field(
        False,
        description="keep a DeepSeek V2/V3 checkpoint's FP8 block-scaled weights in FP8 (W8A8 "
        "GEMMs and FP8 fused MoE) instead of dequantizing them to dtype at load; not yet "
        "verified end to end on a GPU",
    )
    index_cache_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto",
        description="DeepSeek Sparse Attention models only (DeepSeek-V3.2, GLM-5): their "
        "indexer keys cached in dtype ('auto') or as FP8 e4m3 with one float32 scale per token "
        "('fp8_e4m3', the production format: 132 bytes per token and layer instead of 256 in "
        "bf16); both phases share it, as the KV hand-off moves whole cache rows",
    )
    load_format: Literal["safetensors", "dummy"] = Field(
        "safetensors",
        description="dummy: random weights instead of the checkpoint's safetensors (a folder "
        "with config.json is enough; for benchmarks), as LLM(load_format=...)",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: int | None = Field(None, ge=2, description="longest prompt plus output")
    block_size: int = Field(16, ge=1, description="tokens per KV cache block")
    enable_prefix_caching: bool = True
    health_check_period_s: float = Field(
        2.0,
        gt=0,
        description="how often Serve probes each Prefill, Decode and Engine replica: a replica "
        "that lost a worker kills itself at once and is replaced at its next probe",
    )
    disaggregate: bool | Literal["auto"] = Field(
        "auto",
        description="true: Prefill and Decode deployments (the KV handed off between them); "
        "false: one Engine deployment whose replicas prefill and decode in mixed batches "
        "(the `engine` section); auto: colocated where prefill's and decode's workers at "
        "their minimum replicas need more GPUs than the cluster has (they would share GPUs), "
        "else disaggregated, and disaggregated on machines without GPUs",
    )
    prefill: PhaseConfig = Field(
        default_factory=PhaseConfig, description="the Prefill deployment (disaggregated)"
    )
    decode: PhaseConfig = Field(
        default_factory=_default_decode, description="the Decode deployment (disaggregated)"
    )
    engine: PhaseConfig = Field(
        default_factory=_default_engine,
        description="the colocated Engine deployment (disaggregate=false): one worker per GPU, "
        "prefill graphs as the prefill phase's, decode graphs as decode's",
    )
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    stream_interval_ms: float = Field(
        50.0,
        ge=0,
        description="shortest time between two streamed chunks of one request after its "
        "first (the tokens of the steps in between come in one chunk), as Ray Serve LLM's "
        "stream_batching_interval_ms: each chunk costs the replicas and the proxy more CPU than "
        "a decode step per token; 0: a chunk per engine step",
    )
    handlers_on_replica_loop: bool = Field(
        True,
        description="run the request handlers of rayinfer's replicas on each replica's own "
        "event loop, and the Ingress's router on it too, instead of a thread each (Serve's "
        "default): one thread hop less per streamed chunk. false: Serve's default",
    )

    @field_validator("disaggregate", mode="before")
    @classmethod
    def _parse_disaggregate(cls, value: Any) -> bool | str:
        return parse_bool_or_auto(value)

    @model_validator(mode="after")
    def _check_plans(self) -> AppConfig:
        for phase in phases_of(self.disaggregate):
            phase_config: PhaseConfig = getattr(self, phase)
            try:
                phase_config.plan  # noqa: B018  (constructing the plan validates it)
            except ConfigError as error:
                raise ValueError(f"{phase}.{error}") from None
            blocker = graph_blocker(
                phase_config.plan, phase_config.all_to_all.options(), prefix=f"{phase}."
            )
            if phase_config.cuda_graphs is True and blocker:
                raise ValueError(
                    f"{phase}.cuda_graphs=true cannot capture this forward: {blocker}; or use "
                    "false or auto"
                )
        return self

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> AppConfig:
        """Validate `serve run` arguments (dotted keys or nested mappings)."""
        nested = nest_dotted_keys(args or {})
        try:
            return cls.model_validate(nested)
        except ValidationError as error:
            raise ConfigError(describe_validation_error(error, cls)) from None


def nest_dotted_keys(args: dict[str, Any]) -> dict[str, Any]:
    """{"decode.autoscaling.max_replicas": "2"} -> {"decode": {"autoscaling": {...: "2"}}}."""
    nested: dict[str, Any] = {}
    for key, value in args.items():
        *parents, leaf = str(key).split(".")
        node = nested
        for depth, part in enumerate(parents):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"{'.'.join(parents[: depth + 1])} is set to {child!r} and also used as a "
                    f"section by {key}; set one or the other"
                )
            node = child
        if isinstance(value, dict):
            value = nest_dotted_keys(value)
            existing = node.get(leaf)
            if isinstance(existing, dict):
                value = {**existing, **value}
        node[leaf] = value
    return nested


def describe_validation_error(error: ValidationError, model: type[BaseModel]) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"])
        if item["type"] == "extra_forbidden":
            allowed = ", ".join(_allowed_keys(model, item["loc"][:-1]))
            lines.append(f"{key}: unknown key; allowed here: {allowed}")
        else:
            given = item.get("input")
            message = item["msg"].removeprefix("Value error, ")
            where = f"{key}={given!r}: " if key else ""
            lines.append(f"{where}{message}")
    return "invalid rayinfer app config: " + "; ".join(lines)


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    for part in loc:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)
