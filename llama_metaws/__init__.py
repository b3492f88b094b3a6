"""llama-metaws: MTP speculative decoding for llama-cpp-python with a phase-aware workspace.

Importing this package points llama-cpp-python at our patched llama.cpp build (see
``runtime.prepare``): import it before ``llama_cpp``.
"""

import importlib.metadata as _metadata

from .native import runtime as _runtime

try:  # the version is pyproject.toml's alone
    __version__ = _metadata.version("llama-metaws")
except _metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
    __version__ = "0+unknown"

_runtime.prepare()


def __getattr__(name):
    # the high-level classes load llama_cpp: only when asked for (the CLI's build runs without)
    if name in ("Llama", "LlamaOptions"):
        from .api import llama as _llama

        return getattr(_llama, name)
    raise AttributeError(f"module 'llama_metaws' has no attribute {name!r}")
