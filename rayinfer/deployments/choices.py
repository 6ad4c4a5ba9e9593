"""Requests with `n` > 1, or a batch of prompts: one pipeline run per choice, merged into one
OpenAI reply. Prompt p's choice i has index p * n + i, as OpenAI numbers them.

Choice i samples with `seed + i` (modulo 2**63) when the request gives a seed (reproducible, and
different per choice), else with its own random generator; the prompt is the same, so prefill serves
the later choices from its prefix cache where the first one's blocks are already computed. Whole:
the choices in index order, usage counting the prompt once and every choice's tokens. Stream: one
SSE stream whose chunks carry their choice's `index`, interleaved as they come, then one usage chunk
and [DONE]. Usage counts each prompt once (its tokens and cached tokens) and every choice's
generated tokens. Closing the stream (a client disconnect) aborts every choice.

A request's choices are submitted to the engines together, and Serve's router refuses a call
while `max_queued_requests` of the caller's calls already wait for a replica: so a request of
more choices than a phase's `max_queued_requests` could never be served, and is refused with a
400 naming `n` or `prompt` (ChoiceLimit)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from rayinfer.deployments import response_bodies
from rayinfer.deployments.openai_error import OpenAIError
from rayinfer.deployments.phase_config import PhaseConfig
from rayinfer.deployments.replies import HttpReply, sse
from rayinfer.deployments.types import Delta, Timings
from rayinfer.engine.sampling_params import MAX_SEED, SamplingParams

_CHOICE_DONE = object()


@dataclass(frozen=True)
class ChoiceLimit:
    """The most choices one request may ask for, and the config key that sets it."""

    max_choices: int
    key: str

    @classmethod
    def of(cls, phases: dict[str, PhaseConfig]) -> ChoiceLimit:
        """phases: the served phases' configs by name (prefill and decode, or engine)."""
        name = min(phases, key=lambda name: phases[name].max_queued_requests)
        return cls(phases[name].max_queued_requests, f"{name}.max_queued_requests")

    def check(self, num_prompts: int, n: int) -> None:
        """Raise a 400 for a request of num_prompts prompts x n choices past the limit."""
        num_choices = num_prompts * n
        if num_choices <= self.max_choices:
            return
        asked = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
        raise OpenAIError(
            400,
            f"this request asks for {num_choices} choices ({asked}), more than the "
            f"{self.max_choices} this server can run at once ({self.key}); send fewer prompts "
            "or a smaller n per request",
            param="n" if n > 1 else "prompt",
        )


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Each choice's sampling parameters: seed + i where a seed is given, wrapping past
    MAX_SEED to 0 so that any valid seed works with any n."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=(params.seed + i) % (MAX_SEED + 1)) for i in range(n)]


def merged_usage(replies: list[HttpReply], n: int) -> dict:
    """replies: every prompt's n choices, in index order."""
    firsts = replies[::n]  # one per prompt
    return response_bodies.usage_body(
        sum(reply.num_prompt_tokens for reply in firsts),
        sum(reply.num_tokens for reply in replies),
        sum(reply.num_cached_tokens for reply in firsts),
    )


async def whole_of_choices(
    replies: list[HttpReply], runs: list[AsyncIterator[Delta]], timings: list[Timings], n: int
) -> dict:
    """Every choice run to its end, concurrently; the first failure cancels the others. n: the
    choices per prompt."""
    tasks = [
        asyncio.create_task(reply.whole(run, t)) for reply, run, t in zip(replies, runs, timings)
    ]
    try:
        bodies = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    merged = bodies[0]
    merged["choices"] = [body["choices"][0] for body in bodies]
    merged["usage"] = merged_usage(replies, n)
    return merged


async def stream_of_choices(
    replies: list[HttpReply], runs: list[AsyncIterator[Delta]], timings: list[Timings], n: int
) -> AsyncIterator[str]:
    """The choices' chunks as they come (each with its index), then the usage chunk (every
    choice's tokens) and [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(reply: HttpReply, run: AsyncIterator[Delta]) -> None:
        try:
            async for body in reply.choice_events(run):
                await queue.put(body)
        finally:
            await queue.put(_CHOICE_DONE)

    tasks = [asyncio.create_task(pump(reply, run)) for reply, run in zip(replies, runs)]
    try:
        running = len(tasks)
        while running:
            body = await queue.get()
            if body is _CHOICE_DONE:
                running -= 1
                continue
            yield sse(body)
    finally:  # also when the client goes away: every choice's pipeline is closed (aborted)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for event in replies[0].trailer(merged_usage(replies, n), timings[0]):
        yield event
