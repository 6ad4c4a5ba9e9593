"""The offline engine: generate, chat, and a prefill -> decode hand-off between two engines.

python examples/offline_generate.py [--model tiny|/path/to/checkpoint]
"""

import argparse

from rayinfer import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    llm = LLM(args.model)
    greedy = SamplingParams(max_tokens=24, temperature=0)
    for output in llm.generate(["The capital of France is", "def fibonacci(n):"], greedy):
        print(repr(output.text), output.finish_reason)
    (reply,) = llm.chat([{"role": "user", "content": "Say hello."}], greedy)
    print("chat:", repr(reply.text))
    decode = LLM(args.model)  # in a server, this engine lives in another process or machine
    (handed_off,) = decode.decode(llm.prefill(["Once upon a time"], greedy), greedy)
    print("prefill -> decode:", repr(handed_off.text))


if __name__ == "__main__":
    main()
