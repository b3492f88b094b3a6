"""OpenAI's answers: the binding's responses with what OpenAI's clients read besides.

On top of ``create_completion`` / ``create_chat_completion``'s responses and chunks (and the
``timings`` the worker adds): ``system_fingerprint`` (this build's key), ``usage`` with
``prompt_tokens_details.cached_tokens`` (the prompt tokens kept from an earlier request,
``Llama.timings()['cache_n']``), and with ``stream_options.include_usage`` a last chunk whose
``choices`` is empty and whose ``usage`` counts the request (its ``completion_tokens`` are the
tokens sampled, an end-of-generation token included, as llama-server counts them).
"""

from __future__ import annotations

import functools
from typing import List, Optional

from .errors import OPENAI


@functools.lru_cache(maxsize=1)
def system_fingerprint() -> str:
    """``fp_`` and this build's key: it changes when the native build (patches, flags) does."""
    from ..native.runtime import require_build

    return "fp_" + require_build().root.name[:12]


def _usage(timings: Optional[dict], fallback: Optional[dict] = None) -> Optional[dict]:
    if timings is None:
        return fallback
    if fallback is not None:  # the binding's own counts, with the cached part added
        return dict(fallback, prompt_tokens_details={"cached_tokens": timings["cache_n"]})
    prompt = timings["cache_n"] + timings["prompt_n"]
    return {"prompt_tokens": prompt, "completion_tokens": timings["predicted_n"],
            "total_tokens": prompt + timings["predicted_n"],
            "prompt_tokens_details": {"cached_tokens": timings["cache_n"]}}


class Responder:
    """How one OpenAI request's results become answers (see :mod:`.app`)."""

    dialect = OPENAI

    def __init__(self, plan):
        self.plan = plan
        self.fingerprint = system_fingerprint()

    def response(self, out: dict, job) -> dict:
        out = dict(out, system_fingerprint=self.fingerprint)
        if out.get("usage") is not None or out.get("timings") is not None:
            out["usage"] = _usage(out.get("timings"), out.get("usage"))
        return out

    def first(self, job) -> List[dict]:
        return []

    def events(self, piece: dict, job) -> List[dict]:
        chunk = dict(piece["chunk"], system_fingerprint=self.fingerprint)
        out = [chunk]
        timings = chunk.get("timings")
        if timings is not None and self.plan.include_usage:
            out.append({"id": chunk.get("id"), "object": chunk.get("object"), "created": chunk.get("created"),
                        "model": chunk.get("model"), "system_fingerprint": self.fingerprint, "choices": [],
                        "usage": _usage(timings)})
        return out

    def end(self) -> List[str]:
        return ["data: [DONE]\n\n"]
