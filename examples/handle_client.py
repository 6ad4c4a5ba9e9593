"""Call a running rayinfer app from Python through Serve deployment handles (no HTTP).

    serve run rayinfer.app:build          # in one terminal
    python examples/handle_client.py      # in another (RAY_ADDRESS if the cluster is remote)

Prints one whole generation and one streamed generation, then `ok` as JSON for scripts.
"""

from __future__ import annotations

import argparse
import json

import ray
from ray import serve

from rayinfer.deployments.types import GenerateRequest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--app", default="default", help="Serve application name")
    parser.add_argument("--prompt", default="The quick brown fox")
    parser.add_argument("--max-tokens", type=int, default=12)
    args = parser.parse_args()

    ray.init(address="auto", log_to_driver=False)
    handle = serve.get_app_handle(args.app)  # the Ingress deployment
    request = GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens, temperature=0)

    whole = handle.generate.remote(request).result()
    print(f"whole:    {whole.text!r} ({len(whole.token_ids)} tokens, {whole.finish_reason})")

    streamed = ""
    for chunk in handle.options(stream=True).generate_stream.remote(request):
        streamed += chunk.text
    print(f"streamed: {streamed!r}")

    chat = GenerateRequest(
        messages=[{"role": "user", "content": "Hello!"}], max_tokens=args.max_tokens, temperature=0
    )
    reply = handle.generate.remote(chat).result()
    print(f"chat:     {reply.text!r}")

    # Each generated token's log-probability and its 2 most likely alternatives.
    scored = GenerateRequest(prompt=args.prompt, max_tokens=4, temperature=0, logprobs=2)
    scores = handle.generate.remote(scored).result().logprobs
    for entry in scores:
        others = ", ".join(f"{t.token!r} {t.logprob:.2f}" for t in entry.top)
        print(f"  {entry.chosen.token!r} {entry.chosen.logprob:.2f}  (top: {others})")
    print(
        json.dumps(
            {
                "whole": whole.text,
                "streamed": streamed,
                "chat": reply.text,
                "num_tokens": len(whole.token_ids),
                "logprobs": [entry.chosen.logprob for entry in scores],
            }
        )
    )


if __name__ == "__main__":
    main()
