"""The compiled cffi shim: imported here, and only here; everyone else takes ``ffi``/``lib``.

``check_error`` lives here too, next to the module whose status codes and last-error message
it reads (as pygit2's ``errors.check_error`` sits beside its ``ffi``).
"""

from __future__ import annotations

import ctypes
import importlib.util

from ..errors import ChatLayerError, GrammarError, LlamaMetawsError, NativeBuildMissing, SamplingError
from .runtime import require_build


def _load():
    b = require_build()
    path = b.shim_path
    if path is None or not path.is_file():
        raise NativeBuildMissing(
            f"the cffi shim for build {b.root.name} is missing: run `llama-metaws build`")
    spec = importlib.util.spec_from_file_location("_llama_metaws_native", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_module = _load()
ffi = _module.ffi
lib = _module.lib


def check_error(status: int) -> int:
    """Return ``status`` when it is not negative, else raise the matching exception.

    The message is the shim's own (``lmws_last_error``), recorded by the failing call.
    """
    if status >= 0:
        return status
    message = ffi.string(lib.lmws_last_error()).decode("utf-8", "replace") or f"status {status}"
    exc = {
        lib.LMWS_EINVAL: ValueError,
        lib.LMWS_ERANGE: IndexError,
        lib.LMWS_ENOMEM: MemoryError,
        lib.LMWS_ENOTSUP: NotImplementedError,
        lib.LMWS_EGRAMMAR: GrammarError,
        lib.LMWS_ESAMPLER: SamplingError,
        lib.LMWS_ECHAT: ChatLayerError,
    }.get(status, LlamaMetawsError)
    raise exc(message)


def address(ptr) -> int:
    """The address behind a ctypes pointer, a cffi pointer or an int (0 for NULL)."""
    if ptr is None:
        return 0
    if isinstance(ptr, int):
        return ptr
    if isinstance(ptr, ffi.CData):
        return int(ffi.cast("uintptr_t", ptr))
    value = ctypes.cast(ptr, ctypes.c_void_p).value
    return value or 0
