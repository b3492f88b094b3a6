"""What every route shares: the key check, the body read, the request checks off the event loop,
and a job handed to the model's runners and answered (a JSON body, or an event stream).

A route group (:mod:`.routes`) translates a request into a plan (:mod:`.requests`) and a
responder (:mod:`.openai_api`, :mod:`.llama_api`); :meth:`Serving.run` does the rest: the job is
queued on the :class:`~.worker.ModelWorker`, its first item awaited (a client that goes away
meanwhile cancels it), then answered whole or as ``data:`` events, a dropped stream cancelling
the job.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
from typing import Callable, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from . import requests as _requests
from .errors import RequestError, from_model_error, unavailable
from .worker import Job, ModelWorker

_DISCONNECT_POLL_S = 0.5
_PARSE_INLINE_BYTES = 64 * 1024  # bodies above this are parsed in a thread
DEFAULT_MAX_BODY_SIZE = 16 * 1024 * 1024


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


class Serving:
    """One server's shared state and steps: ``worker`` runs the jobs, ``model`` is the request
    layer's door to the model (and the served name); the rest are the server's options."""

    PUBLIC_PATHS = frozenset({"/health", "/v1/health"})  # answered without the key

    def __init__(self, worker: ModelWorker, model: "_requests.ModelAccess", *, api_key: Optional[str] = None,
                 metrics: bool = False, slots: bool = True, max_body_size: int = DEFAULT_MAX_BODY_SIZE,
                 model_path: str = "", build_info: str = "", slot_save_path: Optional[str] = None) -> None:
        self.worker, self.model = worker, model
        self.slot_save_path = slot_save_path  # --slot-save-path: POST /slots/{id} saves and restores there
        self.metrics, self.slots, self.max_body_size = metrics, slots, max_body_size
        self.model_path, self.build_info = model_path, build_info
        self.created = int(time.time())
        self._key = api_key.encode("utf-8") if api_key is not None else None

    def authorize(self, request: Request) -> None:
        """A 401 unless the request carries the key (``Authorization: Bearer KEY`` or ``X-Api-Key``)."""
        if self._key is None or request.url.path in self.PUBLIC_PATHS:
            return
        given = request.headers.get("authorization") or request.headers.get("x-api-key") or ""
        if given[:7].lower() == "bearer ":
            given = given[7:]
        # header values arrive as latin-1 text: compare their raw bytes with the key's UTF-8
        if not hmac.compare_digest(given.strip().encode("latin-1", "replace"), self._key):
            raise RequestError(401, "invalid or missing API key: send 'Authorization: Bearer KEY' or "
                               "'X-Api-Key: KEY'", type="authentication_error", code="invalid_api_key")

    async def body_of(self, request: Request) -> dict:
        """The authorized request's JSON body (large ones parsed in a thread)."""
        self.authorize(request)
        raw = await read_body(request, self.max_body_size)
        if len(raw) > _PARSE_INLINE_BYTES:
            return await asyncio.to_thread(_requests.parse_json, raw)
        return _requests.parse_json(raw)

    async def check(self, fn: Callable, *args):
        """A request check that tokenizes or parses: off the event loop, off the model's thread."""
        if self.worker.unavailable is not None:
            raise unavailable(self.worker.unavailable)
        return await asyncio.to_thread(fn, *args)

    async def run(self, request: Request, plan: "_requests.Plan", responder):
        """Queue the plan's job and answer it with ``responder`` (see the module docstring)."""
        worker = self.worker
        job = Job(plan.run, plan.stream, asyncio.get_running_loop(), tokens=plan.tokens, n_prompt=plan.n_prompt,
                  info=plan.info, n_predict=plan.kwargs.get("max_tokens"))
        worker.submit(job)  # a RequestError (503) when the queue is full or the server stops
        try:
            kind, value = await self._next_item(job, request)
        except BaseException:
            worker.cancel(job, "client")
            raise
        if kind == "error":
            raise from_model_error(value, plan.prompt_param, plan.grammar_param)
        if not plan.stream:
            return JSON(responder.response(value, job))
        return StreamingResponse(self._events(job, (kind, value), plan, responder), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _next_item(self, job: Job, request: Request):
        """The job's next item; a client that went away while it waits cancels the job."""
        while True:
            try:
                return await asyncio.wait_for(job.items.get(), timeout=_DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.worker.cancel(job, "client")
                    raise RequestError(499, "the client closed the request", code="cancelled") from None

    async def _events(self, job: Job, first, plan, responder):
        """The stream: each event a responder gives is a ``data:`` line of JSON, or (a string) an
        SSE block as it is (``event:`` and ``data:`` lines, for the APIs whose events are typed)."""
        def sse(event) -> str:
            return event if isinstance(event, str) else f"data: {dumps(event)}\n\n"

        try:
            for event in responder.first(job):
                yield sse(event)
            kind, value = first
            while True:
                if kind == "chunk":
                    for event in responder.events(value, job):
                        yield sse(event)
                elif kind == "done":
                    for line in responder.end():
                        yield line
                    return
                else:
                    error = from_model_error(value, plan.prompt_param, plan.grammar_param)
                    on_error = getattr(responder, "error_event", None)
                    yield on_error(error) if on_error is not None else sse(error.body(responder.dialect))
                    return
                kind, value = await job.items.get()
        finally:
            self.worker.cancel(job, "client")  # a dropped stream: the model stops after its next token
