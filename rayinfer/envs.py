"""The process-level settings that stay environment variables, declared once.

Everything that changes how rayinfer runs is a typed config field (`EngineArgs`, the Serve app's
`AppConfig`); only what belongs to the process rather than to one engine is read from the
environment, here and nowhere else: where files are cached, Triton's own interpreter switch and
the NCCL settings that change the topology probe's measurements. `forwarded()` hands the ones set
in this process to Ray actors explicitly (their `runtime_env`), so that a worker on another node
sees what the driver saw. docs/configuration.md lists them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    """One declared variable: its name, its value when unset, and what it is for."""

    name: str
    default: str
    doc: str

    def get(self) -> str:
        return os.environ.get(self.name) or self.default

    @property
    def is_set(self) -> bool:
        return self.name in os.environ


RAYINFER_CACHE = EnvVar(
    "RAYINFER_CACHE",
    "",
    "folder of the built-in tiny checkpoint and the topology probe's cache "
    "(default ~/.cache/rayinfer)",
)
TRITON_INTERPRET = EnvVar(
    "TRITON_INTERPRET",
    "0",
    "1 runs Triton kernels in Triton's interpreter on CPU tensors (tests); Triton reads it "
    "when a kernel is decorated",
)
NCCL_P2P_DISABLE = EnvVar(
    "NCCL_P2P_DISABLE", "", "NCCL's own switch; part of the topology probe's cache key"
)
NCCL_SHM_DISABLE = EnvVar(
    "NCCL_SHM_DISABLE", "", "NCCL's own switch; part of the topology probe's cache key"
)
DECLARED = (RAYINFER_CACHE, TRITON_INTERPRET, NCCL_P2P_DISABLE, NCCL_SHM_DISABLE)


def cache_dir() -> Path:
    """Where rayinfer caches files: $RAYINFER_CACHE, else ~/.cache/rayinfer."""
    return Path(RAYINFER_CACHE.get() or Path.home() / ".cache" / "rayinfer")


def triton_interpret() -> bool:
    return TRITON_INTERPRET.get() == "1"


def nccl_settings() -> tuple[str, str]:
    """(NCCL_P2P_DISABLE, NCCL_SHM_DISABLE) as set here: they change the paths NCCL takes."""
    return NCCL_P2P_DISABLE.get(), NCCL_SHM_DISABLE.get()


def forwarded() -> dict[str, str]:
    """The declared variables set in this process, for a Ray actor's runtime_env env_vars."""
    return {var.name: os.environ[var.name] for var in DECLARED if var.is_set}


def subprocess_env(**overrides: str) -> dict[str, str]:
    """This process's environment with `overrides` (declared variables only) for a child."""
    names = {var.name for var in DECLARED}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"{unknown} are not declared; declared: {', '.join(sorted(names))}")
    return {**os.environ, **overrides}
