"""The Prefill deployment: batches prompts, computes their KV and first token, hands the KV off.

The KV goes into the object store from the worker that holds it (`WorkerGroup.export_kv`), on the
worker's transfer thread while its next steps run; the `PrefillResult` returns at once with the
export's ObjectRefs nested in its hand-off (they travel by reference, and decode waits for them),
so the first token streams before the copy has finished. The group keeps its own references to
them until decode is done with the KV (workers/export_holds.py: Ray can lose decode's borrow of
refs nested in a Serve reply).
"""

from __future__ import annotations

import time

from ray import serve

from rayinfer.deployments.replica import PhaseReplica
from rayinfer.deployments.types import PrefillRequest, PrefillResult
from rayinfer.engine.stop_checker import streamable_length


@serve.deployment(name="Prefill")
class Prefill(PhaseReplica):
    phase = "prefill"

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        start = time.perf_counter()
        await self.until_gone()  # a request routed here while this replica leaves
        status = "error"
        try:
            result = await self._prefill(request)
            status = "ok"
            return result
        except Exception:
            await self.until_gone()
            raise
        finally:
            self.metrics.count_request(status)
            if status == "ok":
                self.metrics.ttft.observe(time.perf_counter() - start, tags=self.metrics.tags)

    async def _prefill(self, request: PrefillRequest) -> PrefillResult:
        params = request.params
        events = self.loop.generate(request.request_id, request.prompt_token_ids, params, True)
        async for event in events:
            if not event.output.finished:
                continue
            output = event.output
            self.metrics.add_tokens(len(request.prompt_token_ids), len(output.token_ids))
            if event.handoff is not None:  # its seconds: timed by the worker, seen by decode
                self.metrics.kv_handoff_bytes.inc(event.handoff.num_bytes, tags=self.metrics.tags)
            first_text = output.text
            if output.finish_reason == "prefilled":
                first_text = output.text[: streamable_length(output.text, params.stop)]
            return PrefillResult(
                request_id=request.request_id,
                first_token_id=output.token_ids[0],
                first_text=first_text,
                text=output.text,
                finish_reason=None if output.finish_reason == "prefilled" else output.finish_reason,
                handoff=event.handoff,
                num_cached_tokens=output.num_cached_tokens,
                first_logprobs=output.logprobs[0] if output.logprobs else None,
                prompt_logprobs=output.prompt_logprobs,
                stop_reason=output.stop_reason,
            )
        raise RuntimeError(f"prefill of {request.request_id!r} ended without an output")
