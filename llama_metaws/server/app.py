"""The HTTP side: OpenAI's and llama-server's routes on a :class:`~.worker.ModelWorker`.

OpenAI's routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (also
``/chat/completions``), ``GET /v1/models`` (also ``/models``). llama-server's
(:mod:`.llama_api`): ``POST /completion`` (and ``/completions``, as llama-server routes it),
``/tokenize``, ``/detokenize``, ``/apply-template``, ``GET /props``, ``GET /slots``, ``GET
/health`` (also ``/v1/health``), ``GET /metrics`` (with ``--metrics``).

Every request: CORS as llama-server does it by default (the ``Origin`` echoed, credentials
allowed; an ``OPTIONS`` preflight answered at once, without the key), the API key when set
(``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``; every route but ``/health``), a body of at
most ``--max-body-size`` bytes (413 beyond), read and parsed without holding the event loop;
then the request is checked, tokenized and its grammar parsed in a worker thread (the model's
thread never sees a request that cannot run), and handed to the model's thread as a job.
Errors: OpenAI's shape on OpenAI's routes, llama-server's on its own (:mod:`.errors`); a
streamed request answers its errors before the first chunk as such a JSON answer too, and
after it as a last ``data: {"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
from typing import Callable, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from . import llama_api, openai_api
from . import metrics as _metrics
from . import requests as _requests
from .errors import LLAMA, OPENAI, RequestError, from_model_error, unavailable
from .worker import Job, ModelWorker

_DISCONNECT_POLL_S = 0.5
_PARSE_INLINE_BYTES = 64 * 1024  # bodies above this are parsed in a thread
DEFAULT_MAX_BODY_SIZE = 16 * 1024 * 1024

# llama-server's routes answer errors in its shape; every other path in OpenAI's
_LLAMA_PATHS = {"/completion", "/completions", "/tokenize", "/detokenize", "/apply-template", "/props", "/slots",
                "/health", "/v1/health", "/metrics"}
_PUBLIC_PATHS = {"/health", "/v1/health"}


def dialect_of(path: str) -> str:
    return LLAMA if path in _LLAMA_PATHS or path.startswith("/slots/") else OPENAI


def _finite(value):
    """``value`` with every NaN or infinite float as null: JSON has no such numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def dumps(value) -> str:
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:  # a NaN or an infinity somewhere (a logprob of -inf, ...)
        return json.dumps(_finite(value), allow_nan=False)


class JSON(JSONResponse):
    """A JSON answer that holds no NaN or infinity (null instead)."""

    def render(self, content) -> bytes:
        return dumps(content).encode("utf-8")


def _error_response(e: RequestError, dialect: str) -> JSONResponse:
    return JSON(e.body(dialect), status_code=e.status, headers=e.headers)


