"""One request's path through the server: prefill, hand-off and decode stream (disaggregated),
or one engine stream that does both (colocated).

Yields text deltas as they become safe to show. A prefill replica (or a colocated engine replica
before its first token) that is lost is retried once on another replica. A decode or engine
replica lost mid-stream is resumed once on another one from the tokens already sent: the sent
tokens join the prompt, and the ingress keeps the text from there as the first replica would
have (resume.py: held-back text is not lost, a stop string across the cut still stops it).
A replica is lost when it died (a replica whose worker died kills itself, so Serve's router has
stopped choosing it: deployments/replica.py) or answered that its engine stopped.
Any other failure ends the stream with the error, never a hang. Leaving the iterator early
(client disconnect) cancels the replica's stream, which aborts the request there. A call no
replica takes within `max_replica_wait_s` (none runs: its node is gone and no other node offers
its resources) is cancelled and answered 503: Serve's router would hold it without a bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import ray
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from rayinfer.deployments.admission import Admission, Refusal, Waiter
from rayinfer.deployments.engine_loop import EngineStoppedError
from rayinfer.deployments.errors import root_cause
from rayinfer.deployments.metrics import ServeMetrics
from rayinfer.deployments.openai_error import OpenAIError
from rayinfer.deployments.resume import ResumedText, TextRules
from rayinfer.deployments.types import (
    DecodeChunk,
    DecodeRequest,
    Delta,
    EngineRequest,
    PrefillRequest,
    PrefillResult,
    Timings,
)
from rayinfer.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

REPLICA_GONE_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def is_replica_lost(error: BaseException) -> bool:
    """Whether a replica's call failed because the replica is gone or its engine stopped (a
    worker died), not because of the request: then it is worth one more try elsewhere."""
    return isinstance(error, REPLICA_GONE_ERRORS) or isinstance(
        root_cause(error), (*REPLICA_GONE_ERRORS, EngineStoppedError)
    )


def overloaded(phase: str) -> OpenAIError:
    return OpenAIError(503, f"the {phase} replicas are full; retry shortly", code="overloaded")


def refused(refusal: Refusal, max_wait_s: float, num_runs: int = 1) -> OpenAIError:
    what = "this request" if num_runs == 1 else f"this request's {num_runs} choices"
    message = (
        f"the server is at capacity: {what} would wait about {refusal.estimated_wait_s:.1f} s "
        f"to start, above its {max_wait_s:g} s bound; retry after {refusal.retry_after_s} s"
    )
    return OpenAIError(503, message, code="overloaded", retry_after_s=refusal.retry_after_s)


def no_replica(phase: str, wait_s: float) -> OpenAIError:
    message = (
        f"no {phase} replica took this request within {wait_s:g} s (none is running, or all "
        "are full); retry shortly"
    )
    return OpenAIError(503, message, code="replica_unavailable")


async def until_taken(response, phase: str, wait_s: float | None) -> None:
    """Return once a replica of `phase` has taken the handle call `response` (unary or
    streaming); past `wait_s` cancel it and raise a 503 (None: wait as long as it takes).
    Serve's router holds a call while no replica of the deployment runs (a replacement still
    starting, or none can: its node died and no other offers its resources) or all are full."""
    if wait_s is None or not response.by_reference:  # Serve's gRPC calls have no object ref
        return
    streaming = isinstance(response, DeploymentResponseGenerator)
    taken = response._to_object_ref_gen() if streaming else response._to_object_ref()
    try:
        await asyncio.wait_for(taken, wait_s)
    except TimeoutError:
        response.cancel()
        raise no_replica(phase, wait_s) from None


class Pipeline:
    """What both modes share: admission, the ingress's metrics and the resume after a replica
    died mid-stream. A subclass's `_attempt` runs the request once on the engines."""

    def __init__(
        self,
        metrics: ServeMetrics,
        admission: Admission | None = None,
        max_replica_wait_s: float | None = None,
    ):
        """admission: which requests are taken (deployments/admission.py; default: all).
        max_replica_wait_s: how long a call may wait for a replica to take it (None: no
        bound; see `until_taken`)."""
        self.metrics = metrics
        self.admission = admission or Admission(max_wait_s=None)
        self.max_replica_wait_s = max_replica_wait_s
        # How the engines detokenize and stop, for a resumed stream's text (resume.py); None
        # (no tokenizer): a resumed stream's deltas pass as the replica sends them.
        self.text_rules: TextRules | None = None

    def admit(self, num_runs: int = 1) -> list[Waiter]:
        """Admit a request of num_runs runs (its choices) as one: each run's place among the
        waiting, for `run`; a request the engines cannot start in time raises a 503."""
        refusal = self.admission.try_admit(num_runs)
        if refusal is not None:
            self.metrics.count_request("shed")
            raise refused(refusal, self.admission.max_wait_s, num_runs)
        return [Waiter(self.admission) for _ in range(num_runs)]

    async def run(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        timings: Timings,
        waiter: Waiter | None = None,
    ) -> AsyncIterator[Delta]:
        """The request's deltas. It waits (for admission) until its first decode token or its
        finish. waiter: its place from `admit` (None: admitted here, before any work; a request
        the engines cannot start in time raises a 503)."""
        if waiter is None:
            waiter = self.admit()[0]
        arrival = time.perf_counter()
        status = "abort"
        last = arrival
        num_generated = 0
        try:
            async for delta in self._run(request_id, prompt_ids, params, timings):
                if num_generated > 0 or delta.finish_reason is not None:
                    waiter.start()
                now = time.perf_counter()
                if num_generated == 0:
                    timings.ttft_s = now - arrival
                    self.metrics.ttft.observe(timings.ttft_s, tags=self.metrics.tags)
                else:
                    self.metrics.observe_token_gap(now - last, len(delta.token_ids))
                last = now
                num_generated += len(delta.token_ids)
                yield delta
            status = "ok"
        except Exception:
            status = "error"
            raise
        finally:
            waiter.leave()  # nothing once started
            self.metrics.count_request(status)
            self.metrics.add_tokens(len(prompt_ids), num_generated)

    async def _run(self, request_id, prompt_ids, params, timings: Timings) -> AsyncIterator[Delta]:
        """One attempt; if its replica dies mid-stream, resume once elsewhere."""
        sent: list[int] = []  # token ids already given to the caller
        sent_text = ""  # and their text
        try:
            async for delta in self._attempt(request_id, prompt_ids, params, timings):
                sent += delta.token_ids
                sent_text += delta.text
                yield delta
            return
        except Exception as error:
            if not sent or not is_replica_lost(error):
                raise
            logger.warning(
                "the replica streaming %s died after %d tokens (%r); resuming",
                request_id, len(sent), error,
            )  # fmt: skip
        remaining = params.max_tokens - len(sent)
        if remaining <= 0:
            yield Delta("", [], "length")
            return
        min_tokens = max(0, params.min_tokens - len(sent))
        resumed = replace(params, max_tokens=remaining, min_tokens=min_tokens)
        timings.was_resumed = True
        text = None
        if self.text_rules is not None:
            text = ResumedText(self.text_rules, prompt_ids, params, sent, sent_text)
        deltas = self._attempt(f"{request_id}-resumed", prompt_ids + sent, resumed, timings)
        try:
            async for delta in deltas:
                delta = text.next(delta) if text is not None else delta
                yield delta
                if delta.finish_reason is not None:
                    return  # a stop string across the cut ends it before the replica does
        finally:
            await deltas.aclose()  # cancels the replica's stream if it still runs

    def _attempt(self, request_id, prompt_ids, params, timings) -> AsyncIterator[Delta]:
        raise NotImplementedError


