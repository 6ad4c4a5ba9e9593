"""The Engine deployment (`disaggregate=false`): prefill and decode colocated in one engine.

Each replica runs whole requests as the offline `LLM` does: new prompts' prefill chunks and the
running requests' decodes batch into mixed steps, and no KV leaves the replica. It streams the
same `DecodeChunk`s a Decode replica does, the first one carrying the first token.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ray import serve

from rayinfer.deployments.replica import PhaseReplica
from rayinfer.deployments.types import DecodeChunk, EngineRequest


@serve.deployment(name="Engine")
class Engine(PhaseReplica):
    phase = "engine"

    async def generate(self, request: EngineRequest) -> AsyncIterator[DecodeChunk]:
        async for chunk in self.counted(self._generate(request)):
            yield chunk

    async def _generate(self, request: EngineRequest) -> AsyncIterator[DecodeChunk]:
        prompt_ids = request.prompt_token_ids
        events = self.loop.generate(request.request_id, prompt_ids, request.params, False)
        last = arrival = time.perf_counter()
        is_first = True
        async for event in events:
            output = event.output
            now = time.perf_counter()
            chunk = DecodeChunk(output.new_text, output.new_token_ids, output.finish_reason,
                                new_logprobs=output.new_logprobs,
                                stop_reason=output.stop_reason)  # fmt: skip
            if is_first:
                chunk.prompt_logprobs = output.prompt_logprobs
                chunk.num_cached_tokens = output.num_cached_tokens
                self.metrics.ttft.observe(now - arrival, tags=self.metrics.tags)
                is_first = False
            else:
                self.metrics.observe_token_gap(now - last, len(output.new_token_ids))
            last = now
            if output.finished:
                self.metrics.add_tokens(len(prompt_ids), len(output.token_ids))
            yield chunk
