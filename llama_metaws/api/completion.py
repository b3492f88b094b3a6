"""Completions as ``llama_cpp.Llama.create_completion`` answers them, over the engine's requests.

:func:`completion` takes ``create_completion``'s arguments and yields what the binding yields:
the response dict, or with ``stream=True`` its chunks, with the same tokens, text, stop-string
handling (a stream holds back text that could be the start of a stop string), UTF-8 handling,
logprobs and usage. What differs is underneath: the prompt becomes an engine
:class:`~llama_metaws.engine.request.Request` and the tokens come from the engine's thread, so
that several threads' completions on one ``Llama`` run in the same steps. Logprobs need no
``logits_all``: the engine returns the logits row each token was sampled from (and with ``echo``,
the prompt's rows). Each logprobs object also carries ``token_ids`` (the tokens' ids) and
``top_ids`` (per token, its ``[id, logprob]`` pairs, best first): what llama-server's
``completion_probabilities`` need, which the binding's text-keyed ``top_logprobs`` cannot give
(two tokens may print alike); the OpenAI answers leave them out.
"""

from __future__ import annotations

import random
import time
import uuid
import warnings
from typing import Iterator, List, Optional

import numpy as np

from ..engine.request import Request
from ..engine.samplers import SamplingParams
from ..native.binding import llama_cpp

__all__ = ["completion", "prompt_tokens"]

#: a closed completion waits this long at most for its request to end (one engine step)
CLOSE_WAIT_S = 60.0


def prompt_tokens(llm, prompt, suffix: Optional[str]) -> List[int]:
    """The tokens ``create_completion`` evaluates for ``prompt`` (a string or token ids), as the
    binding assembles them: the model's BOS (or CLS) and EOS (or SEP) tokens where it adds them
    to text, the prompt's text tokenized with special tokens parsed; a list of ids as it is."""
    model = llm._model
    is_text = isinstance(prompt, str)
    begin = [model.token_cls()] if model.token_cls() != -1 else [llm.token_bos()]
    end = [model.token_sep()] if model.token_sep() != -1 else [llm.token_eos()]
    as_given = not is_text and suffix is None
    if as_given or not model.add_bos_token() or begin[0] == -1:
        begin = []
    if as_given or (not model.add_eos_token() and model.token_sep() == -1):
        end = []
    if is_text:
        body = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True) if prompt else []
    else:
        body = list(prompt)
    infill = []  # the binding's fill-in-the-middle ids are 0: a suffix adds [0] + its tokens + [0]
    if suffix is not None:
        suffix_tokens = llm.tokenize(suffix.encode("utf-8"), add_bos=False, special=False) if suffix else []
        body = [0] + body
        infill = [0] + suffix_tokens + [0]
        if getattr(llm, "spm_infill", False):
            return begin + infill[:-1] + body + infill[-1:] + end
    return begin + body + infill + end


def _utf8_wait(text: bytes, wait: int) -> int:
    """Tokens to wait before ``text`` (the completion so far) is whole UTF-8 again, as the binding
    counts them: a lead byte among the last three bytes whose sequence needs more bytes than
    follow it sets the count; otherwise ``wait`` carries on."""
    for k, ch in enumerate(text[-3:]):
        k = 3 - k
        for need, lead in ((2, 0xC0), (3, 0xE0), (4, 0xF0)):
            if need > k and ch & lead == lead:
                wait = need - k
    return wait


def _stop_prefix_len(text: bytes, stops: List[bytes]) -> int:
    """The longest end of ``text`` that begins one of ``stops``."""
    best = 0
    for s in stops:
        for i in range(min(len(s), len(text)), 0, -1):
            if text.endswith(s[:i]):
                best = max(best, i)
                break
    return best


class _Logprobs:
    """The binding's logprobs objects from logits rows."""

    def __init__(self, llm, n: int):
        self.llm, self.n = llm, n

    def entry(self, row: np.ndarray, token: int, token_str: str, prev: List[int], top_prev=None):
        """The token's logprob, the binding's ``{text: logprob}`` of the best, and the best as
        ``[id, logprob]`` pairs."""
        lp = llama_cpp.Llama.logits_to_logprobs(row)
        # the binding's order: by logprob, then by token id, both descending
        order = np.lexsort((np.arange(lp.shape[0]), lp))[::-1][: self.n]
        detok = self.llm.detokenize
        top = {detok([int(i)], prev_tokens=top_prev).decode("utf-8", errors="ignore"): float(lp[i]) for i in order}
        top[token_str] = float(lp[int(token)])
        return float(lp[int(token)]), top, [[int(i), float(lp[i])] for i in order]


