"""What prefill hands decode: the engine's side of a request's KV hand-off.

The KV itself travels as a KVPayload (workers/runner/kv_transfer.py), made and read by the
workers; the engine passes it on without looking inside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class KVHandoff:
    """What prefill gives decode: the prompt, the first token and where the KV lives.

    `payload` is a KVPayload in-process, or the exporting executor's reference to one in the Ray
    object store (a WorkerGroup's `KVRefs`, possibly still being written); decode resolves it
    from its own workers.
    """

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    payload: Any  # None when the request already finished at its first token
    num_bytes: int = 0
    finish_reason: str | None = None  # set when there is nothing left to decode
    first_token_logprobs: Any = None  # outputs.TokenLogprobs when the request asked for them
    stop_reason: int | str | None = None  # with finish_reason "stop": RequestOutput's
    # The prefill's outputs.RequestOutput where the request finished at its first token (its
    # text, logprobs and prompt logprobs), which decode returns as it is; None otherwise.
    finished_output: Any = None
