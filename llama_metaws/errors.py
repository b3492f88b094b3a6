"""Exceptions, and the one place that turns the shim's status codes into them."""

from __future__ import annotations


class LlamaMetawsError(RuntimeError):
    """Base class of the errors llama-metaws raises itself."""


class NativeBuildMissing(LlamaMetawsError, ImportError):
    """The patched native build for the current inputs has not been made yet."""


class BindingVersionError(LlamaMetawsError, ImportError):
    """The installed llama-cpp-python is not the release our patches target."""


def check_error(status: int) -> int:
    """Return ``status`` when it is not negative, else raise the matching exception.

    The message is the shim's own (``lmws_last_error``), recorded by the failing call.
    """
    if status >= 0:
        return status
    from ._native import ffi, lib

    message = ffi.string(lib.lmws_last_error()).decode("utf-8", "replace") or f"status {status}"
    exc = {
        lib.LMWS_EINVAL: ValueError,
        lib.LMWS_ERANGE: IndexError,
        lib.LMWS_ENOMEM: MemoryError,
        lib.LMWS_ENOTSUP: NotImplementedError,
    }.get(status, LlamaMetawsError)
    raise exc(message)