class _RenderingPreserved:
    """``llm`` whose ``detokenize`` renders the ``preserved`` tokens as text (a chat's preserved
    tokens, as llama-server renders them: ``<tool_call>`` and kin, which a model's vocabulary
    may hold as control tokens, reach the chat layer's parser), everything else ``llm``'s."""

    def __init__(self, llm, preserved):
        self._llm, self._preserved = llm, preserved

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def detokenize(self, tokens, prev_tokens=None, special: bool = False) -> bytes:
        out, run, prev = b"", [], list(prev_tokens or [])
        for t in list(tokens) + [None]:
            if t is None or t in self._preserved:
                if run:
                    out += self._llm.detokenize(run, prev_tokens=prev or None, special=special)
                    prev += run
                    run = []
                if t is not None:
                    out += self._llm.detokenize([t], prev_tokens=prev or None, special=True)
                    prev.append(t)
            else:
                run.append(t)
        return out


def _processors(logits_processor, logit_bias) -> list:
    """The request's logits processors, the logit bias last (as the binding adds it)."""
    processors = list(logits_processor) if logits_processor else []
    if logit_bias:
        bias = {int(k): float(v) for k, v in logit_bias.items()}

        def add_bias(input_ids, scores):
            out = np.copy(scores)
            for token, value in bias.items():
                out[token] = value + scores[token]
            return out

        processors.append(add_bias)
    return processors


def _token_budget(n_ctx: int, n_prompt: int, max_tokens: Optional[int], shift: bool = False) -> int:
    """The tokens a completion may generate, as the binding bounds them by the context (with
    context shift, a ``max_tokens`` given is not bounded: the context shifts to make room)."""
    if n_prompt == 0:
        raise ValueError("the prompt is empty and the model adds no BOS token: give at least one token")
    if n_prompt >= n_ctx:
        raise ValueError(f"Requested tokens ({n_prompt}) exceed context window of {n_ctx}")
    if max_tokens is None or max_tokens <= 0:
        max_tokens = n_ctx - n_prompt
    elif shift:
        return max_tokens
    return max_tokens if max_tokens + n_prompt < n_ctx else n_ctx - n_prompt


