"""llama-cpp-python, importable only after the build check: everyone imports the binding from here.

``import llama_metaws`` points ``LLAMA_CPP_LIB_PATH`` at the patched build (``runtime``); this
module first makes sure that build exists, so a missing one is a clear ``NativeBuildMissing``
naming the command to run instead of the binding's "library not found".
"""

from __future__ import annotations

from . import runtime as _runtime

_runtime.require_build()

import llama_cpp  # noqa: E402
import llama_cpp.llama_cpp as llama_cpp_lib  # noqa: E402  (the ctypes layer: llama.h one to one)
import llama_cpp.llama_cpp_ext as llama_ext  # noqa: E402  (llama-ext.h: the NextN calls)
from llama_cpp import _internals  # noqa: E402
from llama_cpp._logger import set_verbose  # noqa: E402
from llama_cpp.llama_speculative import LlamaDraftModel  # noqa: E402

__all__ = ["llama_cpp", "llama_cpp_lib", "llama_ext", "_internals", "set_verbose", "LlamaDraftModel"]
