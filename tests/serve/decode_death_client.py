"""Run by test_server.py inside the test cluster: a Decode replica dies mid-stream.

Streams a long greedy request through the Ingress handle, kills the Decode replica actor after a
few chunks, and reads on: the ingress resumes on a new replica. Prints JSON with the streamed
text and the same request's text when nothing dies.
"""

from __future__ import annotations

import json

import ray
from ray import serve
from ray.util.state import list_actors

from rayinfer.deployments.types import GenerateRequest

PROMPT_IDS = [9, 18, 27, 36, 45, 54, 63]
MAX_TOKENS = 150


def kill_decode_replicas() -> list[str]:
    names = []
    for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
        if actor.class_name.endswith(":Decode") and actor.name:
            ray.kill(ray.get_actor(actor.name, namespace="serve"), no_restart=True)
            names.append(actor.name)
    return names


def main() -> None:
    ray.init(address="auto", log_to_driver=False)
    ingress = serve.get_app_handle("default")
    request = GenerateRequest(
        prompt=PROMPT_IDS, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
    )
    reference = ingress.generate.remote(request).result()
    text, token_ids, killed, finish_reason = "", [], [], None
    for index, chunk in enumerate(ingress.options(stream=True).generate_stream.remote(request)):
        text += chunk.text
        token_ids += chunk.token_ids
        finish_reason = chunk.finish_reason or finish_reason
        if index == 5:
            killed = kill_decode_replicas()
    report = {
        "killed": killed,
        "text": text,
        "token_ids": token_ids,
        "finish_reason": finish_reason,
        "reference_text": reference.text,
        "reference_token_ids": reference.token_ids,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
