"""The Decode deployment: pulls each hand-off's KV into its paged cache and streams tokens.

Many streams batch continuously in one engine. A hand-off whose KV is gone (its owner died) is
recomputed from the prompt by the engine; the request still completes and a metric counts it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ray import serve

from rayinfer.deployments.replica import PhaseReplica
from rayinfer.deployments.types import DecodeChunk, DecodeRequest


@serve.deployment(name="Decode")
class Decode(PhaseReplica):
    phase = "decode"

    async def generate(self, request: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        async for chunk in self.counted(self._generate(request)):
            yield chunk

    async def _generate(self, request: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        handoff = request.prefill.handoff
        is_first = True
        last = time.perf_counter()
        async for event in self.loop.continue_prefilled(handoff, request.params):
            output = event.output
            now = time.perf_counter()
            chunk = DecodeChunk(output.new_text, output.new_token_ids, output.finish_reason,
                                new_logprobs=output.new_logprobs,
                                stop_reason=output.stop_reason)  # fmt: skip
            if is_first:
                stats = self.workers.stats
                chunk.kv_import_s = stats.import_seconds.pop(handoff.request_id, 0.0)
                chunk.kv_timings = stats.handoff_timings.pop(handoff.request_id, None)
                chunk.was_recomputed = handoff.request_id in stats.lost_request_ids
                stats.lost_request_ids.discard(handoff.request_id)
                if chunk.kv_timings:  # the export, timed by the prefill worker that ran it
                    self.metrics.observe_handoff(chunk.kv_import_s, chunk.kv_timings["path"])
                    export = chunk.kv_timings["export"]
                    self.metrics.observe_handoff(
                        export.get("export_s", 0.0), export.get("path", ""), phase="prefill"
                    )
                is_first = False
            else:
                self.metrics.observe_token_gap(now - last, len(output.new_token_ids))
            last = now
            if output.finished:
                self.metrics.add_tokens(0, len(output.token_ids) - 1)
            yield chunk
