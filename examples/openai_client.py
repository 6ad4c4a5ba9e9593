"""Talk to a running rayinfer server with the openai SDK (chat, streamed chat, completion,
log-probabilities, several choices, and scoring a continuation as an eval harness does).

serve run rayinfer.app:build
python examples/openai_client.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused")

    messages = [{"role": "user", "content": "Write one sentence about rivers."}]
    reply = client.chat.completions.create(
        model=args.model, messages=messages, max_tokens=32, temperature=0
    )
    print("chat:", reply.choices[0].message.content, reply.usage)

    print("stream: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=args.model, messages=messages, max_tokens=32, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()

    completion = client.completions.create(
        model=args.model, prompt="Once upon a time", max_tokens=16, temperature=0.7, seed=1
    )
    print("completion:", completion.choices[0].text)

    scored = client.chat.completions.create(
        model=args.model, messages=messages, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    for item in scored.choices[0].logprobs.content:
        others = ", ".join(f"{t.token!r} {t.logprob:.2f}" for t in item.top_logprobs)
        print(f"  {item.token!r} {item.logprob:.2f} (top: {others})")

    choices = client.completions.create(
        model=args.model, prompt="Once upon a time", max_tokens=8, temperature=0.9, seed=7, n=3
    )
    for choice in choices.choices:
        print(f"choice {choice.index}:", choice.text)

    # The log-likelihood of a continuation, as eval harnesses ask for it: echo the prompt with
    # its tokens' log-probabilities (the last token is the one generated) and sum those of the
    # continuation's tokens, counted as the full prompt's tokens beyond the context's.
    def echo(prompt: str):
        reply = client.completions.create(
            model=args.model, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True
        )
        return reply.choices[0].logprobs

    context, continuation = "The capital of France is", " Paris"
    context_tokens = len(echo(context).tokens) - 1
    full = echo(context + continuation)
    score = sum(full.token_logprobs[context_tokens:-1])
    print(f"log-likelihood of {continuation!r} after {context!r}: {score:.2f}")


if __name__ == "__main__":
    main()
