"""What every route shares: the key check, the body read, the request checks off the event loop,
and a job handed to the model's runners and answered (a JSON body, or an event stream).

A route group (:mod:`.routes`) translates a request into a plan (:mod:`.validation`) and a
responder (:mod:`.openai_api`, :mod:`.llama_api`); :meth:`Serving.run` does the rest: the job is
queued on the :class:`~.worker.ModelWorker`, its first item awaited (a client that goes away
meanwhile cancels it), then answered whole or as ``data:`` events (a responder's ``first``,
``events`` of each chunk, ``progress`` of each prompt progress report, ``end``), a dropped stream
cancelling the job. :meth:`Serving.run_all` runs several plans of one request (llama-server's
list of prompts) the same way.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
from typing import Any, Callable, Dict, List, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from . import validation as _validation
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

    def __init__(self, worker: ModelWorker, model: "_validation.ModelAccess", *, api_key=None,
                 metrics: bool = False, slots: bool = True, max_body_size: int = DEFAULT_MAX_BODY_SIZE,
                 model_path: str = "", build_info: str = "", slot_save_path: Optional[str] = None,
                 ui: bool = True) -> None:
        self.worker, self.model = worker, model
        self.ui = ui  # --ui / --no-ui: the web page at /
        self.slot_save_path = slot_save_path  # --slot-save-path: POST /slots/{id} saves and restores there
        self.metrics, self.slots, self.max_body_size = metrics, slots, max_body_size
        self.model_path, self.build_info = model_path, build_info
        self.created = int(time.time())
        # --api-key: one key or several, comma-separated (or a list: --api-key-file's lines too)
        keys = api_key.split(",") if isinstance(api_key, str) else list(api_key or [])
        keys = [k.strip() for k in keys if k.strip()]
        self._keys = [k.encode("utf-8") for k in keys] if api_key is not None else None

    def authorize(self, request: Request) -> None:
        """A 401 unless the request carries the key (``Authorization: Bearer KEY`` or ``X-Api-Key``)."""
        if self._keys is None or request.url.path in self.PUBLIC_PATHS:
            return
        given = request.headers.get("authorization") or request.headers.get("x-api-key") or ""
        if given[:7].lower() == "bearer ":
            given = given[7:]
        # header values arrive as latin-1 text: compare their raw bytes with the keys' UTF-8 (each of
        # them, so the time taken does not tell which key came close)
        raw = given.strip().encode("latin-1", "replace")
        if not any([hmac.compare_digest(raw, key) for key in self._keys]):
            raise RequestError(401, "invalid or missing API key: send 'Authorization: Bearer KEY' or "
                               "'X-Api-Key: KEY'", type="authentication_error", code="invalid_api_key")

    async def body_of(self, request: Request) -> dict:
        """The authorized request's JSON body (large ones parsed in a thread)."""
        self.authorize(request)
        raw = await read_body(request, self.max_body_size)
        if len(raw) > _PARSE_INLINE_BYTES:
            return await asyncio.to_thread(_validation.parse_json, raw)
        return _validation.parse_json(raw)

    async def check(self, fn: Callable, *args):
        """A request check that tokenizes or parses: off the event loop, off the model's thread."""
        if self.worker.unavailable is not None:
            raise unavailable(self.worker.unavailable)
        return await asyncio.to_thread(fn, *args)

    async def run(self, request: Request, plan: "_validation.Plan", responder):
        """Queue the plan's job and answer it with ``responder`` (see the module docstring)."""
        return await self.run_all(request, [plan], [responder])

    async def run_all(self, request: Request, plans: List["_validation.Plan"], responders: list):
        """Several plans of one request (llama-server's list of prompts), run at once as the
        slots allow (a 400 for more than may run or wait at once): one answer each, a list of them
        when there are several; a stream merges their events as they come (each responder names
        its own index), an error in one ends them all."""
        worker = self.worker
        room = worker.n_parallel + worker.queue_size
        if len(plans) > room:
            raise RequestError(400, f"{len(plans)} prompts in one request: this server runs or queues at most {room} "
                               f"at once (-np {worker.n_parallel} and --queue-size {worker.queue_size})",
                               param="prompt", code="too_many_prompts")
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()
        jobs = [Job(plan.run, plan.stream, loop, tokens=plan.tokens, n_prompt=plan.n_prompt, info=plan.info,
                    n_predict=plan.kwargs.get("max_tokens"), progress=plan.stream and plan.return_progress,
                    items=items) for plan in plans]
        submitted: List[Job] = []
        try:
            for job in jobs:
                worker.submit(job)  # a RequestError (503) when the queue is full or the server stops
                submitted.append(job)
            answers: Dict[Job, Any] = {}
            while True:
                job, kind, value = await self._next_item(items, jobs, request)
                if kind == "error":
                    plan = plans[jobs.index(job)]
                    raise from_model_error(value, plan.prompt_param, plan.grammar_param)
                if plans[0].stream:
                    break
                if kind == "done":
                    answers[job] = responders[jobs.index(job)].response(value, job)
                    if len(answers) == len(jobs):
                        out = [answers[j] for j in jobs]
                        return JSON(out[0] if len(out) == 1 else out)
        except BaseException:
            for job in submitted:
                worker.cancel(job, "client")
            raise
        return StreamingResponse(self._events(jobs, (job, kind, value), items, plans, responders),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _next_item(self, items: asyncio.Queue, jobs: List[Job], request: Request):
        """The jobs' next item; a client that went away while they wait cancels them."""
        while True:
            try:
                return await asyncio.wait_for(items.get(), timeout=_DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    for job in jobs:
                        self.worker.cancel(job, "client")
                    raise RequestError(499, "the client closed the request", code="cancelled") from None

    async def _events(self, jobs: List[Job], first, items: asyncio.Queue, plans, responders):
        """The stream: each event a responder gives is a ``data:`` line of JSON, or (a string) an
        SSE block as it is (``event:`` and ``data:`` lines, for the APIs whose events are typed)."""
        def sse(event) -> str:
            return event if isinstance(event, str) else f"data: {dumps(event)}\n\n"

        running = set(jobs)
        try:
            for job, responder in zip(jobs, responders):
                for event in responder.first(job):
                    yield sse(event)
            job, kind, value = first
            while True:
                i = jobs.index(job)
                responder = responders[i]
                if kind == "chunk":
                    for event in responder.events(value, job):
                        yield sse(event)
                elif kind == "progress":
                    for event in responder.progress(value, job):
                        yield sse(event)
                elif kind == "done":
                    for line in responder.end():
                        yield line
                    running.discard(job)
                    if not running:
                        return
                else:
                    error = from_model_error(value, plans[i].prompt_param, plans[i].grammar_param)
                    on_error = getattr(responder, "error_event", None)
                    yield on_error(error) if on_error is not None else sse(error.body(responder.dialect))
                    return
                job, kind, value = await items.get()
        finally:
            for job in jobs:  # a dropped stream: the model stops after its next token
                self.worker.cancel(job, "client")
