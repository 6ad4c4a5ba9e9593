"""Drive one synchronous LLMEngine from a background thread for asyncio callers.

The engine is not thread-safe, so only the loop thread touches it: callers post commands (add,
add prefilled, abort) to a queue and read their request's events from an asyncio queue. Every
request ends with a finished output or an error: a request the engine failed alone (finish_reason
"error") raises RequestFailedError in its caller while the others go on; if the engine itself
fails, `on_fatal` hears of it first (a replica then leaves: deployments/replica.py), every open
request gets that error, later ones EngineStoppedError, and the loop reports itself unhealthy.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

from rayinfer.engine.engine import LLMEngine
from rayinfer.engine.kv_handoff import KVHandoff
from rayinfer.engine.outputs import RequestFailedError, RequestOutput
from rayinfer.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long the idle loop blocks on the command queue before checking stop


class EngineStoppedError(RuntimeError):
    """The loop's engine failed (a worker died, a forward raised); this replica takes no more
    requests and is replaced."""

    def __init__(self, cause: str):
        super().__init__(f"the engine loop stopped after {cause}")
        self.cause = cause


@dataclass
class LoopEvent:
    """What a request's stream receives: an output (with the hand-off if prefilled) or an error."""

    output: RequestOutput | None = None
    handoff: KVHandoff | None = None
    error: BaseException | None = None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue


def _ends_stream(event: LoopEvent) -> bool:
    return event.error is not None or event.output.finished


def _coalesced(event: LoopEvent, queued: asyncio.Queue) -> LoopEvent:
    """`event` merged with the ones queued behind it, up to the first error or finish: when the
    caller falls behind the engine (64 streams yielding through Serve one token each cost a
    replica more than the engine's step), it takes several tokens in one chunk instead of
    queueing ever more. A caller that keeps up gets one step's tokens per event, as before."""
    while event.error is None and not event.output.finished and not queued.empty():
        later: LoopEvent = queued.get_nowait()
        if later.error is not None:
            return later  # the request failed: its tokens so far are not worth sending
        event = LoopEvent(output=_merged(event.output, later.output), handoff=later.handoff)
    return event


