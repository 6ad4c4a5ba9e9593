"""The soak's load: clients that keep greedy completions going against the server, each outcome
kept with when it began and ended.

A request is `ok` (a 200 whose stream ended with `[DONE]`, or a whole reply), `error` (an HTTP
error status, or an error event in the stream), `lost` (the connection broke or the stream ended
without `[DONE]`) or `hung` (no end within the client's timeout).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass

import aiohttp

PROMPTS = (
    "The quick brown fox",
    "Once upon a time there was",
    "Rivers run to the sea and",
    "In the beginning the engineers",
    "A million tokens of context",
    "Seven experts were routed",
    "The cache was handed off",
    "Every request gets an answer",
)


@dataclass
class Outcome:
    prompt: int  # index into PROMPTS
    stream: bool
    status: str  # ok | error | lost | hung
    detail: str  # the HTTP status, or the error's message
    text: str
    began: float  # time.monotonic()
    ended: float

    @property
    def latency_s(self) -> float:
        return self.ended - self.began

    def to_json(self) -> dict:
        return asdict(self)


def request_body(model: str, prompt: int, max_tokens: int, stream: bool) -> dict:
    return {"model": model, "prompt": PROMPTS[prompt], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}  # fmt: skip


async def _streamed(response: aiohttp.ClientResponse) -> tuple[str, str, str]:
    text = ""
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return "ok", "200", text
        event = json.loads(line[len("data: ") :])
        if "error" in event:
            return "error", str(event["error"].get("message", ""))[:200], text
        text += "".join(choice.get("text", "") for choice in event.get("choices", []))
    return "lost", "the stream ended without [DONE]", text


async def _request(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[str, str, str]:
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            return "error", f"{response.status} {(await response.text())[:200]}", ""
        if body["stream"]:
            return await _streamed(response)
        reply = await response.json()
        return "ok", "200", reply["choices"][0]["text"]


async def complete(
    session: aiohttp.ClientSession, url: str, body: dict, timeout_s: float
) -> tuple[str, str, str]:
    """(status, detail, text) of one request."""
    try:
        return await asyncio.wait_for(_request(session, url, body), timeout_s)
    except asyncio.TimeoutError:
        return "hung", f"no end within {timeout_s:.0f}s", ""
    except (aiohttp.ClientError, ConnectionError) as error:
        return "lost", type(error).__name__, ""


@dataclass
class Load:
    """`clients` loops, each sending its next request when the last ended, until stopped; three
    of four requests are streamed."""

    url: str
    model: str
    clients: int = 16
    max_tokens: int = 48
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def one(self, session: aiohttp.ClientSession, prompt: int, stream: bool) -> Outcome:
        began = time.monotonic()
        body = request_body(self.model, prompt, self.max_tokens, stream)
        status, detail, text = await complete(session, self.url, body, self.timeout_s)
        return Outcome(prompt, stream, status, detail, text, began, time.monotonic())

    async def _client(self, index: int) -> None:
        connector = aiohttp.TCPConnector(limit=1, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as session:
            sent = index
            while not self._stop.is_set():
                stream = sent % 4 != 3
                self.outcomes.append(await self.one(session, sent % len(PROMPTS), stream))
                sent += self.clients

    def start(self) -> None:
        self._stop.clear()
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]

    async def stop(self) -> None:
        """Stop sending; returns when every request in flight has ended."""
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def ended_ok_since(self, since: float) -> int:
        return sum(o.status == "ok" and o.began >= since for o in self.outcomes)


async def references(url: str, model: str, max_tokens: int, timeout_s: float) -> list[str]:
    """Each prompt's greedy text on the quiet server, one request at a time."""
    load = Load(url, model, max_tokens=max_tokens, timeout_s=timeout_s)
    texts = []
    async with aiohttp.ClientSession() as session:
        for prompt in range(len(PROMPTS)):
            outcome = await load.one(session, prompt, stream=False)
            if outcome.status != "ok":
                raise RuntimeError(f"the quiet server failed prompt {prompt}: {outcome.detail}")
            texts.append(outcome.text)
    return texts
