"""How a phase's workers exchange MoE tokens: `AllToAllConfig`, with the host-staged transport's
own settings in `HostStagedConfig`. Validated once where the user gives them (`LLM(all_to_all=
...)`, a Serve phase's `all_to_all.*`), carried unchanged in `WorkerSpec` to each worker's
`LayerGroup`, which hands them to rayinfer.comm."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from rayinfer.config import ConfigError

SCHEDULES = ("auto", "nccl", "pairwise", "hierarchical")
TRANSPORTS = ("auto", "dist", "host")
HOST_PROTOCOLS = ("auto", "gpu", "cpu")
# A chunk's fixed cost in bytes of link time, which sets the host-staged pipeline's chunking
# (comm/flag_pipeline.chunk_bytes_for: chunks of sqrt(n * overhead) bytes for an n-byte block).
# Per chunk the GPU pays ~10 us (one 64 KiB copy takes 12 us on an H200's host link) and the host
# ~20 us to queue three driver calls (2x H200), about 1 MiB of link time at 38 GB/s (the rate per
# copy stream when both GPUs copy both ways at once): blocks up to ~1 MiB go whole.
CHUNK_OVERHEAD_BYTES = 1 << 20


def check_choice(key: str, value: Any, allowed: tuple) -> None:
    """A ConfigError naming `key` unless `value` is one of `allowed` (`is` for True, False and
    None, so that 1 is not True; equality for names)."""
    if not any(value is c or (type(value) is str and value == c) for c in allowed):
        raise ConfigError(f"{key}={value!r}; use one of {', '.join(map(str, allowed))}")


def check_count(key: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key}={value!r} must be an integer >= {minimum}")


@dataclass(frozen=True)
class HostStagedConfig:
    """The host-staged transport (GPU -> shared pinned host memory -> GPU; comm/host_staged.py).

    protocol: "auto" (the GPUs hand chunks over themselves where the driver has stream memory
    operations, else the CPU drives the copies), "gpu", or "cpu" (the CPU drives every chunk;
    such an exchange cannot be captured in a CUDA graph).
    direct_max_bytes: blocks up to this size go through the one-launch mailbox kernel
    (comm/mailbox.py); 0, the default, never (eagerly it lost to the copy pipeline at every size
    on 2x H200, and tied in graphs).
    chunk_overhead_bytes: a chunk's fixed cost in bytes of link time, which sets the live
    pipeline's chunking (CHUNK_OVERHEAD_BYTES)."""

    # The Serve app's config (pydantic) validates this dataclass field by field and forbids
    # unknown keys; __post_init__ checks it either way.
    __pydantic_config__ = {"extra": "forbid"}

    protocol: Literal[HOST_PROTOCOLS] = "auto"
    direct_max_bytes: int = 0
    chunk_overhead_bytes: int = CHUNK_OVERHEAD_BYTES

    def __post_init__(self):
        check_choice("all_to_all.host.protocol", self.protocol, HOST_PROTOCOLS)
        check_count("all_to_all.host.direct_max_bytes", self.direct_max_bytes, 0)
        check_count("all_to_all.host.chunk_overhead_bytes", self.chunk_overhead_bytes, 1)


@dataclass(frozen=True)
class AllToAllConfig:
    """The MoE token exchange of workers whose experts are split across data-parallel ranks.

    schedule: "auto" (the cost model's pick), "nccl", "pairwise" or "hierarchical".
    transport: "auto", "dist" (NCCL; gloo on the CPU) or "host" (through pinned host memory, for
    GPUs without peer-to-peer).
    use_fp8: send dispatched activations as FP8 e4m3 with one scale per token.
    dedup: True sends each token only to the ranks of its experts (one device sync per layer),
    False every token to every rank (no sync); None: all tokens where nearly every token needs
    every rank anyway (rayinfer.comm.moe).
    local_first: a rank's experts run on its own tokens beside the exchange, which then skips the
    rank (all-tokens exchange only); None: for calls of enough tokens (layers/moe.py).
    host: the host-staged transport's settings."""

    # The Serve app's config (pydantic) validates this dataclass field by field and forbids
    # unknown keys; __post_init__ checks it either way.
    __pydantic_config__ = {"extra": "forbid"}

    schedule: Literal[SCHEDULES] = "auto"
    transport: Literal[TRANSPORTS] = "auto"
    use_fp8: bool = False
    dedup: bool | None = None
    local_first: bool | None = None
    host: HostStagedConfig = field(default_factory=HostStagedConfig)

    def __post_init__(self):
        check_choice("all_to_all.schedule", self.schedule, SCHEDULES)
        check_choice("all_to_all.transport", self.transport, TRANSPORTS)
        check_choice("all_to_all.use_fp8", self.use_fp8, (False, True))
        check_choice("all_to_all.dedup", self.dedup, (None, True, False))
        check_choice("all_to_all.local_first", self.local_first, (None, False, True))
        if not isinstance(self.host, HostStagedConfig):
            raise ConfigError(f"all_to_all.host={self.host!r}; use a HostStagedConfig")

    @classmethod
    def of(cls, value: AllToAllConfig | dict | None) -> AllToAllConfig:
        """`value` as a config: itself, the default for None, or built from a mapping whose
        "host" entry may be a mapping too; an unknown key fails, naming the valid ones."""
        if isinstance(value, cls):
            return value
        options = dict(value or {})
        _check_keys("all_to_all", options, cls)
        host = options.get("host")
        if isinstance(host, dict):
            _check_keys("all_to_all.host", host, HostStagedConfig)
            options["host"] = HostStagedConfig(**host)
        return cls(**options)

    @property
    def is_cpu_driven(self) -> bool:
        """Whether host-staged exchanges are driven by the CPU (so no graph can replay them)."""
        return self.transport == "host" and self.host.protocol == "cpu"

    def replayable(self) -> AllToAllConfig:
        """The options a CUDA-graph capture takes: every token to every rank (sizes from the
        counts alone) and, for `auto`, NCCL's one-shot exchange (the size-based plan is made on
        the host); an explicit transport=host stays (it replays through its two-state flags)."""
        transport = "dist" if self.transport == "auto" else self.transport
        schedule = "nccl" if self.schedule == "auto" else self.schedule
        return replace(self, dedup=False, transport=transport, schedule=schedule)


def _check_keys(prefix: str, options: dict, config: type) -> None:
    valid = [f.name for f in fields(config)]
    for key in options:
        if key not in valid:
            raise ConfigError(f"{prefix}.{key} is unknown; valid keys: {', '.join(valid)}")
