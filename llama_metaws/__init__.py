"""llama-metaws: MTP speculative decoding for llama-cpp-python with a phase-aware workspace.

Importing this package points llama-cpp-python at our patched llama.cpp build (see
``runtime.prepare``): import it before ``llama_cpp``.
"""

from . import runtime as _runtime

__version__ = "0.1.0"

_runtime.prepare()
