"""The HTTP side: OpenAI's routes on a :class:`~.worker.ModelWorker`, errors in OpenAI's shape.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (also without ``/v1``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (with ``--metrics``). Every answer that is
not a success is ``{"error": {"message", "type", "param", "code"}}`` with a 4xx (the request's
fault) or a 5xx (the server's); a streamed request answers its errors before the first chunk
as such a JSON answer too, and after it as a last ``data: {"error": ...}`` event.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Iterable, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from . import metrics as _metrics
from . import requests as _requests
from .errors import RequestError, from_model_error
from .worker import Job, ModelWorker

_DISCONNECT_POLL_S = 0.5


def _error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _next_item(job: Job, request: Request):
    """The job's next item; a client that went away while it waits cancels the job."""
    while True:
        try:
            return await asyncio.wait_for(job.items.get(), timeout=_DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel("client")
                raise RequestError(499, "the client closed the request", code="cancelled") from None


def create_app(worker: ModelWorker, *, alias: str, names: Iterable[str], api_key: Optional[str] = None,
               metrics: bool = False) -> Starlette:
    """The app. ``names``: the model names a request may give (the alias first)."""
    names = [alias] + [n for n in names if n != alias]
    created = int(time.time())

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
            raise RequestError(401, "invalid or missing API key: send 'Authorization: Bearer KEY'",
                               type="authentication_error", code="invalid_api_key")

    async def run(request: Request, plan: "_requests.Plan"):
        job = Job(plan.run, plan.stream, asyncio.get_running_loop())
        worker.submit(job)  # a RequestError (503) when the queue is full or the server stops
        try:
            kind, value = await _next_item(job, request)
        except BaseException:
            job.cancel("client")
            raise
        if kind == "error":
            raise from_model_error(value, plan.prompt_param)
        if not plan.stream:
            return JSONResponse(value)
        return StreamingResponse(_events(job, (kind, value), plan.prompt_param), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(job: Job, first, prompt_param: str):
        try:
            kind, value = first
            while True:
                if kind == "chunk":
                    yield f"data: {json.dumps(value)}\n\n"
                elif kind == "done":
                    yield "data: [DONE]\n\n"
                    return
                else:
                    yield f"data: {json.dumps(from_model_error(value, prompt_param).body())}\n\n"
                    return
                kind, value = await job.items.get()
        finally:
            job.cancel("client")  # a dropped stream: the model stops after its next token

    async def completions(request: Request):
        authorize(request)
        body = _requests.parse_json(await request.body())
        return await run(request, _requests.completion(body, names, alias))

    async def chat_completions(request: Request):
        authorize(request)
        body = _requests.parse_json(await request.body())
        return await run(request, _requests.chat(body, names, alias))

    async def models(request: Request):
        authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": alias, "object": "model", "created": created, "owned_by": "llama-metaws"}]})

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def metrics_route(request: Request):
        authorize(request)
        if not metrics:
            raise RequestError(501, "this server does not serve metrics: start it with --metrics",
                               type="not_supported_error", code="metrics_disabled")
        return PlainTextResponse(_metrics.render(worker), media_type="text/plain; version=0.0.4")

    async def on_request_error(request: Request, e: RequestError):
        return _error_response(e)

    async def on_http_error(request: Request, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return _error_response(RequestError(e.status_code, message, code=code))

    async def on_server_error(request: Request, e: Exception):
        return _error_response(RequestError(500, f"{type(e).__name__}: {e}", type="server_error"))

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={
        RequestError: on_request_error, HTTPException: on_http_error, Exception: on_server_error})
