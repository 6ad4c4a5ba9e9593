"""Requests with `n` > 1, or a batch of prompts: one pipeline run per choice, merged into one
OpenAI reply. Prompt p's choice i has index p * n + i, as OpenAI numbers them.

Choice i samples with `seed + i` (modulo 2**63) when the request gives a seed (reproducible, and
different per choice), else with its own random generator; the prompt is the same, so prefill serves
the later choices from its prefix cache where the first one's blocks are already computed. Whole:
the choices in index order, usage counting the prompt once and every choice's tokens. Stream: one
SSE stream whose chunks carry their choice's `index`, interleaved as they come, then one usage chunk
and [DONE]. Usage counts each prompt once (its tokens and cached tokens) and every choice's
generated tokens. Closing the stream (a client disconnect) aborts every choice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from rayinfer.deployments import response_bodies
from rayinfer.deployments.replies import HttpReply, sse
from rayinfer.deployments.types import Delta, Timings
from rayinfer.engine.sampling_params import MAX_SEED, SamplingParams

_CHOICE_DONE = object()


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
