"""How the engine sizes its work: the paged KV cache (`CacheConfig`, or `KVMemoryConfig` to size it
from GPU memory) and continuous batching's limits (`SchedulerConfig`); and how the KV of a request
moves from prefill to decode (`KVHandoffConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rayinfer.config import ConfigError

# KV cache tokens when neither a block count nor a memory share is given (the CPU's default):
# room for four longest sequences, and never less than this many tokens.
MIN_DEFAULT_KV_TOKENS = 16384


def default_num_kv_blocks(max_model_len: int, block_size: int) -> int:
    """Blocks for max(4 x max_model_len, MIN_DEFAULT_KV_TOKENS) tokens."""
    return -(-max(4 * max_model_len, MIN_DEFAULT_KV_TOKENS) // block_size)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: `num_blocks` blocks of `block_size` tokens each, and for a model with
    a window pool (DeepSeek-V4's hybrid cache; engine/block_manager.py) `num_window_blocks` more
    blocks of window state (0: none)."""

    block_size: int = 16
    num_blocks: int = 512
    enable_prefix_caching: bool = True
    num_window_blocks: int = 0

    def __post_init__(self):
        if self.block_size <= 0:
            raise ConfigError(f"block_size={self.block_size} must be positive")
        if self.num_blocks <= 0:
            raise ConfigError(f"num_blocks={self.num_blocks} must be positive")
        if self.num_window_blocks < 0:
            raise ConfigError(f"num_window_blocks={self.num_window_blocks} must be >= 0")


