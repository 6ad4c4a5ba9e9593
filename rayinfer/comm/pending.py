"""Handles for exchanges running in the background, so compute can overlap them."""

from concurrent.futures import Future
from typing import Generic, TypeVar

T = TypeVar("T")


class Pending(Generic[T]):
    """An exchange in flight; `wait()` returns its result (and re-raises its error)."""

    def __init__(self, future: Future):
        self._future = future

    def is_done(self) -> bool:
        return self._future.done()

    def wait(self, timeout_s: float | None = None) -> T:
        return self._future.result(timeout_s)