class DisaggregatedPipeline(Pipeline):
    """Prefill on a Prefill replica, then the hand-off streamed by a Decode replica."""

    def __init__(
        self,
        prefill: DeploymentHandle,
        decode: DeploymentHandle,
        metrics: ServeMetrics,
        admission: Admission | None = None,
        max_replica_wait_s: float | None = None,
    ):
        super().__init__(metrics, admission, max_replica_wait_s)
        self.prefill_handle = prefill
        self.decode_handle = decode.options(stream=True)

    async def _attempt(self, request_id, prompt_ids, params, timings) -> AsyncIterator[Delta]:
        start = time.perf_counter()
        result = await self._prefill(PrefillRequest(request_id, prompt_ids, params))
        timings.prefill_s = time.perf_counter() - start
        first_logprobs = [result.first_logprobs] if result.first_logprobs is not None else None
        if result.finish_reason is not None:
            yield Delta(result.text, [result.first_token_id], result.finish_reason, first_logprobs,
                        result.prompt_logprobs, result.num_cached_tokens,
                        result.stop_reason)  # fmt: skip
            return
        timings.kv_bytes = result.handoff.num_bytes
        yield Delta(result.first_text, [result.first_token_id], None, first_logprobs,
                    result.prompt_logprobs, result.num_cached_tokens)  # fmt: skip
        stream = self.decode_handle.generate.remote(DecodeRequest(result, params))
        try:
            await until_taken(stream, "decode", self.max_replica_wait_s)
        except BackPressureError:
            raise overloaded("decode") from None
        async for chunk in _chunks(stream, "decode"):
            if chunk.kv_import_s is not None:
                timings.kv_import_s = chunk.kv_import_s
                timings.add_handoff(chunk.kv_timings)  # the export's seconds too
                timings.was_recomputed = chunk.was_recomputed
            yield delta_of(chunk)

    async def _prefill(self, request: PrefillRequest) -> PrefillResult:
        try:
            return await self._prefill_once(request)
        except BackPressureError:
            raise overloaded("prefill") from None
        except Exception as error:
            if not is_replica_lost(error):
                raise
            logger.warning("prefill of %s failed (%r); retrying once", request.request_id, error)
            return await self._prefill_once(request)

    async def _prefill_once(self, request: PrefillRequest) -> PrefillResult:
        response = self.prefill_handle.prefill.remote(request)
        await until_taken(response, "prefill", self.max_replica_wait_s)
        return await response


