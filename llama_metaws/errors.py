"""The exceptions llama-metaws raises itself. A leaf: it imports nothing of the package.

The one place that turns the shim's status codes into exceptions is ``_native.check_error``,
next to the compiled module whose codes and messages it reads.
"""

from __future__ import annotations


class LlamaMetawsError(RuntimeError):
    """Base class of the errors llama-metaws raises itself."""


class NativeBuildMissing(LlamaMetawsError, ImportError):
    """The patched native build this checkout needs is missing or stale: run ``llama-metaws build``."""


class BindingVersionError(LlamaMetawsError, ImportError):
    """The installed llama-cpp-python is not the release our patches target."""


class SamplingError(LlamaMetawsError):
    """llama.cpp's sampler failed on one request (what it threw, caught in the shim); the process
    and the model go on."""


class GrammarError(SamplingError, ValueError):
    """A grammar that does not parse (llama.cpp's parse message), or one that no token can
    continue: every token of the vocabulary ruled out, or a token given to ``accept`` that it
    does not allow. The request's fault: nothing was accepted."""


class ChatLayerError(LlamaMetawsError, ValueError):
    """llama.cpp's chat layer refused (what it threw, caught in the shim): a template that does
    not parse or cannot render the messages, messages or tools it cannot read, a schema it
    cannot turn into a grammar. The request's fault; the process goes on."""


class PlanError(ValueError):
    """The planner cannot map its input (a config field, a flag); the message names it."""


__all__ = ["PlanError", "LlamaMetawsError", "NativeBuildMissing", "BindingVersionError", "SamplingError",
           "GrammarError", "ChatLayerError"]
