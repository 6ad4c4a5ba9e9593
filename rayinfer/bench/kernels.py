"""`python -m rayinfer.bench kernels [GROUP] [options]`: Triton kernels against torch baselines.

Each group lives in `rayinfer/bench/kernels_<group>.py` with a `main(argv) -> int`; without a
GROUP every group runs in turn (with no options).
"""

from __future__ import annotations

import importlib
import pkgutil

import rayinfer.bench


def groups() -> list[str]:
    names = (m.name for m in pkgutil.iter_modules(rayinfer.bench.__path__))
    return sorted(n.removeprefix("kernels_") for n in names if n.startswith("kernels_"))


def main(argv: list[str]) -> int:
    known = groups()
    if argv and argv[0] in known:
        return importlib.import_module(f"rayinfer.bench.kernels_{argv[0]}").main(argv[1:]) or 0
    if argv and not argv[0].startswith("-"):
        print(f"unknown kernel group {argv[0]!r}; groups: {', '.join(known)}")
        return 2
    status = 0
    for group in known:
        status |= importlib.import_module(f"rayinfer.bench.kernels_{group}").main([]) or 0
    return status
