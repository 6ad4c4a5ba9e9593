"""What a running server must answer at temperature 0: the offline `rayinfer.LLM`'s text, for
several prompts, over completions and chat, streamed and whole (both serving modes)."""

from __future__ import annotations

import openai

PROMPTS = ("The quick brown fox", "Once upon a time there was", "Rivers run to the sea and")
CONVERSATIONS = (
    [{"role": "user", "content": "Tell me about the river."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
)
MAX_TOKENS = 12


def offline_replies(model: str = "tiny", **llm_args) -> dict:
    """{"completions": [(text, finish_reason)], "chat": [...]} from the offline engine."""
    import rayinfer

    llm = rayinfer.LLM(model, max_model_len=256, **llm_args)
    params = rayinfer.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    completions = llm.generate(list(PROMPTS), params)
    chats = [llm.chat(messages, params)[0] for messages in CONVERSATIONS]
    return {
        "completions": [(o.text, o.finish_reason) for o in completions],
        "chat": [(o.text, o.finish_reason) for o in chats],
    }


def served_replies(http_url: str, model: str = "tiny", stream: bool = False) -> dict:
    """The same requests over HTTP with the openai client, one at a time."""
    client = openai.OpenAI(base_url=http_url + "/v1", api_key="unused", timeout=120)
    common = dict(model=model, max_tokens=MAX_TOKENS, temperature=0, stream=stream)
    completions = [
        _completion(client.completions.create(prompt=prompt, **common), stream)
        for prompt in PROMPTS
    ]
    chats = [
        _chat(client.chat.completions.create(messages=messages, **common), stream)
        for messages in CONVERSATIONS
    ]
    return {"completions": completions, "chat": chats}


def _completion(reply, stream: bool) -> tuple[str, str]:
    if not stream:
        return reply.choices[0].text, reply.choices[0].finish_reason
    text, finish_reason = "", None
    for chunk in reply:
        for choice in chunk.choices:
            text += choice.text
            finish_reason = choice.finish_reason or finish_reason
    return text, finish_reason


def _chat(reply, stream: bool) -> tuple[str, str]:
    if not stream:
        return reply.choices[0].message.content, reply.choices[0].finish_reason
    text, finish_reason = "", None
    for chunk in reply:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish_reason = choice.finish_reason or finish_reason
    return text, finish_reason


def metric_samples(metrics_text: str, name: str, **tags: str) -> list[float]:
    """Every sample of a Prometheus metric whose labels include `tags`."""
    wanted = [f'{key}="{value}"' for key, value in tags.items()]
    values = []
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") and all(tag in line for tag in wanted):
            values.append(float(line.rsplit(" ", 1)[1]))
    return values
