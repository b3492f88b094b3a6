"""OpenAI's answers: the binding's responses with what OpenAI's clients read besides.

On top of ``create_completion`` / ``create_chat_completion``'s responses and chunks (and the
``timings`` the worker adds): ``system_fingerprint`` (this build's key), ``usage`` with
``prompt_tokens_details.cached_tokens`` (the prompt tokens kept from an earlier request,
``Llama.timings()['cache_n']``), and with ``stream_options.include_usage`` a last chunk whose
``choices`` is empty and whose ``usage`` counts the request (its ``completion_tokens`` are the
tokens sampled, an end-of-generation token included, as llama-server counts them) beside its
``timings``. llama-server's stream options: ``timings_per_token`` (every chunk but a chat's first,
the role's, carries the ``timings`` so far) and ``return_progress`` (a chunk with no text, a chat's
a role delta, carries ``prompt_progress``: ``total``, ``cache``, ``processed``, ``time_ms``, once
the prompt is on a slot and after each batch of it; with ``timings_per_token`` the prompt's
``timings`` so far). A stream's chunks carry one ``id`` and ``created``, the progress chunks' too.
"""

from __future__ import annotations

import functools
import time
import uuid
from typing import List, Optional

from .errors import OPENAI


@functools.lru_cache(maxsize=1)
def system_fingerprint() -> str:
    """A build name as llama-server gives it (``b`` first): the binding's version and this build's
    key, ``b0.3.36-<key>``; it changes when the native build (patches, flags) does."""
    from ..paths import SDIST_VERSION
    from ..native.runtime import require_build

    return f"b{SDIST_VERSION}-" + require_build().root.name[:12]


def _usage(timings: Optional[dict], fallback: Optional[dict] = None) -> Optional[dict]:
    if timings is None:
        return fallback
    if fallback is not None:  # the binding's own counts, with the cached part added
        return dict(fallback, prompt_tokens_details={"cached_tokens": timings["cache_n"]})
    prompt = timings["cache_n"] + timings["prompt_n"]
    return {"prompt_tokens": prompt, "completion_tokens": timings["predicted_n"],
            "total_tokens": prompt + timings["predicted_n"],
            "prompt_tokens_details": {"cached_tokens": timings["cache_n"]}}


def _public(out: dict) -> dict:
    """A completion without the logprobs' token ids (``token_ids``, ``top_ids``: llama-server's
    ``completion_probabilities`` read them; OpenAI's answers have no such fields)."""
    choices = out.get("choices")
    if not choices or not any(isinstance(c.get("logprobs"), dict) and "token_ids" in c["logprobs"] for c in choices):
        return out
    return dict(out, choices=[
        dict(c, logprobs={k: v for k, v in c["logprobs"].items() if k not in ("token_ids", "top_ids")})
        if isinstance(c.get("logprobs"), dict) else c for c in choices])


def _shaped(out: dict) -> dict:
    """A chat answer or chunk as llama-server shapes it: a role delta carries ``content: null``,
    no delta an empty ``content``, and each logprob its token's UTF-8 ``bytes`` (the binding's chat
    logprobs have ``bytes: null``)."""
    choices = out.get("choices")
    if not choices:
        return out
    shaped = []
    for c in choices:
        delta = c.get("delta")
        if isinstance(delta, dict) and "role" in delta and "content" not in delta:
            c = dict(c, delta=dict(delta, content=None))
        elif isinstance(delta, dict) and delta.get("content") == "" and "role" not in delta:
            # llama-server sends no empty content delta (a piece held back, or the last chunk's)
            c = dict(c, delta={k: v for k, v in delta.items() if k != "content"})
        lp = c.get("logprobs")
        if isinstance(lp, dict) and isinstance(lp.get("content"), list):
            c = dict(c, logprobs=dict(lp, content=[_with_bytes(e) for e in lp["content"]]))
        shaped.append(c)
    return dict(out, choices=shaped)


def _with_bytes(entry: dict) -> dict:
    if not isinstance(entry, dict) or entry.get("bytes") is not None or not isinstance(entry.get("token"), str):
        return entry
    out = dict(entry, bytes=list(entry["token"].encode("utf-8")))
    if isinstance(out.get("top_logprobs"), list):
        out["top_logprobs"] = [_with_bytes(t) for t in out["top_logprobs"]]
    return out


def _is_role_chunk(chunk: dict) -> bool:
    """A chat stream's first chunk: the assistant's role, no content."""
    choices = chunk.get("choices") or []
    return bool(choices) and "role" in (choices[0].get("delta") or {})


class Responder:
    """How one OpenAI request's results become answers (see :mod:`.app`)."""

    dialect = OPENAI

    def __init__(self, plan):
        self.plan = plan
        self.fingerprint = system_fingerprint()
        self.id = ("chatcmpl-" if plan.kind == "chat" else "cmpl-") + str(uuid.uuid4())  # a stream's chunks'
        self.created = int(time.time())
        self.choice = 0  # a stream's choice running (n > 1: one after the other)

    def response(self, out: dict, job) -> dict:
        out = dict(_shaped(_public(out)), system_fingerprint=self.fingerprint)
        if self.plan.verbose:  # llama-server's debugging object: the prompt as it ran, the text
            choice = (out.get("choices") or [{}])[0]
            text = choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content")
            out["__verbose"] = {"prompt": self.plan.prompt_text or "", "content": text or ""}
        if out.get("usage") is not None or out.get("timings") is not None:
            out["usage"] = _usage(out.get("timings"), out.get("usage"))
        return out

    def first(self, job) -> List[dict]:
        return []

    def progress(self, report, job) -> List[dict]:
        """A stream's chunk with the prompt's progress (``return_progress``), as llama-server sends it."""
        from .llama_api import progress_json, progress_timings

        if self.plan.kind == "chat":
            choice = {"index": self.choice, "delta": {"role": "assistant", "content": None}, "logprobs": None,
                      "finish_reason": None}
        else:
            choice = {"text": "", "index": self.choice, "logprobs": None, "finish_reason": None}
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.plan.kind == "chat" else "text_completion",
                 "created": self.created, "model": self.plan.kwargs.get("model"), "system_fingerprint": self.fingerprint,
                 "choices": [choice], "prompt_progress": progress_json(report)}
        if self.plan.timings_per_token:
            chunk["timings"] = progress_timings(report)
        return [chunk]

    def events(self, piece: dict, job) -> List[dict]:
        chunk = dict(_shaped(_public(piece["chunk"])), system_fingerprint=self.fingerprint, id=self.id,
                     created=self.created)
        timings = chunk.get("timings")  # the request's, on its last chunk (the worker's)
        if any(c.get("finish_reason") is not None for c in chunk.get("choices") or []):
            self.choice += 1
        if self.plan.timings_per_token and timings is None and not _is_role_chunk(chunk):
            from .llama_api import timings_now

            chunk["timings"] = timings_now(piece, self.plan.n_prompt or 0)
        out = [chunk]
        if timings is not None and self.plan.include_usage:
            out.append({"id": chunk.get("id"), "object": chunk.get("object"), "created": chunk.get("created"),
                        "model": chunk.get("model"), "system_fingerprint": self.fingerprint, "choices": [],
                        "usage": _usage(timings), "timings": timings})
        return out

    def end(self) -> List[str]:
        return ["data: [DONE]\n\n"]
