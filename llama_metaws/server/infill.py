"""``POST /infill``: llama-server's fill-in-the-middle request, for models with FIM tokens.

The request is ``/completion``'s (every field of :mod:`.llama_api` applies, ``stream`` included)
with ``input_prefix`` and ``input_suffix`` (both required), ``input_extra`` (optional: other
files, ``[{"filename": ..., "text": ...}]``) and an optional ``prompt`` (text the middle starts
with). Its prompt is laid out as llama-server lays it out (Qwen2.5-Coder's repo-level pattern)::

    [FIM_REP]myproject\\n [FIM_SEP]filename0\\n extra0 ... [FIM_SEP]filename\\n
    [FIM_PRE]prefix prompt [FIM_SUF]suffix [FIM_MID]

(``--spm-infill``: the suffix before the prefix), the prefix cut to its last ``3 * n_batch / 4``
tokens and the suffix to what is left of a quarter batch, the extra files to what the context has
left beyond one batch and twice ``-n``. Without a FIM separator token the extra files are joined
with a ``--- snippet ---`` line, and without a repo token there is no project line. A model
whose vocabulary lacks the prefix, suffix or middle token gets a 400 that names them, with
llama-server's message (llama-server itself answers it with a 501: bad input for this model is a
client's error here).
"""

from __future__ import annotations

from typing import List, Optional

from ..native.binding import llama_cpp
from . import llama_api
from .errors import RequestError
from .validation import ModelAccess

_SNIPPET = "\n\n--- snippet ---\n\n"  # llama-server's separator of extra chunks without FIM_SEP


class FimTokens:
    """The vocabulary's FIM tokens (None where it has none)."""

    NAMES = ("pre", "suf", "mid", "rep", "sep")

    def __init__(self, llm):
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        for name in self.NAMES:
            token = int(getattr(llama_cpp, f"llama_vocab_fim_{name}")(vocab))
            setattr(self, name, None if token < 0 else token)
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        self.bos = int(llama_cpp.llama_vocab_bos(vocab))

    def missing(self) -> List[str]:
        labels = {"pre": "prefix", "suf": "suffix", "mid": "middle"}
        return [labels[n] for n in ("pre", "suf", "mid") if getattr(self, n) is None]


def _bad(message: str, param: str) -> RequestError:
    return RequestError(400, message, param=param, code="invalid_value")


def _text(body: dict, key: str, required: bool) -> str:
    if key not in body:
        if required:
            raise _bad(f'"{key}" is required', key)
        return ""
    value = body[key]
    if not isinstance(value, str):
        raise _bad(f'"{key}" must be a string', key)
    return value


def _extra(body: dict) -> List[dict]:
    extra = body.get("input_extra", [])
    if extra is None:
        return []
    if not isinstance(extra, list):
        raise _bad('"input_extra" must be an array of {"filename": string, "text": string}', "input_extra")
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise _bad('extra_context chunk must contain a "text" field with a string value', "input_extra")
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise _bad("extra_context chunk's \"filename\" field must be a string", "input_extra")
    return extra


def layout(model: ModelAccess, fim: FimTokens, prefix: str, suffix: str, extra: List[dict], prompt: str, *,
           n_batch: int, n_predict: int, spm: bool, tokens: Optional[dict] = None) -> List[int]:
    """The infill prompt's token ids (see the module docstring)."""
    tokens = {} if tokens is None else tokens

    def tok(text: str, special: bool = False) -> List[int]:
        return list(model.tokenize(text, add_bos=False, special=special, tokens=tokens)) if text else []

    head: List[int] = []
    if fim.rep is not None:
        head += [fim.rep] + tok("myproject\n")
    for chunk in extra:
        if fim.sep is not None:
            head += [fim.sep] + tok(chunk.get("filename", "tmp") + "\n")
        else:
            head += tok(_SNIPPET)
        head += tok(chunk["text"])
    if fim.sep is not None:
        head += [fim.sep] + tok("filename\n")

    pre, suf, mid = tok(prefix, special=True), tok(suffix, special=True), tok(prompt, special=True)
    n_pre = min(len(pre), 3 * (n_batch // 4))
    n_suf = min(len(suf), max(0, n_batch // 4 - (2 + len(mid))))
    n_head = min(max(0, model.n_ctx - n_batch - 2 * n_predict), len(head))
    pre = [fim.pre] + pre[len(pre) - n_pre:] + mid
    suf = [fim.suf] + suf[:n_suf]
    first, second = (suf, pre) if spm else (pre, suf)
    if fim.add_bos:
        first = [fim.bos] + first
    return head[len(head) - n_head:] + first + second + [fim.mid]


def infill(body: dict, model: ModelAccess):
    """``POST /infill``: :func:`.llama_api.completion`'s plan and options for the laid-out prompt (one pair)."""
    return llama_api.completion(request(body, model), model)


def request(body: dict, model: ModelAccess) -> dict:
    """The infill request as a ``/completion`` body whose prompt is the laid-out token ids."""
    fim = FimTokens(model.llm)
    missing = fim.missing()
    if missing:
        raise RequestError(400, "Infill is not supported by this model: "
                           + " ".join(f"{m} token is missing." for m in missing),
                           param="input_prefix", code="infill_unsupported")
    prompt = _text(body, "prompt", required=False)
    prefix = _text(body, "input_prefix", required=True)
    suffix = _text(body, "input_suffix", required=True)
    extra = _extra(body)
    n_predict = model.n_predict if model.n_predict is not None else -1
    ids = layout(model, fim, prefix, suffix, extra, prompt, n_batch=model.n_batch, n_predict=n_predict,
                 spm=model.spm_infill)
    out = {k: v for k, v in body.items() if k not in ("input_prefix", "input_suffix", "input_extra")}
    out["prompt"] = ids
    return out
