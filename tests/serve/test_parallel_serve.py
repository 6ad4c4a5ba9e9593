"""`serve run rayinfer.app:build prefill.tp=2 decode.dp=2 decode.ep=2` on CPU: prefill splits
heads over two workers, decode runs two data-parallel attention replicas whose experts exchange
tokens (through shared host memory, `decode.all_to_all.transport=host`, as on GPUs without
peer-to-peer), and the KV hands off between the two layouts; answers equal the offline
engine's."""

from __future__ import annotations

import openai
import pytest

import rayinfer
from rayinfer.bench.polling import wait_for

pytestmark = pytest.mark.slow

APP_ARGS = [
    "max_model_len=256",
    "prefill.tp=2",
    "decode.dp=2",
    "decode.ep=2",
    "decode.all_to_all.transport=host",
]


@pytest.fixture(scope="module")
def server(serve_app):
    """Its own app (a new `serve run`) on the cluster shared through tests/serve/conftest.py,
    which has the 6 CPUs that two prefill workers, two decode workers and the replicas take.
    The apps before it (colocated, new families, overload) run one worker a replica: no
    all-to-all is metered before this one's."""
    return serve_app(APP_ARGS)


def test_parallel_plans_answer_like_the_offline_engine(server):
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", timeout=120)
    prompts = ["The quick brown fox", "Once upon a time", "In the beginning"]
    offline = rayinfer.LLM("tiny", device="cpu", max_model_len=256)
    params = rayinfer.SamplingParams(max_tokens=10, temperature=0)
    expected = [o.text for o in offline.generate(prompts, params)]
    answers = [
        client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0)
        for p in prompts
    ]
    assert [a.choices[0].text for a in answers] == expected
    assert server.running_replicas("Prefill") == 1 and server.running_replicas("Decode") == 1
    # Decode's two DP replicas exchanged tokens with their experts through host memory: the
    # all-to-all is metered, tagged with the transport it used.
    wait_for(
        lambda: (
            'transport="host"' in server.metrics_text()
            and server.metric_sum("ray_rayinfer_all_to_all_bytes_total") > 0
        ),
        timeout_s=60,
        what="all-to-all bytes in Prometheus",
    )
