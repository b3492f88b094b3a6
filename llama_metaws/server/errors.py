"""Errors as answers, in the three shapes clients expect.

OpenAI's routes (``/v1/...``) answer ``{"error": {"message", "type", "param", "code"}}`` with a
string ``code``; llama-server's own routes (``/completion``, ``/tokenize``, ``/props``, ...)
answer its shape, ``{"error": {"code": <HTTP status>, "message", "type"}}`` with its types
(``invalid_request_error``, ``authentication_error``, ``not_found_error``, ``server_error``,
``not_supported_error``, ``unavailable_error``, ``exceed_context_size_error``); Anthropic's
``/v1/messages`` answers ``{"type": "error", "error": {"type", "message"}}``. A prompt too long
for the context is llama-server's ``exceed_context_size_error`` with ``n_prompt_tokens`` and
``n_ctx`` on OpenAI's routes too (as llama-server answers them there), its ``code`` OpenAI's
``context_length_exceeded``.
"""

from __future__ import annotations

import re
from typing import Dict, Optional

from ..engine.rpc import RPCServerError
from ..errors import GrammarError, SamplingError

OPENAI = "openai"
LLAMA = "llama"
ANTHROPIC = "anthropic"

# Anthropic's error type for each status (its API's errors page); others: api_error
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}

# llama-server's error type for each status (server-common.cpp, format_error_response)
_LLAMA_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 500: "server_error", 501: "not_supported_error",
                503: "unavailable_error"}


class RequestError(Exception):
    """An answer that is an error: its HTTP status and what the error object says."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None, extra: Optional[dict] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.extra = extra or {}  # llama-server's extra fields (n_prompt_tokens, n_ctx)

    def body(self, dialect: str = OPENAI) -> dict:
        if dialect == ANTHROPIC:
            kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        if dialect == LLAMA:
            if self.code == "context_length_exceeded":
                kind = "exceed_context_size_error"
            else:
                kind = _LLAMA_TYPES.get(self.status, "server_error" if self.status >= 500 else
                                        "invalid_request_error")
            return {"error": {"code": self.status, "message": self.message, "type": kind, **self.extra}}
        if self.code == "context_length_exceeded":
            return {"error": {"message": self.message, "type": "exceed_context_size_error", "param": self.param,
                              "code": self.code, **self.extra}}
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class Cancelled(Exception):
    """A request stopped before its end: the client went away, or the server is stopping."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def shutting_down() -> RequestError:
    return RequestError(503, "the server is shutting down", type="server_error", code="shutting_down")


def unavailable(reason: str) -> RequestError:
    return RequestError(503, f"the model cannot serve: {reason}; restart the server", type="server_error",
                        code="model_unavailable")


def from_model_error(error: BaseException, prompt_param: str, grammar_param: Optional[str] = None) -> RequestError:
    """What the model raised, as an answer: the binding's ValueErrors are the request's fault,
    a grammar no token can continue too; a sampler that threw or a lost RPC server the server's."""
    if isinstance(error, RequestError):
        return error
    if isinstance(error, Cancelled):
        if error.reason == "shutdown":
            return shutting_down()
        return RequestError(499, "the request was cancelled", code="cancelled")
    text = str(error)
    if isinstance(error, RPCServerError):
        return unavailable(text)
    if isinstance(error, GrammarError):
        return RequestError(400, f"{text} (the request's grammar, response_format or tool_choice cannot be "
                            "met by this model)", param=grammar_param, code="grammar_error")
    if isinstance(error, SamplingError):
        return RequestError(500, text, type="server_error", code="sampling_failed")
    if isinstance(error, ValueError):
        if "exceed context window" in text:
            # the binding's "Requested tokens (N) exceed context window of C"
            numbers = re.findall(r"\d+", text)
            extra = {"n_prompt_tokens": int(numbers[0]), "n_ctx": int(numbers[-1])} if len(numbers) >= 2 else {}
            return RequestError(400, f"the prompt is too long for the context: {text}; use a shorter "
                                "prompt or start the server with a larger -c",
                                param=prompt_param, code="context_length_exceeded", extra=extra)
        return RequestError(400, text or "invalid request")
    return RequestError(500, f"{type(error).__name__}: {text}", type="server_error")