def check_gpu_memory_utilization(
    value: float | None, key: str = "gpu_memory_utilization"
) -> float | None:
    """None (size the KV cache by token count) or a fraction in (0, 1]; else a ConfigError."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(
            f"{key}={value!r} must be a fraction in (0, 1]: the share of each GPU's total memory "
            "that weights, activations and the KV cache may use (e.g. 0.9)"
        )
    return float(value)


@dataclass(frozen=True)
class KVMemoryConfig:
    """Size each worker's KV cache from its GPU's memory (`gpu_memory_utilization`), after a
    profiling step of the largest batch the scheduler can form. Ignored off CUDA."""

    gpu_memory_utilization: float
    max_num_batched_tokens: int  # the largest step the scheduler forms
    max_model_len: int  # the cache must hold at least one sequence this long
    max_num_seqs: int = 1  # rows of logits the profiling step computes
    key: str = "gpu_memory_utilization"  # how errors name the setting (`decode.` in Serve)
    # The worker's share of its GPU (Serve's gpus_per_worker): below 1 the budget is this share
    # of the GPU minus the worker's own usage, not the whole GPU minus everything in use.
    gpu_share: float = 1.0

    def __post_init__(self):
        check_gpu_memory_utilization(self.gpu_memory_utilization, self.key)
        if not 0 < self.gpu_share <= 1:
            raise ConfigError(f"gpu_share={self.gpu_share} must be a fraction in (0, 1]")
        for key in ("max_num_batched_tokens", "max_model_len", "max_num_seqs"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"{key}={getattr(self, key)} must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: sequences per step and tokens per step (chunked prefill).

    waiting_served_ratio, max_waiting_steps (TGI's policy of the same names): while sequences
    decode and no prompt is mid-prefill, new prompts wait until they number at least
    waiting_served_ratio x the decoding sequences, or until the oldest has waited
    max_waiting_steps steps; then they are admitted together. Decodes keep stepping alone (from
    CUDA graphs) meanwhile and prompts arriving close together share their mixed steps, so a
    stream's decode is interrupted fewer times, for a longer time to first token. 0 (the default)
    admits a prompt at the next step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    waiting_served_ratio: float = 0.0
    max_waiting_steps: int = 20

    def __post_init__(self):
        for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_waiting_steps"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{key}={value!r} must be a positive integer")
        ratio = self.waiting_served_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio >= 0:
            raise ConfigError(
                f"waiting_served_ratio={ratio!r} must be a number >= 0 (0: admit prompts at once)"
            )


# How a prefill worker's KV leaves it (workers/handoff_io.py): "auto" lands it in the worker's
# shared-memory arena, which an importer on the same Ray node maps (one copy each way, no object
# store); "object_store" puts it into Ray's object store, as across nodes.
KV_HANDOFF_PATHS = ("auto", "object_store")
# Each exporting worker's arena: room for ~18 V2-Lite requests of 3.7k tokens (115 MB) waiting
# for decode; page-locked on CUDA, reserved as it is used on the CPU.
DEFAULT_ARENA_BYTES = 2 << 30
# Page-locked chunks (an arena's) move by batched row copies on the copy engines, with no
# kernel and one driver call, where a request's copies (one per layer and run of consecutive
# slots) average at least this many bytes (the export's default, and a KVCopier's own:
# workers/runner/kv_copy.py); else through the device staging buffer and one gather or scatter
# kernel.
# `python benchmarks/handoff_copy_engines.py` (H100, a 115 MB V2-Lite request): runs of 8
# blocks (147 KB copies) import in 2.6 ms idle and 2.9 with matmuls on another stream, where
# the staged kernel takes 2.3 / 3.5, and with a Python thread contending for the GIL 28 ms
# against 263 (every torch op and launch gives the GIL up); one-block runs (18 KB copies) take
# 28 ms even idle against the staged 2.5.
DIRECT_MIN_COPY_BYTES = 64 * 2**10


@dataclass(frozen=True)
class KVHandoffConfig:
    """The KV hand-off between prefill and decode workers.

    path: "auto": into the exporting worker's shared-memory arena, from which an importer on the
    same Ray node copies straight into its cache; an importer on another node asks the exporter
    to put it into the object store, and an export that finds the arena full goes through the
    object store. "object_store": always through Ray's object store.
    arena_bytes: the size of each exporting worker's arena (a file in /dev/shm).
    lease_s: how long an exported request's KV keeps its arena space for an importer that has
    neither landed nor dropped it; past it the space may be reused (the late importer then
    reads the KV as lost and recomputes the prompt). The exporting group holds each hand-off's
    references as long (workers/export_holds.py), or until the importer released its spans;
    those of exports through the object store, whose import it cannot see, at most arena_bytes
    of them.
    layer_by_layer: with "auto", copy a request's KV into the arena layer by layer during the
    step that ends its prompt, each layer once it is cached, so the export after the step only
    waits for the last layers (workers/runner/layer_export.py); False: the whole request after
    the step.
    export_direct_min_copy_bytes, import_direct_min_copy_bytes: on GPUs, a request whose KV
    (one copy per layer and run of consecutive cache slots) averages at least this many bytes
    per copy leaves (enters) the cache by batched row copies on the copy engines
    (workers/runner/copy_batches.py); a more scattered one through a device staging buffer and
    one gather (scatter) kernel, as short copies each cost the copy engines a fixed few
    microseconds (benchmarks/handoff_copy_engines.py). The layer-by-layer export needs the
    batched copies. None (the import's default): always staged, as in `serve run` with Prefill
    and Decode on one H100 the staged import kept up with batched copies at 16 streams (5.8 ms
    for 115 MB either way) and beat them at 64 (6.3-6.8 against 11-12 ms at P50; P90 7.6-7.9
    against 36), whatever the copies' length (benchmarks/RESULTS.md, serving)."""

    # The Serve app's config (pydantic) validates this dataclass field by field and forbids
    # unknown keys; __post_init__ checks it either way.
    __pydantic_config__ = {"extra": "forbid"}

    path: Literal[KV_HANDOFF_PATHS] = "auto"
    arena_bytes: int = DEFAULT_ARENA_BYTES
    lease_s: float = 60.0
    layer_by_layer: bool = True
    export_direct_min_copy_bytes: int = DIRECT_MIN_COPY_BYTES
    import_direct_min_copy_bytes: int | None = None

    def __post_init__(self):
        if self.path not in KV_HANDOFF_PATHS:
            raise ConfigError(
                f"kv_handoff.path={self.path!r}; use one of {', '.join(KV_HANDOFF_PATHS)}"
            )
        arena = self.arena_bytes
        if isinstance(arena, bool) or not isinstance(arena, int) or arena < 1 << 20:
            raise ConfigError(
                f"kv_handoff.arena_bytes={arena!r} must be an integer >= 1048576 (1 MiB); a "
                "request's KV that does not fit goes through the object store"
            )
        lease = self.lease_s
        if isinstance(lease, bool) or not isinstance(lease, (int, float)) or lease <= 0:
            raise ConfigError(f"kv_handoff.lease_s={lease!r} must be a positive number of seconds")
        if not isinstance(self.layer_by_layer, bool):
            raise ConfigError(
                f"kv_handoff.layer_by_layer={self.layer_by_layer!r} must be true or false"
            )
        for key in ("export_direct_min_copy_bytes", "import_direct_min_copy_bytes"):
            least = getattr(self, key)
            if least is None and key.startswith("import"):
                continue
            if isinstance(least, bool) or not isinstance(least, int) or least < 0:
                raise ConfigError(
                    f"kv_handoff.{key}={least!r} must be an integer >= 0 (bytes); 0 copies "
                    "every request by batched row copies"
                )


DEFAULT_KV_HANDOFF = KVHandoffConfig()


def window_blocks_needed(
    window_span: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
) -> int:
    """Window-pool blocks that every running sequence's window state fits in at once: per
    sequence the blocks of its last `window_span` tokens (one more where they straddle a block
    boundary, one for the step's new block), plus a step's new tokens; 0 without a window."""
    if window_span <= 0:
        return 0
    per_sequence = -(-window_span // block_size) + 2
    return max_num_seqs * per_sequence + -(-max_num_batched_tokens // block_size)
