"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

from __future__ import annotations

from typing import Dict, Optional


class RequestError(Exception):
    """An answer that is an error: its HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[Dict[str, str]] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class Cancelled(Exception):
    """A request stopped before its end: the client went away, or the server is stopping."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def shutting_down() -> RequestError:
    return RequestError(503, "the server is shutting down", type="server_error", code="shutting_down")


def from_model_error(error: BaseException, prompt_param: str) -> RequestError:
    """What the model raised, as an answer: the binding's ValueErrors are the request's fault."""
    if isinstance(error, RequestError):
        return error
    if isinstance(error, Cancelled):
        if error.reason == "shutdown":
            return shutting_down()
        return RequestError(499, "the request was cancelled", code="cancelled")
    text = str(error)
    if isinstance(error, ValueError):
        if "exceed context window" in text:
            # the binding's "Requested tokens (N) exceed context window of C"
            return RequestError(400, f"the prompt is too long for the context: {text}; use a shorter "
                                "prompt or start the server with a larger -c",
                                param=prompt_param, code="context_length_exceeded")
        return RequestError(400, text or "invalid request")
    return RequestError(500, f"{type(error).__name__}: {text}", type="server_error")
