"""Waiting on a condition that a cluster, a server or a replica reaches in its own time."""

from __future__ import annotations

import time


def wait_for(predicate, timeout_s: float, interval_s: float = 0.5, what: str = "condition"):
    """Poll predicate() until it returns a truthy value; raise after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as error:  # not up yet (connection refused, 503, a status without the key)
            last_error = error
        time.sleep(interval_s)
    raise TimeoutError(f"{what} not reached within {timeout_s}s (last error: {last_error!r})")