def completion(llm, prompt, suffix: Optional[str] = None, max_tokens: Optional[int] = 16, temperature: float = 0.8,
               top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0, logprobs: Optional[int] = None,
               echo: bool = False, stop=None, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
               repeat_penalty: float = 1.0, top_k: int = 40, stream: bool = False, seed: Optional[int] = None,
               tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
               model: Optional[str] = None, stopping_criteria=None, logits_processor=None, grammar=None,
               logit_bias=None, stream_usage: bool = False, preserved_tokens=None,
               reasoning_budget=None, id_slot: Optional[int] = None, cache_prompt: bool = True) -> Iterator[dict]:
    """``create_completion``'s generator (see the module docstring); ``id_slot`` and
    ``cache_prompt``: llama-server's request fields, the engine request's ``slot`` and
    ``cache_prompt`` (``Llama.create_completion`` checks them); ``stream_usage``: a streamed
    completion ends with a chunk carrying ``usage`` and no choices (OpenAI's
    ``stream_options.include_usage``); ``preserved_tokens``: token ids whose text the completion
    shows although they are special, ``reasoning_budget``: a
    :class:`~llama_metaws.engine.samplers.ReasoningBudget` (both a chat's, :mod:`llama_metaws.api.chat_layer`)."""
    assert suffix is None or isinstance(suffix, str)
    if preserved_tokens:
        llm = _RenderingPreserved(llm, frozenset(preserved_tokens))
    engine = llm._engine
    completion_id = f"cmpl-{uuid.uuid4()}"
    created = int(time.time())
    bos = llm.token_bos()
    tokens = prompt_tokens(llm, prompt, suffix)
    completion_tokens: List[int] = [] if len(prompt) > 0 else [bos]
    stops = [s.encode("utf-8") for s in (stop if isinstance(stop, list) else [stop] if isinstance(stop, str) else [])]
    model_name = model if model is not None else llm.model_path
    if tokens[:2] == [bos] * 2:
        warnings.warn(f'Detected duplicate leading "{llm._model.token_get_text(bos)}" in prompt, this will likely '
                      "reduce response quality, consider removing it...", RuntimeWarning)
    processors = _processors(logits_processor, logit_bias)
    max_tokens = _token_budget(engine.n_ctx_seq, len(tokens), max_tokens, engine.context_shift)
    if llm.cache:
        llm._cache_lookup(tokens)
    seed = llm._request_seed(seed)
    sampling = SamplingParams(temp=temperature, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                              repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                              presence_penalty=presence_penalty, mirostat_mode=mirostat_mode,
                              mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta,
                              penalty_last_n=llm.last_n_tokens_size, seed=seed, grammar=grammar,
                              logits_processor=processors or None, reasoning_budget=reasoning_budget)
    want_rows = logprobs is not None
    req = Request(tokens, sampling, max_tokens=max_tokens, stopping_criteria=stopping_criteria,
                  logits_rows=want_rows, prompt_rows=want_rows and echo, stop=stops, slot=id_slot,
                  cache_prompt=cache_prompt)
    llm._began(req)
    engine.submit(req)
    rows: List[np.ndarray] = []
    prompt_rows = None
    finish_reason = "length"
    text = b""
    returned = 0
    lp = _Logprobs(llm, logprobs or 0)
    detok = llm.detokenize

    def chunk(text_piece: str, logprobs_obj=None, finish=None) -> dict:
        return {"id": completion_id, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"text": text_piece, "index": 0, "logprobs": logprobs_obj, "finish_reason": finish}]}

    try:
        ended = None
        wait = 0
        stopped = False
        for out in req.outputs():
            if out.prompt_rows is not None:
                prompt_rows = out.prompt_rows
            for j, token in enumerate(out.tokens):
                completion_tokens.append(token)
                if want_rows:
                    rows.append(out.rows[j])
                all_text = detok(completion_tokens, prev_tokens=tokens)
                wait = _utf8_wait(all_text, wait)
                if wait > 0:  # inside a UTF-8 sequence: nothing is checked or sent yet
                    wait -= 1
                    continue
                hit = [s for s in stops if s in all_text]
                if hit:
                    text = all_text[: all_text.index(hit[0])]
                    finish_reason = "stop"
                    stopped = True
                    break
                if stream:
                    for c in _stream_pieces(llm, tokens, completion_tokens, returned, rows, stops, lp, prompt,
                                            logprobs, bos):
                        returned = c[0]
                        yield chunk(*c[1:])
                if len(completion_tokens) >= max_tokens:
                    text = detok(completion_tokens, prev_tokens=tokens)
                    finish_reason = "length"
                    stopped = True
                    break
            if stopped:
                break
            if out.finish is not None:
                ended = out.finish
        if not stopped and ended is not None:
            text = detok(completion_tokens, prev_tokens=tokens)
            # as llama-server reports it: "stop" for an end-of-generation token or a stop word
            # only; a request cancelled (closed, shut down) keeps its default, "length"
            finish_reason = "stop" if ended == "stop" else "length"
    finally:
        req.cancel("closed", wait=CLOSE_WAIT_S)  # the slot is free when this returns (a no-op once it ended)
    llm._ended(req)

    if stream:
        for c in _stream_rest(llm, tokens, completion_tokens, returned, rows, stops, lp, prompt, logprobs, bos):
            yield chunk(*c)
        yield chunk("", None, finish_reason)
        if llm.cache:
            llm._cache_store(tokens + completion_tokens)
        if stream_usage:
            yield {"id": completion_id, "object": "text_completion", "created": created, "model": model_name,
                   "choices": [], "usage": _usage(tokens, completion_tokens)}
        return

    if llm.cache:
        llm._cache_store(tokens + completion_tokens)
    text_str = text.decode("utf-8", errors="ignore")
    if echo:
        text_str = prompt + text_str
    logprobs_obj = None
    if logprobs is not None:
        logprobs_obj = _final_logprobs(llm, tokens, completion_tokens, rows, prompt_rows, echo, prompt, logprobs, bos)
    yield {"id": completion_id, "object": "text_completion", "created": created, "model": model_name,
           "choices": [{"text": text_str, "index": 0, "logprobs": logprobs_obj, "finish_reason": finish_reason}],
           "usage": _usage(tokens, completion_tokens)}


def _usage(tokens, completion_tokens) -> dict:
    return {"prompt_tokens": len(tokens), "completion_tokens": len(completion_tokens),
            "total_tokens": len(tokens) + len(completion_tokens)}


def _row_of(rows, i):
    return rows[i] if 0 <= i < len(rows) else None


