"""The OpenAI-compatible HTTP API over a loaded `LLM`: `create_app(llm)` returns a FastAPI app.

POST /v1/chat/completions, POST /v1/completions (streamed as server-sent events with "stream": true),
GET /v1/models, GET /health, GET /metrics (Prometheus). Every request shares one engine, stepped by an
`EngineWorker` thread; a client that goes away cancels its request. Errors use OpenAI's error object, with the
code and status `jaxllama.protocol.errors` gives the failure's class: 400 for an invalid request, 429 when the
queue is full, 503 when the engine is not running.

One request's way through: `OpenAIHandlers.completion` -> `RequestPipeline.prepare` (checked fields, prompt token
ids) -> `RequestStream` (the engine thread's queue) -> its events, collected into one answer or sent as they come
(`_sse`); whatever it raises on the way is answered by `_refusal`.

    import uvicorn
    from jaxllama import LLM
    from jaxllama.server.app import create_app
    uvicorn.run(create_app(LLM.load()), port=8000)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxllama.engine.request import SamplingParams
from jaxllama.errors import ClientClosed, EngineUnavailable, InvalidRequest, QueueFull
from jaxllama.protocol import answers, errors, responses
from jaxllama.protocol.logprobs import piece_logprobs
from jaxllama.protocol.pipeline import PreparedRequest, RequestPipeline
from jaxllama.protocol.requests import ENDPOINTS, lone_surrogate_text
from jaxllama.results import Event, Result
from jaxllama.server.metrics import Metrics
from jaxllama.server.worker import EngineWorker, RequestStream

JSONObject = Annotated[dict[str, Any], Body()]

log = logging.getLogger(__name__)

# What a request can fail with before its answer starts: its body, its encoding or the engine's checks
# (ValueErrors), a full queue, a stopped engine, a client gone.
REFUSALS = (ValueError, QueueFull, EngineUnavailable, ClientClosed)


def create_app(
    llm,
    *,
    model_name: str | None = None,
    max_queue: int = 256,
    max_tokens: int | None = None,
) -> FastAPI:
    """An app serving `llm` (a `jaxllama.LLM`). The engine thread starts and stops with the app (its lifespan).

    model_name: the name /v1/models lists and answers echo (default: the checkpoint folder's name); the
        "model" field of requests is accepted whatever it says.
    max_queue: samples (prompts x n) waiting for a slot at most; a request beyond is answered 429.
    max_tokens: tokens per answer when a request does not say (default: up to the context limit).
    """
    metrics = Metrics()
    worker = EngineWorker(llm.loop, slots=llm.slots, max_queue=max_queue, metrics=metrics)
    metrics.watch_load(lambda: worker.running, lambda: worker.waiting)
    pipeline = RequestPipeline(llm.prompts, SamplingParams(max_tokens=max_tokens or llm.max_context))
    handlers = OpenAIHandlers(llm, model_name or llm.name, pipeline, worker, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = FastAPI(title="jaxllama", summary="OpenAI-compatible API for Llama-family models in JAX", lifespan=lifespan)
    app.state.llm, app.state.worker, app.state.metrics, app.state.model_name = llm, worker, metrics, handlers.name
    app.post(ENDPOINTS["chat"])(handlers.chat_completions)
    app.post(ENDPOINTS["completion"])(handlers.completions)
    app.get("/v1/models")(handlers.models)
    app.post("/tokenize")(handlers.tokenize)
    app.post("/detokenize")(handlers.detokenize)
    app.get("/tokenizer_info")(handlers.tokenizer_info)
    app.get("/health")(handlers.health)
    app.get("/metrics")(handlers.prometheus)
    _install_error_handlers(app)
    return app


class OpenAIHandlers:
    """The endpoints' handlers, over one engine thread (`worker`) shared by every request."""

    def __init__(self, llm, name: str, pipeline: RequestPipeline, worker: EngineWorker, metrics: Metrics):
        self.llm, self.name, self.pipeline, self.worker, self.metrics = llm, name, pipeline, worker, metrics
        self.created = int(time.time())

    async def chat_completions(self, request: Request, body: JSONObject) -> Response:
        """Answer a conversation ("messages"), whole or streamed."""
        return await self.completion(request, body, "chat")

    async def completions(self, request: Request, body: JSONObject) -> Response:
        """Continue a text ("prompt"), whole or streamed."""
        return await self.completion(request, body, "completion")

    async def models(self) -> dict:
        """The one model served."""
        card = {"id": self.name, "object": "model", "created": self.created, "owned_by": "jaxllama"}
        card["max_model_len"] = self.llm.max_context
        return {"object": "list", "data": [card]}

    async def tokenize(self, body: JSONObject) -> JSONResponse:
        """vLLM's /tokenize: {"prompt", "add_special_tokens" (BOS as the model adds it; default true)} -> {"tokens",
        "count", "max_model_len"}. With /detokenize and /tokenizer_info, what lm-evaluation-harness's "remote"
        tokenizer asks for."""
        prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
        if not isinstance(prompt, str) or not isinstance(special, bool):
            return _refusal(InvalidRequest("prompt: must be a string; add_special_tokens: true or false"), "completion")
        surrogate = lone_surrogate_text({"prompt": prompt})
        if surrogate is not None:
            return _refusal(InvalidRequest(surrogate[2], "prompt"), "completion")
        tokenizer = self.llm.tokenizer  # special-token text becomes its id, as HF tokenizers (and vLLM) read it
        # On a thread: a long text takes seconds, which would hold every other request (and /health) on the loop.
        encode = functools.partial(tokenizer.encode, add_bos=special and tokenizer.add_bos, allow_special=True)
        tokens = await asyncio.to_thread(encode, prompt)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": self.llm.max_context})

    async def detokenize(self, body: JSONObject) -> JSONResponse:
        """vLLM's /detokenize: {"tokens"} -> {"prompt"}."""
        tokens = body.get("tokens")
        try:
            if not isinstance(tokens, list):
                raise InvalidRequest("tokens: must be a list of token ids", "tokens")
            return JSONResponse({"prompt": self.llm.decode(tokens)})
        except ValueError as e:
            return _refusal(e, "completion")

    async def tokenizer_info(self) -> dict:
        """The special tokens and the chat template (vLLM's /tokenizer_info)."""
        tokenizer = self.llm.tokenizer
        return {
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "pad_token": None,
            "chat_template": self.llm.template.source,
            "model_max_length": self.llm.max_context,
        }

    async def health(self) -> JSONResponse:
        """200 while the engine thread runs, else 503 with the reason."""
        worker = self.worker
        if worker.alive:
            return JSONResponse({"status": "ok", "running": worker.running, "waiting": worker.waiting})
        reason = repr(worker.error) if worker.error else "the engine is not running"
        return JSONResponse({"status": "unavailable", "error": reason}, status_code=503)

    async def prometheus(self) -> Response:
        """Prometheus metrics: requests, tokens, time to first token, inter-token latency, load."""
        data, content_type = self.metrics.render()
        return Response(data, media_type=content_type)

    async def completion(self, request: Request, body: dict, kind: str) -> Response:
        """A chat or text completion: prepared, queued on the engine, then answered whole or streamed."""
        streams: list[RequestStream] = []
        try:
            # Off the event loop: templating and tokenizing a body of megabytes takes seconds, which would stall
            # every other connection (and /health) meanwhile.
            prepared = await asyncio.to_thread(self.pipeline.prepare, body, kind)
            # every prompt's n samples at once, or never: 400 for what even an idle server cannot hold, not 429
            several = len(prepared.prompts) > 1
            self.worker.check_samples(len(prepared.prompts) * prepared.n, "prompt" if several else "n")
            for one in prepared.text_requests():  # several prompts: a request each, answered as one
                streams.append(RequestStream(self.worker, one))
            if prepared.options.stream:
                first = await _unless_disconnected(request, streams[0].next(), streams)
            else:
                results = await _unless_disconnected(request, _collect_all(streams, prepared.n), streams)
                _raise_error(results)
        except REFUSALS as e:
            for stream in streams:  # the others of several prompts
                stream.cancel()
            response = _refusal(e, kind)
        else:
            if prepared.options.stream:
                events = _sse(streams[0], first, prepared, self.name, self.llm.tokenizer)
                headers = {"Cache-Control": "no-cache"}
                response = StreamingResponse(events, media_type="text/event-stream", headers=headers)
            else:
                response = JSONResponse(self._answer(prepared, results))
        self.metrics.requests.labels(ENDPOINTS[kind], str(response.status_code)).inc()
        return response

    def _answer(self, prepared: PreparedRequest, results: list[list[Result]]) -> dict:
        return answers.answer(dataclasses.replace(prepared, model=None), results, self.name, self.llm.tokenizer)


def _refusal(error: Exception, kind: str) -> JSONResponse:
    """The answer to a request that failed before its answer started."""
    failure = errors.failure(error, kind)
    headers = {"Retry-After": "1"} if isinstance(error, QueueFull) else None
    return JSONResponse(failure.body(), status_code=failure.status, headers=headers)


async def _unless_disconnected(request: Request, work, streams: list[RequestStream]):
    """Await the coroutine `work` unless the client goes away first: then cancel the requests and raise ClientClosed.
    `work` runs as a task, which a cancel ends as cancelled, leaving nothing for the event loop to log (a future
    of `asyncio.gather` cancelled here instead would end in a CancelledError that nobody reads: a traceback, logged
    when it is collected, for each client gone)."""
    disconnected = asyncio.ensure_future(_disconnected(request))
    task = asyncio.create_task(work)
    try:
        await asyncio.wait({task, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnected.cancel()
        if not task.done():  # the client went away, or the server is shutting down
            task.cancel()
            for stream in streams:
                stream.cancel()
    if not task.done():  # cancelled just now: the client is gone
        log.debug("client gone: requests %s cancelled", [stream.id for stream in streams])
        raise ClientClosed("the client closed the connection")
    return task.result()


async def _disconnected(request: Request) -> None:
    """Return when the client has gone away (the request body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _raise_error(results: list[list[Result]]) -> None:
    """Raise the error of a result that ended in one (its grammar could not be followed): its text is no answer."""
    for samples in results:
        for result in samples:
            if result.error is not None:
                raise result.error


async def _collect_all(streams: list[RequestStream], n: int) -> list[list[Result]]:
    """Each request's finished results, one per choice; the first error of any raised at once. Awaited here, in a
    task that `_unless_disconnected` may cancel: the gathered future's end (a CancelledError then) is read by this
    task, not left unread for the event loop to log with its traceback."""
    return await asyncio.gather(*(_collect(stream, n) for stream in streams))


async def _collect(stream: RequestStream, n: int) -> list[Result]:
    """The request's finished results, one per choice."""
    results = [None] * n
    while True:
        event = await stream.next()
        if event.result is not None:
            results[event.index] = event.result
        if event.last:
            return results


async def _sse(stream: RequestStream, first: Event, prepared: PreparedRequest, model: str, tokenizer):
    """The server-sent events of a streamed answer: chunks, a finishing chunk, the usage chunk if asked, [DONE]."""
    kind = prepared.kind
    header = responses.Stream.start(kind, model, prepared.options.include_usage)

    def data(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def chunk(text, **fields) -> str:
        return data(responses.chunk(header, text, **fields))

    try:
        if kind == "chat":
            for index in range(prepared.n):
                yield chunk("", role=True, index=index)
        event, offsets, results = first, [0] * prepared.n, [None] * prepared.n
        echoes = [prepared.texts[0] if prepared.options.echo else ""] * prepared.n  # each choice's prompt first
        while True:
            i, echo = event.index, echoes[event.index]
            logprobs = piece_logprobs(kind, tokenizer, prepared.options, prepared.prompt, event, offsets[i], echo)
            text, echoes[i] = echo + event.delta, ""
            if text or logprobs:
                yield chunk(text, logprobs=logprobs, index=i)
            if logprobs and kind != "chat" and logprobs["tokens"]:  # offsets count the tokens' texts, as whole
                offsets[i] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            if event.result is not None:
                r = results[i] = event.result
                if r.error is not None:  # the answer cannot go on: the error is its last event
                    yield data(errors.failure(r.error, kind).body())
                    return
                end = None if kind == "chat" else ""
                yield chunk(end, finish_reason=r.finish_reason, stop_reason=r.stop_reason, index=i)
            if event.last:
                if header.include_usage:
                    yield data(responses.usage_chunk(header, results))
                break
            event = await stream.next()
        yield "data: [DONE]\n\n"
    except EngineUnavailable as e:
        yield data(errors.failure(e, kind).body())
    finally:
        stream.cancel()  # the client went away mid-stream: free the slot


def _install_error_handlers(app: FastAPI) -> None:
    """OpenAI's error object for FastAPI's own errors too (a body that is not a JSON object, an unknown path)."""

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts, param = [], None
        for err in exc.errors():
            loc = [str(x) for x in err.get("loc", ()) if x != "body"]
            param = param or (loc[-1] if loc else None)
            where = ".".join(loc) or "body"
            parts.append(f"{where}: {err.get('msg', 'invalid')}")
        failure = errors.failure(InvalidRequest("; ".join(parts) or "invalid request", param))
        return JSONResponse(failure.body(), status_code=failure.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own answers (404, 405): their status stands as the code.
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = responses.error(str(exc.detail), str(exc.status_code), None, kind)
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        failure = errors.internal_failure(exc)
        return JSONResponse(failure.body(), status_code=failure.status)
