"""The HTTP app: the route groups (:mod:`.routes`) on a :class:`~.serving.Serving`, llama-server's
CORS, and the error handlers.

Every request: CORS as llama-server does it (:class:`CORS`: by default the ``Origin`` echoed,
credentials allowed; ``--cors-origins``, ``--cors-methods``, ``--cors-headers``,
``--[no-]cors-credentials``; an ``OPTIONS`` preflight answered at once, without the key), the API key when set
(``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``; every route but ``/health`` and the web
page's, :mod:`.routes.ui`), a body of at
most ``--max-body-size`` bytes (413 beyond), read and parsed without holding the event loop;
then the request is checked, tokenized and its grammar parsed in a worker thread (the model's
thread never sees a request that cannot run), and handed to the model's runners as a job
(:mod:`.serving`). Errors: in the shape of the API whose route was asked (OpenAI's, or
llama-server's on its own routes; OpenAI's for a path no route serves); a streamed request
answers its errors before the first chunk as such a JSON answer too, and after it as a last
``data: {"error": ...}`` event. An unexpected exception is a 500 that names no Python detail
(its traceback goes to the server's log).
"""

from __future__ import annotations

import logging
from typing import Optional
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.routing import Match

from . import validation as _validation
from .errors import OPENAI, RequestError
from .routes import GROUPS
from .serving import DEFAULT_MAX_BODY_SIZE, JSON, Serving
from .worker import ModelWorker

__all__ = ["create_app", "DEFAULT_MAX_BODY_SIZE"]

log = logging.getLogger("llama_metaws.server")


def _is_localhost(origin: bytes) -> bool:
    try:
        host = urlsplit(origin.decode("latin-1")).hostname
    except ValueError:
        return False
    return host in ("localhost", "127.0.0.1", "::1")


class CORS:
    """llama-server's CORS: ``origins`` ``"*"`` with ``credentials`` echoes any ``Origin``;
    ``"localhost"`` echoes it only when its host is localhost, 127.0.0.1 or ::1 (else no
    ``Access-Control-Allow-Origin``); any other value is sent as it is. A preflight (``OPTIONS``)
    is answered here with ``methods`` and ``headers``, before any key check. The headers go out
    with llama-server's capitals (clients that read them into a plain dict look them up so)."""

    METHODS = "GET, POST, DELETE, OPTIONS"

    def __init__(self, app, origins: str = "*", methods: str = METHODS, headers: str = "*",
                 credentials: bool = True):
        self.app = app
        self.origins, self.methods, self.headers, self.credentials = origins, methods, headers, credentials

    def allow_origin(self, origin: bytes) -> Optional[bytes]:
        if self.origins == "*" and self.credentials:
            return origin
        if self.origins == "localhost":
            return origin if origin and _is_localhost(origin) else None
        return self.origins.encode("latin-1", "replace")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        origin = next((v for k, v in scope.get("headers", ()) if k == b"origin"), b"")
        allowed = self.allow_origin(origin)
        cors = [(b"Access-Control-Allow-Origin", allowed)] if allowed is not None else []
        credentials = (b"Access-Control-Allow-Credentials", b"true" if self.credentials else b"false")
        if scope["method"] == "OPTIONS":
            headers = cors + [credentials, (b"Access-Control-Allow-Methods", self.methods.encode("latin-1", "replace")),
                              (b"Access-Control-Allow-Headers", self.headers.encode("latin-1", "replace")),
                              (b"content-length", b"0"), (b"content-type", b"text/html")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b""})
            return
        cors.append(credentials)

        async def with_cors(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=list(message.get("headers", [])) + cors)
            await send(message)

        await self.app(scope, receive, with_cors)


def _dialects(groups_routes):
    """``dialect_of(request)``: the error shape of the group whose route serves the request."""
    def dialect_of(request: Request) -> str:
        for dialect, routes in groups_routes:
            for route in routes:
                match, _ = route.matches(request.scope)
                if match is not Match.NONE:
                    return dialect
        return OPENAI
    return dialect_of


def create_app(worker: ModelWorker, model: "_validation.ModelAccess", *, api_key: Optional[str] = None,
               metrics: bool = False, slots: bool = True, max_body_size: int = DEFAULT_MAX_BODY_SIZE,
               model_path: str = "", build_info: str = "", slot_save_path: Optional[str] = None,
               cors: Optional[dict] = None, ui: bool = True) -> Starlette:
    """The app; ``model``: the request layer's door to the model (and the served name); ``cors``:
    :class:`CORS`'s options (llama-server's defaults when None); ``slot_save_path``:
    ``--slot-save-path``; ``ui``: the web page at ``/`` (``--no-ui``: not served)."""
    serving = Serving(worker, model, api_key=api_key, metrics=metrics, slots=slots, max_body_size=max_body_size,
                      model_path=model_path, build_info=build_info, slot_save_path=slot_save_path, ui=ui)
    groups = [(group.DIALECT, group.routes(serving)) for group in GROUPS]
    dialect_of = _dialects(groups)

    def answer(request: Request, e: RequestError) -> JSON:
        return JSON(e.body(dialect_of(request)), status_code=e.status, headers=e.headers)

    async def on_request_error(request: Request, e: RequestError):
        return answer(request, e)

    async def on_http_error(request: Request, e: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return answer(request, RequestError(e.status_code, message, code=code))

    async def on_server_error(request: Request, e: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=e)
        return answer(request, RequestError(500, "the server failed to answer this request (see its log)",
                                            type="server_error", code="internal_error"))

    app = Starlette(routes=[r for _, routes in groups for r in routes], exception_handlers={
        RequestError: on_request_error, HTTPException: on_http_error, Exception: on_server_error})
    app.add_middleware(CORS, **(cors or {}))
    return app
