"""The Serve application's configuration: what `serve run rayinfer.app:build key=value ...` takes.

Arguments arrive as dotted keys (`decode.autoscaling.max_replicas=2`, values as strings) from the
CLI, or as nested mappings with typed values from a Serve config YAML. `AppConfig.from_args`
accepts both; every unknown or invalid key fails with a message naming it and what is allowed.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from rayinfer.config import ConfigError
from rayinfer.deployments.config_args import (
    Strict,
    describe_validation_error,
    nest_dotted_keys,
    parse_bool_or_auto,
)
from rayinfer.deployments.phase_config import IngressConfig, PhaseConfig
from rayinfer.deployments.reasoning import ReasoningParserName
from rayinfer.engine_config import KVHandoffConfig
from rayinfer.graph_config import graph_blocker


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


class AppConfig(Strict):
    """Everything `rayinfer.app.build` accepts."""

    model: str = Field("tiny", description="'tiny' or a Hugging Face checkpoint folder")
    tokenizer: str | None = Field(None, description="tokenizer folder (default: the model's)")
    served_model_name: str | None = Field(None, description="name clients pass as `model`")
    reasoning_parser: ReasoningParserName | None = Field(
        None,
        description="split a thinking model's reasoning (between <think> and </think>) off its "
        "chat replies into `reasoning_content` and `reasoning`, as vLLM's --reasoning-parser: "
        "deepseek_r1 (the reply starts inside the reasoning), deepseek_v3 (inside it where "
        "chat_template_kwargs turn `thinking` on), qwen3 or glm45 (the reply's own <think>, or "
        "the prompt's; none with enable_thinking false); rayinfer/deployments/chat_reasoning.py. "
        "null: replies as generated",
    )
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
    kv_handoff: KVHandoffConfig = Field(
        default_factory=KVHandoffConfig,
        description="the KV hand-off from Prefill to Decode (disaggregated): path=auto copies "
        "each request's KV into its prefill worker's shared-memory arena (arena_bytes each, in "
        "/dev/shm), from which a decode worker on the same Ray node copies it straight into its "
        "cache; across nodes, or when the arena is full, it goes through the object store; "
        "path=object_store: always through the object store. lease_s: how long an exported KV "
        "keeps its arena space for a decode that has not taken it (rayinfer/engine_config.py)",
    )
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
            blocker = graph_blocker(phase_config.plan, phase_config.all_to_all, prefix=f"{phase}.")
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
