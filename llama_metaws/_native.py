"""The compiled cffi shim: imported here, and only here; everyone else takes ``ffi``/``lib``."""

from __future__ import annotations

import ctypes
import importlib.util

from . import build as _build
from .errors import NativeBuildMissing
from .runtime import require_build


def _load():
    b = require_build()
    path = _build.find_shim(b)
    if path is None:
        raise NativeBuildMissing(
            f"the cffi shim for build {b.root.name} is not built: run `llama-metaws build`"
        )
    spec = importlib.util.spec_from_file_location("_llama_metaws_native", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_module = _load()
ffi = _module.ffi
lib = _module.lib


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