class ColocatedPipeline(Pipeline):
    """The whole request streamed by one Engine replica (prefill and decode in mixed batches)."""

    def __init__(
        self,
        engine: DeploymentHandle,
        metrics: ServeMetrics,
        admission: Admission | None = None,
        max_replica_wait_s: float | None = None,
    ):
        super().__init__(metrics, admission, max_replica_wait_s)
        self.engine_handle = engine.options(stream=True)

    async def _attempt(self, request_id, prompt_ids, params, timings) -> AsyncIterator[Delta]:
        request = EngineRequest(request_id, prompt_ids, params)
        start = time.perf_counter()
        stream, first = await self._start(request)
        timings.prefill_s = time.perf_counter() - start
        async for chunk in _chunks(stream, "engine", first):
            yield delta_of(chunk)

    async def _start(self, request: EngineRequest):
        """The engine stream and its first chunk (the prefill's token); a replica gone before
        it is retried once, as a prefill is."""
        wait_s = self.max_replica_wait_s
        try:
            return await _first_chunk(self.engine_handle.generate.remote(request), wait_s)
        except Exception as error:
            if not is_replica_lost(error):
                raise
            logger.warning("engine of %s failed (%r); retrying once", request.request_id, error)
            return await _first_chunk(self.engine_handle.generate.remote(request), wait_s)


async def _first_chunk(stream, wait_s: float | None) -> tuple[object, DecodeChunk]:
    try:
        await until_taken(stream, "engine", wait_s)
        return stream, await anext(stream)
    except BackPressureError:
        raise overloaded("engine") from None
    except BaseException:
        stream.cancel()
        raise


async def _chunks(stream, phase: str, first: DecodeChunk | None = None):
    """A replica's stream (after its `first` chunk, when already read); cancelled there unless
    it ran to its last chunk."""
    finished = False
    try:
        if first is not None:
            finished = first.finish_reason is not None
            yield first
        if not finished:
            async for chunk in _backpressure_as_503(stream, phase):
                finished = chunk.finish_reason is not None
                yield chunk
    finally:
        if not finished:
            stream.cancel()


def delta_of(chunk: DecodeChunk) -> Delta:
    return Delta(chunk.new_text, list(chunk.new_token_ids), chunk.finish_reason,
                 chunk.new_logprobs, chunk.prompt_logprobs, chunk.num_cached_tokens,
                 chunk.stop_reason)  # fmt: skip


async def _backpressure_as_503(stream, phase: str):
    try:
        async for item in stream:
            yield item
    except BackPressureError:
        raise overloaded(phase) from None


async def first_delta(deltas: AsyncIterator[Delta]) -> Delta:
    """The prefill's delta, so an HTTP stream starts only once the request is under way (and a
    failure before it still gets a proper status code: the caller maps it, errors.py)."""
    try:
        return await anext(deltas)
    except BaseException:
        await deltas.aclose()
        raise


async def prepend(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    try:
        yield first
        async for delta in rest:
            yield delta
    finally:
        await rest.aclose()