def _stream_pieces(llm, tokens, completion_tokens, returned, rows, stops, lp, prompt, logprobs, bos):
    """Pieces of a stream that are safe to send now: ``(returned, text, logprobs, None)``; text that
    could begin a stop string is held back."""
    detok = llm.detokenize
    remaining = completion_tokens[returned:]
    remaining_text = detok(remaining, prev_tokens=tokens + completion_tokens[:returned])
    hold = _stop_prefix_len(remaining_text, stops)
    end_pos = 0
    if logprobs is not None:
        for token in remaining:
            if token == bos:
                continue
            prev = tokens + completion_tokens[:returned]
            piece = detok([token], prev_tokens=prev)
            end_pos += len(piece)
            if end_pos > len(remaining_text) - hold:
                break
            token_str = piece.decode("utf-8", errors="ignore")
            offset = len(prompt) + len(detok(completion_tokens[:returned], prev_tokens=prev).decode("utf-8", errors="ignore"))
            row = _row_of(rows, returned)
            value, top, ranked = lp.entry(row, token, token_str, None)
            obj = {"tokens": [token_str], "text_offset": [offset], "token_logprobs": [value], "top_logprobs": [top],
                   "token_ids": [int(token)], "top_ids": [ranked]}
            returned += 1
            yield (returned, detok([token], prev_tokens=tokens + completion_tokens[:returned]).decode(
                "utf-8", errors="ignore"), obj, None)
        return
    while remaining:
        for i in range(1, len(remaining) + 1):
            try:
                bs = detok(remaining[:i], prev_tokens=tokens + completion_tokens[:returned])
                ts = bs.decode("utf-8")
                break
            except UnicodeError:
                pass
        else:
            return  # what is left is not yet whole UTF-8
        end_pos += len(bs)
        if end_pos > len(remaining_text) - hold:
            return
        remaining = remaining[i:]
        returned += i
        yield (returned, ts, None, None)


def _stream_rest(llm, tokens, completion_tokens, returned, rows, stops, lp, prompt, logprobs, bos):
    """The stream's last pieces once generation ended: up to the first stop string."""
    detok = llm.detokenize
    remaining = completion_tokens[returned:]
    remaining_text = detok(remaining, prev_tokens=tokens + completion_tokens[:returned])
    hit = [s for s in stops if s in remaining_text]
    end = min(remaining_text.index(s) for s in hit) if hit else len(remaining_text)
    end_pos = 0
    for token in remaining:
        end_pos += len(detok([token], prev_tokens=tokens + completion_tokens[:returned]))
        obj = None
        if logprobs is not None:
            if token == bos:
                continue
            token_str = detok([token]).decode("utf-8", errors="ignore")
            offset = len(prompt) + len(detok(completion_tokens[:returned],
                                             prev_tokens=tokens + completion_tokens[:returned]))
            value, top, ranked = lp.entry(_row_of(rows, returned), token, token_str, None)
            obj = {"tokens": [detok([token]).decode("utf-8", errors="ignore")], "text_offset": [offset],
                   "token_logprobs": [value], "top_logprobs": [top], "token_ids": [int(token)], "top_ids": [ranked]}
        if end_pos >= end:
            last = detok([token])
            if end_pos == end - 1:
                break
            yield (last[: len(last) - (end_pos - end)].decode("utf-8", errors="ignore"), obj, None)
            return
        returned += 1
        yield (detok([token]).decode("utf-8", errors="ignore"), obj, None)


def _final_logprobs(llm, tokens, completion_tokens, rows, prompt_rows, echo, prompt, logprobs, bos) -> dict:
    detok = llm.detokenize
    text_offset = 0 if echo else len(prompt)
    if echo:
        all_tokens = tokens[1 if tokens and tokens[0] == bos else 0:] + completion_tokens
        all_rows = list(prompt_rows if prompt_rows is not None else []) + list(rows)
    else:
        all_tokens = completion_tokens
        all_rows = list(rows)
    strs = [detok([t], prev_tokens=all_tokens[:i]).decode("utf-8", errors="ignore") for i, t in enumerate(all_tokens)]
    offsets, values, toks, tops, ids, ranks = [], [], [], [], [], []
    lp = _Logprobs(llm, logprobs)
    for idx, (token, token_str, row) in enumerate(zip(all_tokens, strs, all_rows)):
        if token == bos:
            continue
        offsets.append(text_offset + len(detok(all_tokens[:idx]).decode("utf-8", errors="ignore")))
        toks.append(token_str)
        value, top, ranked = lp.entry(row, token, token_str, all_tokens[:idx])
        values.append(value)
        tops.append(top)
        ids.append(int(token))
        ranks.append(ranked)
    if echo and all_tokens:  # OpenAI's API gives no logprob for the first token
        values[0] = None
        tops[0] = None
    return {"tokens": toks, "text_offset": offsets, "token_logprobs": values, "top_logprobs": tops,
            "token_ids": ids, "top_ids": ranks}
