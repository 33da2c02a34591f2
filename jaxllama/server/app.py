"""The OpenAI-compatible HTTP API over a loaded `LLM`: `create_app(llm)` returns a FastAPI app.

POST /v1/chat/completions, POST /v1/completions (streamed as server-sent events with "stream": true),
GET /v1/models, GET /health, GET /metrics (Prometheus). Every request shares one engine, stepped by an
`EngineWorker` thread; a client that goes away cancels its request. Errors use OpenAI's error object:
400 for an invalid request, 429 when the queue is full, 503 when the engine is not running.

    import uvicorn
    from jaxllama import LLM
    from jaxllama.server.app import create_app
    uvicorn.run(create_app(LLM.load()), port=8000)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxllama.engine.request import SamplingParams
from jaxllama.generation import Event, Result
from jaxllama.protocol import responses
from jaxllama.protocol.requests import OutputOptions, RequestError, output_options, parse_body, submit_error
from jaxllama.server.metrics import Metrics
from jaxllama.server.worker import EngineUnavailable, EngineWorker, QueueFull, RequestStream

JSONObject = Annotated[dict[str, Any], Body()]
ENDPOINTS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


class _Failure(Exception):
    """An error answer: HTTP status and OpenAI error object."""

    def __init__(self, status: int, body: dict, headers: dict | None = None):
        self.status, self.body, self.headers = status, body, headers


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
    max_queue: requests waiting for a slot at most; beyond, 429.
    max_tokens: tokens per answer when a request does not say (default: up to the context limit).
    """
    name = model_name or (llm.path.name if llm.path else "jaxllama")
    defaults = SamplingParams(max_tokens=max_tokens or llm.engine.max_context)
    metrics = Metrics()
    worker = EngineWorker(llm.generation, slots=llm.engine.slots, max_queue=max_queue, metrics=metrics)
    metrics.watch_load(lambda: worker.running, lambda: worker.waiting)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = FastAPI(title="jaxllama", summary="OpenAI-compatible API for Llama-family models in JAX", lifespan=lifespan)
    app.state.llm, app.state.worker, app.state.metrics, app.state.model_name = llm, worker, metrics, name
    _install_error_handlers(app)
    created = int(time.time())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: JSONObject) -> Response:
        """Answer a conversation ("messages"), whole or streamed."""
        return await _answer(request, body, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request, body: JSONObject) -> Response:
        """Continue a text ("prompt"), whole or streamed."""
        return await _answer(request, body, "completion")

    @app.get("/v1/models")
    async def models() -> dict:
        """The one model served."""
        card = {"id": name, "object": "model", "created": created, "owned_by": "jaxllama"}
        card["max_model_len"] = llm.engine.max_context
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine thread runs, else 503 with the reason."""
        if worker.alive:
            return JSONResponse({"status": "ok", "running": worker.running, "waiting": worker.waiting})
        reason = repr(worker.error) if worker.error else "the engine is not running"
        return JSONResponse({"status": "unavailable", "error": reason}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        """Prometheus metrics: requests, tokens, time to first token, inter-token latency, load."""
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    async def _answer(request: Request, body: dict, kind: str) -> Response:
        endpoint = ENDPOINTS[kind]
        try:
            response = await _generate(request, body, kind)
        except _Failure as f:
            metrics.requests.labels(endpoint, str(f.status)).inc()
            return JSONResponse(f.body, status_code=f.status, headers=f.headers)
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    async def _generate(request: Request, body: dict, kind: str) -> Response:
        try:
            parsed = parse_body(body, kind, defaults)
            options = output_options(body, kind)
            prompt = llm.encode_chat(parsed.messages) if kind == "chat" else llm.encode(parsed.prompt)
        except ValueError as e:
            raise _invalid(submit_error(e, kind)) from None
        try:
            stream = RequestStream(worker, prompt, parsed.params, parsed.stop, options.logprobs)
        except QueueFull as e:
            raise _Failure(
                429, responses.error(str(e), "queue_full", None, "rate_limit_error"), {"Retry-After": "1"}
            ) from None
        except EngineUnavailable as e:
            raise _Failure(503, responses.error(str(e), "engine_unavailable", None, "server_error")) from None

        disconnected = asyncio.ensure_future(_disconnected(request))
        try:
            if options.stream:
                first = await _unless(disconnected, stream.next(), stream, kind)
                events = _sse(stream, first, kind, name, options, llm.tokenizer)
                return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            result = await _unless(disconnected, _collect(stream), stream, kind)
        finally:
            disconnected.cancel()
        logprobs = None
        if result.logprobs is not None:
            logprobs = _token_logprobs(kind, llm.tokenizer, result.token_ids, result.logprobs)
        return JSONResponse(responses.completion(kind, result, name, logprobs=logprobs))

    return app


async def _disconnected(request: Request) -> None:
    """Return when the client has gone away (the request body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless(disconnected: asyncio.Future, work, stream: RequestStream, kind: str):
    """Await `work` unless the client goes away first (then cancel the request); engine errors become answers."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, disconnected}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():  # the client went away, or the server is shutting down
            task.cancel()
            stream.cancel()
    if not task.done():  # cancelled just now: the client is gone
        raise _Failure(499, responses.error("the client closed the connection", "client_closed"))
    try:
        return task.result()
    except ValueError as e:
        raise _invalid(submit_error(e, kind)) from None
    except EngineUnavailable as e:
        raise _Failure(503, responses.error(str(e), "engine_unavailable", None, "server_error")) from None


async def _collect(stream: RequestStream) -> Result:
    """The request's finished result."""
    while True:
        event = await stream.next()
        if event.result is not None:
            return event.result


def _token_logprobs(kind: str, tokenizer, token_ids, logprobs: list[float], offset: int = 0) -> dict:
    """The OpenAI logprobs object of sampled tokens (each token's text decoded on its own)."""
    texts = [tokenizer.decode([t]) for t in token_ids]
    if kind == "chat":
        return responses.chat_logprobs(texts, logprobs)
    return responses.text_logprobs(texts, logprobs, offset)


async def _sse(stream: RequestStream, first: Event, kind: str, model: str, options: OutputOptions, tokenizer):
    """The server-sent events of a streamed answer: chunks, a finishing chunk, the usage chunk if asked, [DONE]."""
    rid, created = responses.new_id(kind), int(time.time())
    usage = options.include_usage

    def data(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    try:
        if kind == "chat":
            yield data(responses.chunk(kind, rid, created, model, "", role=True, include_usage=usage))
        event, offset = first, 0
        while True:
            logprobs = None
            if event.logprobs is not None and event.token_ids:
                logprobs = _token_logprobs(kind, tokenizer, event.token_ids, event.logprobs, offset)
            if event.delta or logprobs:
                yield data(
                    responses.chunk(kind, rid, created, model, event.delta, logprobs=logprobs, include_usage=usage)
                )
            offset += len(event.delta)
            if event.result is not None:
                r = event.result
                yield data(
                    responses.chunk(
                        kind,
                        rid,
                        created,
                        model,
                        None if kind == "chat" else "",
                        finish_reason=r.finish_reason,
                        stop_reason=r.stop_reason,
                        include_usage=usage,
                    )
                )
                if usage:
                    yield data(responses.usage_chunk(kind, rid, created, model, r))
                break
            event = await stream.next()
        yield "data: [DONE]\n\n"
    except EngineUnavailable as e:
        yield data(responses.error(str(e), "engine_unavailable", None, "server_error"))
    finally:
        stream.cancel()  # the client went away mid-stream: free the slot


def _invalid(e: RequestError) -> _Failure:
    return _Failure(400, responses.error(e.message, e.code, e.param))


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
        message = "; ".join(parts) or "invalid request"
        return JSONResponse(responses.error(message, "invalid_request", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        body = responses.error(str(exc.detail), str(exc.status_code), None, kind)
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        body = responses.error(f"internal error: {exc!r}", "internal_error", None, "server_error")
        return JSONResponse(body, status_code=500)