def _merged(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """`then` carrying `first`'s new tokens, text and log-probabilities before its own."""
    new_logprobs = None
    if first.new_logprobs is not None or then.new_logprobs is not None:
        new_logprobs = list(first.new_logprobs or []) + list(then.new_logprobs or [])
    return replace(
        then,
        new_token_ids=list(first.new_token_ids) + list(then.new_token_ids),
        new_text=first.new_text + then.new_text,
        new_logprobs=new_logprobs,
        prompt_logprobs=first.prompt_logprobs or then.prompt_logprobs,
    )


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        name: str,
        on_tick: Callable[[], None] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        chunk_interval_s: float = 0.0,
    ):
        """on_tick runs on the loop thread after every step, and every IDLE_WAIT_S when idle;
        on_fatal once, on the loop thread, when the engine failed, before any request hears.
        chunk_interval_s: the shortest time between two events of one stream after its first;
        the steps in between come merged into one (0: an event per step)."""
        self.engine = engine
        self.chunk_interval_s = chunk_interval_s
        self.on_tick = on_tick or (lambda: None)
        self.on_fatal = on_fatal or (lambda error: None)
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, _Stream] = {}
        self.fatal_error: BaseException | None = None
        # (start on time.monotonic(), seconds, prompt tokens) of each model step since the last
        # take_step_times
        self.step_times: list[tuple[float, float, int]] = []
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    # --- asyncio side ------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, prefill_only: bool
    ) -> AsyncIterator[LoopEvent]:
        async for event in self._stream(
            request_id, ("add", request_id, prompt, params, prefill_only)
        ):
            yield event

    async def continue_prefilled(
        self, handoff: KVHandoff, params: SamplingParams
    ) -> AsyncIterator[LoopEvent]:
        async for event in self._stream(handoff.request_id, ("prefilled", handoff, params)):
            yield event

    async def _stream(self, request_id: str, command: tuple) -> AsyncIterator[LoopEvent]:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self.streams[request_id] = stream
        self.commands.put(command)
        if self.fatal_error is not None:  # checked after registering: no request slips past
            self.streams.pop(request_id, None)
            error = self.fatal_error
            raise EngineStoppedError(f"{type(error).__name__}: {error}")
        finished = False
        next_send = None  # loop time before which no event but the last is sent
        try:
            while not finished:
                event = await stream.events.get()
                if next_send is not None and not _ends_stream(event):
                    await asyncio.sleep(next_send - stream.loop.time())  # the steps meanwhile
                event = _coalesced(event, stream.events)  # join it here
                if event.error is not None:
                    finished = True
                    raise event.error
                finished = event.output.finished
                if self.chunk_interval_s > 0:
                    next_send = stream.loop.time() + self.chunk_interval_s
                yield event
        finally:
            self.streams.pop(request_id, None)
            if not finished:  # the caller went away (client disconnect, cancellation)
                self.commands.put(("abort", request_id))

    def stop(self) -> None:
        self._stopping.set()
        self.commands.put(("stop",))

    @property
    def is_healthy(self) -> bool:
        return self.fatal_error is None and self.thread.is_alive()

    # --- loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._take_commands(block=not self._has_work())
                if self._has_work():
                    start = time.monotonic()
                    outputs = self.engine.step()
                    prompt_tokens = self.engine.last_step_prompt_tokens
                    if prompt_tokens is not None:  # it ran the model
                        seconds = time.monotonic() - start
                        self.step_times.append((start, seconds, prompt_tokens))
                    self._deliver(outputs)
                self.on_tick()
        except BaseException as error:  # noqa: BLE001  (reported to every open request)
            logger.exception("engine loop failed")
            self.fatal_error = error
            try:
                self.on_fatal(error)
            except Exception:  # noqa: BLE001  (the requests must still hear of the failure)
                logger.exception("the engine loop's on_fatal failed")
            for request_id in list(self.streams):
                self._send(request_id, LoopEvent(error=error))

    def _has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def _take_commands(self, block: bool) -> None:
        try:
            command = (
                self.commands.get(timeout=IDLE_WAIT_S) if block else self.commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        kind, *rest = command
        if kind == "abort":
            self.engine.abort(rest[0])
            return
        if kind == "stop":
            return
        request_id = rest[0] if kind == "add" else rest[0].request_id
        try:
            if kind == "add":
                self.engine.add_request(*rest)
            else:
                self.engine.add_prefilled_request(*rest)
        except Exception as error:  # invalid request: only this request fails
            self._send(request_id, LoopEvent(error=error))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            event = LoopEvent(output=output)
            if output.finish_reason == "prefilled":  # starts the export, returns at once
                event.handoff = self.engine.take_handoff(output.request_id)
            if output.request_id not in self.streams and output.finished:
                continue  # its caller left; the hand-off's refs are dropped here
            if output.finish_reason == "error":
                event = LoopEvent(error=RequestFailedError(output.request_id, output.error))
            self._send(output.request_id, event)

    def _send(self, request_id: str, event: LoopEvent) -> None:
        stream = self.streams.get(request_id)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.events.put_nowait, event)
        except RuntimeError:  # the caller's event loop is closed
            self.streams.pop(request_id, None)

    def take_step_times(self) -> list[tuple[float, float, int]]:
        """The (start, seconds, prompt tokens) of the steps since the last call (on the loop
        thread)."""
        times, self.step_times = self.step_times, []
        return times

    def stats(self) -> dict[str, Any]:
        """Engine counters for metrics (read from the loop thread, in on_tick)."""
        return {
            "num_waiting": len(self.engine.scheduler.waiting)
            + len(self.engine.handoffs.pending_imports)
            + len(self.engine.handoffs.imports_in_flight),
            "num_running": len(self.engine.scheduler.running),
            "kv_usage": self.engine.kv_usage,
            "num_kv_recomputes": self.engine.handoffs.num_kv_recomputes,
        }
