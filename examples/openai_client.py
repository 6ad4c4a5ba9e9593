"""Talk to a running rayinfer server with the openai SDK (chat, streamed chat, completion).

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


if __name__ == "__main__":
    main()
