"""Triton kernels a worker compiles after its startup, each logged with the time it took.

Triton compiles a kernel the first time the process launches it with new specializations (its
constexprs, an integer argument's divisibility by 16), or loads it from its disk cache, which
takes a fraction of the time. Either blocks the step that launched it, and every request in
flight waits with that step: a few seconds of compiles inside a benchmark's timed window double
its median time per output token. Startup (warm-up and graph capture) compiles what it touches;
what a worker compiles after that is logged at WARNING, with the kernel's name and seconds, so a
slow first pass on a fresh machine shows which kernels it waited for.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


class CompileWatch:
    """Times each compile (Triton's JIT cache-miss and post-compile hooks) in this process."""

    def __init__(self):
        self.serving = False  # set once startup is over: compiles from then on are logged
        self.num_after_startup = 0
        self.seconds_after_startup = 0.0
        self._began = threading.local()

    def install(self) -> bool:
        """Hook into Triton (its runtime knobs; JITFunction's class hooks before Triton 3.4);
        False where this Triton has neither, or there is no Triton."""
        try:
            from triton import knobs

            knobs.runtime.jit_cache_hook = self._before
            knobs.runtime.jit_post_compile_hook = self._after
            return True
        except (ImportError, AttributeError):
            pass
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return False
        if not hasattr(JITFunction, "compiled_hook"):
            return False
        JITFunction.cache_hook, JITFunction.compiled_hook = self._before, self._after
        return True

    def _before(self, **kwargs) -> bool:
        self._began.at = time.perf_counter()
        return False  # True would skip the compile

    def _after(self, **kwargs) -> bool:
        began = getattr(self._began, "at", None)
        if began is None or not self.serving:
            return False
        seconds = time.perf_counter() - began
        self.num_after_startup += 1
        self.seconds_after_startup += seconds
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or getattr(fn, "__qualname__", "?")
        logger.warning(
            "compiled Triton kernel %s in %.2f s after startup (the step waited for it; %d such "
            "compiles, %.1f s so far)", name, seconds, self.num_after_startup,
            self.seconds_after_startup,
        )  # fmt: skip
        return False
