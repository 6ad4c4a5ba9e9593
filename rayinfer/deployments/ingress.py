"""The Ingress deployment: the OpenAI-compatible HTTP API and the Python-handle API.

It tokenizes (applying the chat template), checks the request against the model, runs it through
Prefill then Decode, or through one colocated Engine (deployments/pipeline.py), and streams the
detokenized text as SSE or returns it whole. vLLM's /tokenize and /detokenize it answers with
its tokenizer alone (deployments/tokenization.py).
"""

import asyncio
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from rayinfer.deployments import response_bodies, tokenization
from rayinfer.deployments.admission import Admission
from rayinfer.deployments.chat_reasoning import ChatReasoning
from rayinfer.deployments.choices import (
    ChoiceLimit,
    choice_params,
    stream_of_choices,
    whole_of_choices,
)
from rayinfer.deployments.config import AppConfig
from rayinfer.deployments.errors import as_openai_error
from rayinfer.deployments.metrics import ServeMetrics
from rayinfer.deployments.openai_error import ErrorBody, OpenAIError
from rayinfer.deployments.pipeline import (
    ColocatedPipeline,
    DisaggregatedPipeline,
    Pipeline,
    first_delta,
    prepend,
)
from rayinfer.deployments.prompts import PromptBuilder
from rayinfer.deployments.protocol import ChatCompletionRequest, CompletionRequest
from rayinfer.deployments.replies import HttpReply, unparsable_body, validation_to_openai
from rayinfer.deployments.resume import TextRules
from rayinfer.deployments.runtime import ModelSource
from rayinfer.deployments.types import GenerateChunk, GenerateRequest, GenerateResponse, Timings
from rayinfer.engine.stop_checker import eos_token_ids

app = FastAPI(title="rayinfer", description="OpenAI-compatible API over MoE engines on Ray Serve")


REQUIRED_FIELDS = {
    "/v1/chat/completions": "messages",
    "/v1/completions": "prompt",
    "/tokenize": "prompt",
    "/detokenize": "tokens",
}


def error_responses(*statuses: int) -> dict:
    """The OpenAPI entries of a route's error answers: each carries the OpenAI error body. "4XX"
    also stands in for FastAPI's 422, which this server never answers (a bad body is a 400)."""
    why = {
        400: "a field is invalid; `error.param` names it",
        404: "an unknown model (`error.code` model_not_found) or route",
        500: "the request failed on the server; the log has it under `error.request_id`",
        503: "overloaded or a replica is being replaced: retry after the Retry-After header",
        "4XX": "any other client error",
    }
    return {status: {"model": ErrorBody, "description": why[status]}
            for status in (*statuses, "4XX")}  # fmt: skip


GENERATION_RESPONSES = {
    200: {
        "description": "the completion as JSON, or with `stream: true` server-sent events "
        "(`data: {chunk}` lines, then `data: [DONE]`)",
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
    },
    **error_responses(400, 404, 500, 503),
}


def request_id_of(request: Request) -> str:
    """The id a request's reply, error body and log lines carry: the completion's id once the
    route made one, else one made here (a body refused before the route ran)."""
    if getattr(request.state, "request_id", None) is None:
        request.state.request_id = f"req-{uuid.uuid4().hex}"
    return request.state.request_id


def error_response(error: OpenAIError) -> JSONResponse:
    """The error body (its request_id in it: Serve's proxy sets the X-Request-Id header)."""
    retry_after_s = error.retry_after_s or 1
    headers = {"Retry-After": str(retry_after_s)} if error.status == 503 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


