"""When decode steps and new prompts run from CUDA graphs, and what is captured:
`CudaGraphConfig` (the buckets and the static block-table width) and the checks that say why a
plan's forward cannot be captured (`graph_blocker`), which `cuda_graph_config` turns into a
config or a ConfigError that names the key."""

from __future__ import annotations

from dataclasses import dataclass

from rayinfer.config import ConfigError, ModelConfig, ParallelPlan
from rayinfer.exchange_config import AllToAllConfig

# Largest prompt (tokens per rank) prefilled from a CUDA graph by default. Up to 4k tokens an
# eager prefill step is host-bound (queueing its ~1,000 kernels takes as long as running them);
# at 8k the eager step keeps pace only when its host does, while the graph is steady: `bench
# parallel --graphs decode auto` on 2x H200, DeepSeek-V2-Lite shapes, dp=2 ep=2 host-staged FP8,
# 8k prompts: eager 58.2k-71.7k tok/s per GPU, graph 70.3k-70.9k. From 16k the two tie (74.1k
# against 74.3k), so longer prompts run eagerly (benchmarks/RESULTS.md, prefill thresholds).
DEFAULT_MAX_PREFILL_GRAPH_TOKENS = 8192

# Largest mixed step (decodes beside prompt chunks) replayed from piecewise graphs by default:
# eagerly such a step's host work (~65 ms for DeepSeek-V2-Lite shapes) outlasts its GPU time up
# to about 3k tokens; past 4k the eager step keeps pace, and a bucket would only hold memory.
DEFAULT_MAX_PIECEWISE_GRAPH_TOKENS = 4096


@dataclass(frozen=True)
class CudaGraphConfig:
    """Pure-decode steps replayed from CUDA graphs captured at start, one per batch-size bucket
    up to `max_batch_size`; block tables are padded to `max_model_len` (runner/decode_graphs).
    New prompts of up to `max_prefill_tokens` tokens (0: none) prefill from graphs too, one per
    token-count bucket (runner/prefill_graphs); other steps of up to `max_piecewise_tokens`
    (0: none) from graphs cut at each attention, which runs eagerly (runner/piecewise_graphs)."""

    max_batch_size: int = 64
    max_model_len: int = 4096
    max_prefill_tokens: int = 0
    max_piecewise_tokens: int = 0

    def table_width(self, block_size: int) -> int:
        """Blocks in the static block tables: enough for max_model_len tokens."""
        return -(-self.max_model_len // block_size)

    def __post_init__(self):
        for key in ("max_batch_size", "max_model_len"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}={getattr(self, key)} must be positive")
        for key in ("max_prefill_tokens", "max_piecewise_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 0")


def graph_blocker(
    plan: ParallelPlan, all_to_all: AllToAllConfig | None = None, prefix: str = ""
) -> str | None:
    """Why decode steps of this plan cannot run from CUDA graphs, or None when they can.

    Collectives inside the forward are captured: tensor-parallel all-reduces as NCCL kernels,
    and the experts' token exchange (NCCL, or the host-staged transport's replayable protocol)
    when every token goes to every rank (static sizes: every rank pads its decode batch to the
    bucket the group agreed on)."""
    if not plan.experts_exchange_tokens:
        return None
    return exchange_graph_blocker(all_to_all, prefix)


def exchange_graph_blocker(all_to_all: AllToAllConfig | None, prefix: str = "") -> str | None:
    """Why a token exchange with these options cannot be replayed from a graph, or None: the
    deduplicated exchange sizes itself from the routing on the host. (The host-staged transport
    replays: captured, it hands chunks over with two-state flags, comm/flag_pipeline.py.)"""
    options = all_to_all or AllToAllConfig()
    if options.dedup is True:
        return f"{prefix}all_to_all.dedup=true sizes the exchange from the routing on the host"
    if options.is_cpu_driven:
        return (
            f"{prefix}all_to_all.transport=host with {prefix}all_to_all.host.protocol=cpu: the "
            "CPU drives those copies, and a graph cannot replay them"
        )
    return None


def cuda_graph_config(
    requested: bool | None,
    *,
    is_cuda: bool,
    plan: ParallelPlan,
    max_num_seqs: int,
    max_graph_batch_size: int,
    max_model_len: int,
    all_to_all: AllToAllConfig | None = None,
    key: str = "cuda_graphs",
    max_prefill_tokens: int = 0,
    model: ModelConfig | None = None,
    max_piecewise_tokens: int = 0,
) -> CudaGraphConfig | None:
    """None (graphs off) or what to capture. `requested` None: on for CUDA runs whose forward
    can be captured (see `graph_blocker`); True where it cannot fails, naming the key. True on
    the CPU runs the same padded static-buffer path eagerly (no capture), which tests use.
    max_prefill_tokens: the largest new prompt prefilled from a graph (capped by max_model_len;
    the caller caps it by the step's token budget); 0 captures decode graphs only.
    max_piecewise_tokens: the largest other step replayed in pieces (likewise capped; 0: none).
    model: the model served; new prompts of a DSA model prefill eagerly (its dense-or-sparse
    choice and sparse rows come from the host's prompt lengths, layers/dsa.py; its pure-decode
    steps replay)."""
    if requested not in (None, True, False):
        raise ConfigError(f"{key}={requested!r}; use true, false or auto (None)")
    if max_graph_batch_size < 1:
        raise ConfigError(f"max_graph_batch_size={max_graph_batch_size} must be >= 1")
    if max_prefill_tokens < 0:
        raise ConfigError(
            f"max_graph_prefill_tokens={max_prefill_tokens} must be >= 0 (0: no prefill graphs)"
        )
    if max_piecewise_tokens < 0:
        raise ConfigError(
            f"max_graph_piecewise_tokens={max_piecewise_tokens} must be >= 0 (0: no piecewise "
            "graphs)"
        )
    blocker = graph_blocker(plan, all_to_all, prefix=key.removesuffix("cuda_graphs"))
    if requested and blocker:
        raise ConfigError(f"{key}=true cannot capture this forward: {blocker}; or set {key}=false")
    enabled = (is_cuda and not blocker) if requested is None else requested
    if not enabled:
        return None
    if model is not None and (model.is_dsa or model.is_v4):  # prefills pick rows on the host
        max_prefill_tokens = max_piecewise_tokens = 0
    return CudaGraphConfig(
        min(max_num_seqs, max_graph_batch_size),
        max_model_len,
        min(max_prefill_tokens, max_model_len),
        max_piecewise_tokens,
    )
