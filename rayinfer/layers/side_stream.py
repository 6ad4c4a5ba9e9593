"""Work queued beside the caller's CUDA stream, joined when its result is needed.

An expert-parallel MoE layer sends its tokens away (dispatch) and waits for them to come back
(combine); the shared experts need neither, so they can run on a side stream while tokens travel
(as DeepSeek's and SGLang's schedules do). `later(fn, x, may_run_beside, beside_from)` returns
a handle whose `result()` is fn(x): computed on a side stream from the call on, or at the
`result()` call on the caller's stream (the plain order: on CPU, inside CUDA-graph capture, for
fewer tokens than `beside_from` (OverlapConfig.shared_experts_beside_from), or where the caller
says no).

The side stream waits for what the caller queued before the call, and `result()` makes the
caller's stream wait for the side stream's work, so values are the same either way. One side
stream per caller stream (the two-batch overlap's lanes each get their own, so one lane's shared
experts never queue behind the other's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rayinfer.overlap_config import DEFAULT_BESIDE_FROM_TOKENS

_side_streams: dict[tuple[torch.device, int], torch.cuda.Stream] = {}


def _side_stream_of(caller: torch.cuda.Stream) -> torch.cuda.Stream:
    key = (caller.device, caller.stream_id)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(caller.device)
    return _side_streams[key]


class Later:
    """fn(x), computed when `result()` is called, on the caller's stream."""

    runs_beside = False

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor):
        self._fn, self._x = fn, x

    def result(self) -> torch.Tensor:
        return self._fn(self._x)


class Beside:
    """fn(x), queued now on a side stream; `result()` makes the current stream wait for it.
    `reads`: other tensors made on the caller's stream that fn reads."""

    runs_beside = True

    def __init__(
        self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, reads: tuple = ()
    ):
        caller = torch.cuda.current_stream(x.device)
        side = _side_stream_of(caller)
        side.wait_stream(caller)  # x and everything before it
        with torch.cuda.stream(side):
            self._out = fn(x)
            self._done = side.record_event()
        for tensor in (x, *reads):  # their memory is not reused until the side stream is past
            tensor.record_stream(side)

    def result(self) -> torch.Tensor:
        current = torch.cuda.current_stream(self._out.device)
        current.wait_event(self._done)
        self._out.record_stream(current)  # allocated on the side stream, read on this one
        return self._out


def later(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    may_run_beside: bool,
    reads: tuple = (),
    beside_from: int | None = DEFAULT_BESIDE_FROM_TOKENS,
):
    """A handle on fn(x) [T, ...]: on a side stream from now on where `may_run_beside`, x is on
    a GPU outside CUDA-graph capture and T reaches `beside_from` (None: never); else computed at
    `result()`. reads: other tensors fn reads (kept alive for the side stream)."""
    if may_run_beside and x.is_cuda and not torch.cuda.is_current_stream_capturing():
        if beside_from is not None and x.shape[0] >= beside_from:
            return Beside(fn, x, reads)
    return Later(fn, x)


class StartOnce:
    """Queues `start()` the first time it is called, and never again: e.g. by dispatch once the
    rows to send are queued (its `on_packed` hook), so that work queued then on a side stream
    never holds the packing up (queued before it, the shared experts filled the GPU and the
    packing, and so the whole exchange, waited for them: no overlap, 2x H200); or by a later
    stage. `handle()` is what `start` returned, queued then if nothing called before."""

    def __init__(self, start: Callable[[], Any]):
        self._start, self._handle, self._started = start, None, False

    def __call__(self) -> None:
        if not self._started:
            self._started = True
            self._handle = self._start()

    def handle(self):
        self()
        return self._handle