@app.exception_handler(OpenAIError)
async def _openai_error(request: Request, error: OpenAIError) -> JSONResponse:
    if error.request_id is None:
        error.request_id = request_id_of(request)
    return error_response(error)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and methods answer with the OpenAI error body too; a body FastAPI could
    not decode (its 400 caused by the decoder's error) says why."""
    detail = f"{error.detail}"
    if error.status_code == 400 and error.__cause__ is not None:
        detail = unparsable_body(error.__cause__)
    answer = OpenAIError(error.status_code, detail, request_id=request_id_of(request))
    return error_response(answer)


@app.exception_handler(RequestValidationError)
async def _invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
    body_field = REQUIRED_FIELDS.get(request.url.path, "body")
    return error_response(validation_to_openai(error.errors(), body_field, request_id_of(request)))


@app.exception_handler(Exception)
async def _unexpected(request: Request, error: Exception) -> JSONResponse:
    """Anything a route let through: a clean 500, the traceback in the log."""
    return error_response(as_openai_error(error, request_id_of(request)))


@serve.deployment(name="Ingress")
@serve.ingress(app)
class Ingress:
    def __init__(
        self,
        config: dict,
        source: ModelSource,
        prefill: DeploymentHandle | None = None,
        decode: DeploymentHandle | None = None,
        engine: DeploymentHandle | None = None,
    ):
        """Disaggregated: the prefill and decode handles; colocated: the engine's alone."""
        self.config = AppConfig.model_validate(config)
        self.source = source
        self.metrics = ServeMetrics("ingress")
        self.prompts = PromptBuilder(source)
        batching = self.config.engine if engine is not None else self.config.decode
        admission = Admission(
            self.config.ingress.max_queue_wait_s, parallelism=batching.max_num_seqs
        )
        phases = ("engine",) if engine is not None else ("prefill", "decode")
        self.choice_limit = ChoiceLimit.of({name: getattr(self.config, name) for name in phases})
        wait_s = self.config.ingress.max_replica_wait_s
        self.pipeline: Pipeline = (
            ColocatedPipeline(engine, self.metrics, admission, wait_s)
            if engine is not None
            else DisaggregatedPipeline(prefill, decode, self.metrics, admission, wait_s)
        )
        tokenizer = self.prompts.tokenizer
        if tokenizer is not None:  # without one there is no text to keep
            stops = frozenset(eos_token_ids(source.model_config, tokenizer))
            self.pipeline.text_rules = TextRules(tokenizer, stops, source.max_model_len)
        parser = self.config.reasoning_parser  # chat replies' reasoning (chat_reasoning.py)
        self.reasoning = ChatReasoning(parser, tokenizer) if parser and tokenizer else None

    # --- HTTP --------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @app.get("/v1/models", response_model=response_bodies.ModelList)
    async def models(self) -> dict:
        return response_bodies.models_body(self.source.served_model_name, self.source.max_model_len)

    @app.get(
        "/v1/models/{model_id:path}",
        response_model=response_bodies.ModelCard,
        responses=error_responses(404),
    )
    async def model(self, model_id: str) -> response_bodies.ModelCard:
        self._check_model(model_id)
        return response_bodies.ModelCard(id=model_id, max_model_len=self.source.max_model_len)

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(self, request: ChatCompletionRequest, http: Request):
        return await self._serve_http(request, http, "chatcmpl", chat=True)

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(self, request: CompletionRequest, http: Request):
        return await self._serve_http(request, http, "cmpl", chat=False)

    @app.post(
        "/tokenize",
        response_model=tokenization.TokenizeResponse,
        responses=error_responses(400, 404, 500),
    )
    async def tokenize(self, request: tokenization.TokenizeRequest, http: Request):
        """A text's or a conversation's token ids, as a completion or chat would prompt."""
        http.state.request_id = f"tokn-{uuid.uuid4().hex}"
        self._check_model(request.model)
        return await asyncio.to_thread(tokenization.tokenize, self.prompts, request)

    @app.post(
        "/detokenize",
        response_model=tokenization.DetokenizeResponse,
        responses=error_responses(400, 404, 500),
    )
    async def detokenize(self, request: tokenization.DetokenizeRequest, http: Request):
        http.state.request_id = f"tokn-{uuid.uuid4().hex}"
        self._check_model(request.model)
        return await asyncio.to_thread(tokenization.detokenize, self.prompts, request)

    async def _serve_http(self, request, http: Request, id_prefix: str, chat: bool):
        request_id = http.state.request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        try:
            return await self._reply(request, request_id, chat)
        except Exception as error:
            raise as_openai_error(error, request_id) from error

    async def _reply(self, request, request_id: str, chat: bool):
        self._check_model(request.model)
        # One request per prompt of a completions batch, each checked and tokenized like a
        # single prompt; off the event loop: a long text encodes without the GIL.
        singles = [request] if chat else [request.for_prompt(p) for p in request.prompts]
        self.choice_limit.check(len(singles), request.n)
        built = await asyncio.to_thread(lambda: [self.prompts.build(one) for one in singles])
        model = self.source.served_model_name
        start = self._reasoning_start(request, built[0][0]) if chat else None
        if request.n > 1 or len(singles) > 1:
            return await self._serve_choices(request, request_id, singles, built, chat, start)
        (prompt_ids, params), request = built[0], singles[0]
        timings = Timings()
        deltas = self.pipeline.run(request_id, prompt_ids, params, timings)
        echo_text, formats = self._echo_text(request, prompt_ids), self.prompts.tool_call_formats
        reply = HttpReply(request_id, model, chat, request, len(prompt_ids), 0, echo_text, formats,
                          start)  # fmt: skip
        if request.stream:
            first = await first_delta(deltas)
            events = reply.stream(prepend(first, deltas), timings)
            return StreamingResponse(events, media_type="text/event-stream")
        return JSONResponse(await reply.whole(deltas, timings))

    async def _serve_choices(self, request, request_id, singles, built, chat: bool, start=None):
        """n > 1 or a batch of prompts: one pipeline run per choice of each prompt, index
        prompt * n + choice (deployments/choices.py). A stream starts once every choice has
        its first token, so that overload still answers 503 up front. The choices are admitted
        together (deployments/admission.py): all or none. start: a chat's reasoning start."""
        waiters = self.pipeline.admit(len(singles) * request.n)
        try:
            return await self._run_choices(
                request, request_id, singles, built, chat, waiters, start
            )
        except BaseException:
            for waiter in waiters:  # the choices that never ran give their places back
                waiter.leave()
            raise

    async def _run_choices(self, request, request_id, singles, built, chat, waiters, start=None):
        """Each choice's run, in its place among the admitted (`waiters`, by index)."""
        model, n = self.source.served_model_name, request.n
        formats = self.prompts.tool_call_formats
        runs, replies, timings = [], [], []
        for single, (prompt_ids, params) in zip(singles, built):
            echo_text = self._echo_text(single, prompt_ids)
            for choice in choice_params(params, n):
                index = len(runs)
                timings.append(Timings())
                runs.append(self.pipeline.run(f"{request_id}-{index}", prompt_ids, choice,
                                              timings[-1], waiters[index]))  # fmt: skip
                replies.append(HttpReply(request_id, model, chat, request, len(prompt_ids),
                                         index, echo_text, formats, start))  # fmt: skip
        if not request.stream:
            return JSONResponse(await whole_of_choices(replies, runs, timings, n))
        firsts = await asyncio.gather(*(first_delta(run) for run in runs), return_exceptions=True)
        failed = [first for first in firsts if isinstance(first, BaseException)]
        if failed:
            for run in runs:
                await run.aclose()
            raise failed[0]
        started = [prepend(first, run) for first, run in zip(firsts, runs)]
        events = stream_of_choices(replies, started, timings, n)
        return StreamingResponse(events, media_type="text/event-stream")

    def _reasoning_start(self, request, prompt_ids: list[int]) -> str | None:
        """How a chat reply starts under the reasoning parser (None: no parser), or a 400 for a
        structured output beside reasoning (deployments/chat_reasoning.py)."""
        return self.reasoning.start_of(request, prompt_ids) if self.reasoning else None

    def _echo_text(self, request, prompt_ids: list[int]) -> str:
        """The prompt as text for completions' `echo`: as sent, or its token ids decoded."""
        if not getattr(request, "echo", False):
            return ""
        if isinstance(request.prompt, str):
            return request.prompt
        tokenizer = self.prompts.tokenizer
        return tokenizer.decode(prompt_ids) if tokenizer is not None else ""

    def _check_model(self, model: str | None) -> None:
        served = self.source.served_model_name
        if model is not None and model != served:
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist; this server serves `{served}`",
                param="model",
                code="model_not_found",
            )

    # --- Python handles ----------------------------------------------------------------------
    async def generate(self, request: GenerateRequest | dict) -> GenerateResponse:
        """Run a request to its end: `handle.generate.remote(GenerateRequest(prompt=..., ...))`."""
        request_id = f"gen-{uuid.uuid4().hex}"
        prompt_ids, params, timings = self._handle_request(request)
        text, token_ids, finish_reason, stop_reason = "", [], None, None
        logprobs = [] if params.logprobs is not None else None
        async for delta in self.pipeline.run(request_id, prompt_ids, params, timings):
            text += delta.text
            token_ids += delta.token_ids
            if delta.finish_reason is not None:
                finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
            if logprobs is not None:
                logprobs += delta.logprobs or []
        return GenerateResponse(
            request_id, text, token_ids, len(prompt_ids), finish_reason, timings.as_dict(),
            logprobs, stop_reason,
        )  # fmt: skip

    async def generate_stream(
        self, request: GenerateRequest | dict
    ) -> AsyncIterator[GenerateChunk]:
        """Stream a request: `handle.options(stream=True).generate_stream.remote(...)`."""
        request_id = f"gen-{uuid.uuid4().hex}"
        prompt_ids, params, timings = self._handle_request(request)
        async for delta in self.pipeline.run(request_id, prompt_ids, params, timings):
            yield GenerateChunk(
                request_id, delta.text, delta.token_ids, delta.finish_reason, delta.logprobs,
                delta.stop_reason,
            )  # fmt: skip

    def _handle_request(self, request: GenerateRequest | dict):
        if isinstance(request, dict):
            try:
                request = GenerateRequest.model_validate(request)
            except ValidationError as error:
                raise ValueError(validation_to_openai(error.errors()).message) from None
        prompt_ids, params = self.prompts.build(request)
        return prompt_ids, params, Timings()