class CORS:
    """llama-server's default CORS: any ``Origin`` echoed with credentials allowed; a preflight
    (``OPTIONS``) answered here with the methods and headers allowed, before any key check."""

    METHODS = "GET, POST, DELETE, OPTIONS"

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        origin = next((v for k, v in scope.get("headers", ()) if k == b"origin"), b"")
        if scope["method"] == "OPTIONS":
            headers = [(b"access-control-allow-origin", origin), (b"access-control-allow-credentials", b"true"),
                       (b"access-control-allow-methods", self.METHODS.encode()),
                       (b"access-control-allow-headers", b"*"), (b"content-length", b"0"),
                       (b"content-type", b"text/html")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return

        async def with_cors(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) + [
                    (b"access-control-allow-origin", origin), (b"access-control-allow-credentials", b"true")])
            await send(message)

        await self.app(scope, receive, with_cors)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is longer than ``limit`` bytes (before reading it when
    ``Content-Length`` says so)."""
    def too_large() -> RequestError:
        return RequestError(413, f"the request body is larger than {limit} bytes (--max-body-size)",
                            code="body_too_large")

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large()
        chunks.append(chunk)
    return b"".join(chunks)


async def _next_item(worker: ModelWorker, job: Job, request: Request):
    """The job's next item; a client that went away while it waits cancels the job."""
    while True:
        try:
            return await asyncio.wait_for(job.items.get(), timeout=_DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                worker.cancel(job, "client")
                raise RequestError(499, "the client closed the request", code="cancelled") from None


def create_app(worker: ModelWorker, model: "_requests.ModelAccess", *, api_key: Optional[str] = None,
               metrics: bool = False, slots: bool = True, max_body_size: int = DEFAULT_MAX_BODY_SIZE,
               model_path: str = "", build_info: str = "") -> Starlette:
    """The app; ``model``: the request layer's door to the model (and the served name)."""
    created = int(time.time())
    key = api_key.encode("utf-8") if api_key is not None else None

    def authorize(request: Request) -> None:
        if key is None or request.url.path in _PUBLIC_PATHS:
            return
        given = request.headers.get("authorization") or request.headers.get("x-api-key") or ""
        if given[:7].lower() == "bearer ":
            given = given[7:]
        # header values arrive as latin-1 text: compare their raw bytes with the key's UTF-8
        if not hmac.compare_digest(given.strip().encode("latin-1", "replace"), key):
            raise RequestError(401, "invalid or missing API key: send 'Authorization: Bearer KEY' or "
                               "'X-Api-Key: KEY'", type="authentication_error", code="invalid_api_key")

    async def body_of(request: Request) -> dict:
        authorize(request)
        raw = await read_body(request, max_body_size)
        if len(raw) > _PARSE_INLINE_BYTES:
            return await asyncio.to_thread(_requests.parse_json, raw)
        return _requests.parse_json(raw)

    async def check(fn: Callable, *args):
        """A request check that tokenizes or parses: off the event loop, off the model's thread."""
        if worker.unavailable is not None:
            raise unavailable(worker.unavailable)
        return await asyncio.to_thread(fn, *args)

    async def run(request: Request, plan: "_requests.Plan", responder):
        job = Job(plan.run, plan.stream, asyncio.get_running_loop(), tokens=plan.tokens, n_prompt=plan.n_prompt,
                  info=plan.info, n_predict=plan.kwargs.get("max_tokens"))
        worker.submit(job)  # a RequestError (503) when the queue is full or the server stops
        try:
            kind, value = await _next_item(worker, job, request)
        except BaseException:
            worker.cancel(job, "client")
            raise
        if kind == "error":
            raise from_model_error(value, plan.prompt_param, plan.grammar_param)
        if not plan.stream:
            return JSON(responder.response(value, job))
        return StreamingResponse(_events(job, (kind, value), plan, responder), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(job: Job, first, plan, responder):
        try:
            for event in responder.first(job):
                yield f"data: {dumps(event)}\n\n"
            kind, value = first
            while True:
                if kind == "chunk":
                    for event in responder.events(value, job):
                        yield f"data: {dumps(event)}\n\n"
                elif kind == "done":
                    for line in responder.end():
                        yield line
                    return
                else:
                    error = from_model_error(value, plan.prompt_param, plan.grammar_param)
                    yield f"data: {dumps(error.body(responder.dialect))}\n\n"
                    return
                kind, value = await job.items.get()
        finally:
            worker.cancel(job, "client")  # a dropped stream: the model stops after its next token

    async def completions(request: Request):
        plan = await check(_requests.completion, await body_of(request), model)
        return await run(request, plan, openai_api.Responder(plan))

    async def chat_completions(request: Request):
        plan = await check(_requests.chat, await body_of(request), model)
        return await run(request, plan, openai_api.Responder(plan))

    async def native_completion(request: Request):
        plan, options = await check(llama_api.completion, await body_of(request), model)
        responder = llama_api.Responder(plan, options, model)
        if options.n_predict_zero:
            return JSON(responder.zero())
        return await run(request, plan, responder)

    def native(fn):
        async def route(request: Request):
            return JSON(await check(fn, await body_of(request), model))
        return route

    async def models(request: Request):
        authorize(request)
        return JSON({"object": "list", "data": [
            {"id": model.alias, "object": "model", "created": created, "owned_by": "llama-metaws"}]})

    async def health(request: Request):
        if worker.unavailable is not None:
            raise unavailable(worker.unavailable)
        return JSON({"status": "ok"})

    async def props(request: Request):
        authorize(request)
        return JSON(llama_api.props(model, total_slots=worker.n_parallel, slots_endpoint=slots, metrics=metrics,
                                            model_path=model_path, build_info=build_info))

    async def slots_route(request: Request):
        authorize(request)
        if not slots:
            raise RequestError(501, "This server does not support slots endpoint. Start it with `--slots`",
                               type="not_supported_error", code="slots_disabled")
        states = [dict(s, n_ctx=model.n_ctx) for s in worker.slots()]
        if request.query_params.get("fail_on_no_slot") and all(s["is_processing"] for s in states):
            raise RequestError(503, "no slot available", type="server_error", code="no_slot_available")
        return JSON(states)

    async def slot_action(request: Request):
        authorize(request)
        raise RequestError(501, "This server does not support slots action (it has no --slot-save-path)",
                           type="not_supported_error", code="slot_actions_unsupported")

    async def metrics_route(request: Request):
        authorize(request)
        if not metrics:
            raise RequestError(501, "this server does not serve metrics: start it with --metrics",
                               type="not_supported_error", code="metrics_disabled")
        return PlainTextResponse(_metrics.render(worker), media_type="text/plain; version=0.0.4")

    async def on_request_error(request: Request, e: RequestError):
        return _error_response(e, dialect_of(request.url.path))

    async def on_http_error(request: Request, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return _error_response(RequestError(e.status_code, message, code=code), dialect_of(request.url.path))

    async def on_server_error(request: Request, e: Exception):
        return _error_response(RequestError(500, f"{type(e).__name__}: {e}", type="server_error"),
                               dialect_of(request.url.path))

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
        Route("/completion", native_completion, methods=["POST"]),
        Route("/completions", native_completion, methods=["POST"]),
        Route("/tokenize", native(llama_api.tokenize), methods=["POST"]),
        Route("/detokenize", native(llama_api.detokenize), methods=["POST"]),
        Route("/apply-template", native(llama_api.apply_template), methods=["POST"]),
        Route("/props", props, methods=["GET"]),
        Route("/slots", slots_route, methods=["GET"]),
        Route("/slots/{id_slot}", slot_action, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={
        RequestError: on_request_error, HTTPException: on_http_error, Exception: on_server_error})
    app.add_middleware(CORS)
    return app
