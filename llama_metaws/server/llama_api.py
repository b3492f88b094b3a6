"""llama-server's own API (tools/server/README.md of the vendored llama.cpp), on the same model.

``POST /completion`` (also ``/completions``, as llama-server routes it): its request fields and
its answer shape, streamed (``data: {...}`` events, the last one with ``"stop": true`` and the
timings, no ``[DONE]``) or not; ``POST /tokenize``, ``/detokenize``, ``/apply-template``;
``GET /props``; ``GET /slots`` (one entry per engine slot, ``-np``). Errors in
llama-server's shape (:mod:`.errors`).

Request fields of ``/completion``: ``prompt`` (a string, token ids, both mixed, or an object with
``prompt_string``; or a list of such prompts, answered as a list of results: :func:`prompts_of`),
``n_predict`` (or ``max_tokens``; -1: up to the context; 0: the prompt is
tokenized, nothing is generated), ``temperature``, ``top_k``, ``top_p``, ``min_p``,
``typical_p``, ``repeat_penalty``, ``presence_penalty``, ``frequency_penalty``, ``mirostat``,
``mirostat_tau``, ``mirostat_eta``, ``seed``, ``stop``, ``stream``, ``grammar``, ``json_schema``,
``logit_bias`` (its array and object forms, ids or strings, ``false`` for never),
``ignore_eos``, ``min_tokens``, ``n_probs`` (``completion_probabilities``: each token's ``id``,
``token``, ``bytes`` and ``logprob`` with the ``n_probs`` best as ``top_logprobs``; with
``post_sampling_probs``, ``prob`` and ``top_probs`` after the sampler's truncation and
temperature), ``id_slot`` (-1: any slot; else the slot to run on), ``cache_prompt``
(true, the default: reuse the prefix of the prompt the slot holds), ``return_tokens``, ``return_progress`` (a
stream's ``prompt_progress`` events: one once the prompt is on a slot, one after each batch of it),
``timings_per_token``, ``response_fields``.
Their types are checked by :class:`~.validation.LlamaCompletionBody`. Accepted and without effect
here: :data:`IGNORED`. Refused unless at their "off" value: :data:`~.validation.OFF_ONLY`. Any
other field is ignored, as llama-server ignores fields it does not know.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from .errors import LLAMA, RequestError
from .validation import LlamaCompletionBody, MessagesBody, ModelAccess, Plan, validated

#: llama-server's fields that change nothing here: the sampler chain is the binding's own order,
#: the others shape what this server does not do
IGNORED = ("samplers", "n_keep", "n_discard", "n_cache_reuse", "min_keep", "dynatemp_exponent",
           "dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "xtc_threshold",
           "repeat_last_n", "sse_ping_interval", "top_n_sigma", "message_delimiters",
           "model")

_NUMBERS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
            "typical_p": "typical_p", "repeat_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty", "mirostat": "mirostat_mode", "mirostat_tau": "mirostat_tau",
            "mirostat_eta": "mirostat_eta"}
_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 1.0, "repeat_penalty": 1.0,
             "presence_penalty": 0.0, "frequency_penalty": 0.0, "mirostat_mode": 0, "mirostat_tau": 5.0,
             "mirostat_eta": 0.1}


def _bad(param: str, why: str) -> RequestError:
    return RequestError(400, f"invalid {param!r}: {why}", param=param, code="invalid_value")


def prompt_tokens(model: ModelAccess, content, param: str, add_special: bool, parse_special: bool,
                  tokens: dict) -> List[int]:
    """llama-server's prompt forms as token ids: a string, ids, or ids and strings mixed (a BOS
    only where the first element is a string and ``add_special``)."""
    if isinstance(content, str):
        return list(model.tokenize(content, add_bos=add_special, special=parse_special, tokens=tokens))
    if isinstance(content, dict) and "prompt_string" in content:
        if content.get("multimodal_data"):
            raise RequestError(400, f"{param!r}: multimodal data is not supported (no model here takes it)",
                               param=param, code="unsupported_value")
        return prompt_tokens(model, content["prompt_string"], param, add_special, parse_special, tokens)
    if not isinstance(content, list):
        raise _bad(param, "a string, a list of token ids, or both mixed is expected")
    out: List[int] = []
    for i, part in enumerate(content):
        if isinstance(part, str):
            out += model.tokenize(part, add_bos=add_special and i == 0, special=parse_special, tokens=tokens)
        elif isinstance(part, int) and not isinstance(part, bool):
            out += model.check_tokens([part], param)
        else:
            raise _bad(param, f"element {i} is neither a token id nor a string")
    return out


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def prompts_of(prompt) -> list:
    """The prompts a ``prompt`` field holds, as llama-server's ``tokenize_input_prompts`` reads it:
    a list with no token id in it is a list of prompts (strings, id lists, ids and strings mixed,
    ``{"prompt_string": ...}`` objects), anything else one prompt; a 400 for an empty list or an
    element that is none of these."""
    if not isinstance(prompt, list) or any(_is_id(p) for p in prompt):
        return [prompt]
    if not prompt:
        raise RequestError(400, "'prompt' is an empty list: send a prompt, or a list of prompts", param="prompt",
                           code="invalid_value")
    for i, p in enumerate(prompt):
        one = isinstance(p, str) or (isinstance(p, dict) and "prompt_string" in p) or \
            (isinstance(p, list) and all(_is_id(x) or isinstance(x, str) for x in p) and
             (not p or any(_is_id(x) for x in p)))
        if not one:
            raise _bad(f"prompt[{i}]", "each prompt of a list must be a string, a list of token ids (strings "
                       "mixed in), or an object with 'prompt_string'")
    return prompt


def _logit_bias(model: ModelAccess, value, eos_never: bool) -> dict:
    pairs = list(value.items()) if isinstance(value, dict) else value if isinstance(value, list) else None
    if pairs is None:
        raise _bad("logit_bias", "an array of [token or string, bias] pairs or an object is expected")
    bias = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise _bad("logit_bias", "each entry must be [token or string, bias]")
        key, score = pair
        if score is False:
            score = float("-inf")
        elif isinstance(score, bool) or not isinstance(score, (int, float)):
            raise _bad("logit_bias", f"the bias of {key!r} must be a number or false")
        if isinstance(key, str) and key.lstrip("-").isdigit() and isinstance(value, dict):
            key = int(key)  # the object form's keys are strings
        ids = model.check_tokens([key], "logit_bias") if isinstance(key, int) and not isinstance(key, bool) else \
            model.tokenize(key, add_bos=False, special=False, tokens={}) if isinstance(key, str) else None
        if ids is None:
            raise _bad("logit_bias", f"{key!r} is neither a token id nor a string")
        for t in ids:
            bias[t] = float(score)
    if eos_never:
        bias[model.llm.token_eos()] = float("-inf")
    return bias


class Options:
    """What shapes a /completion answer besides the model's output (``index``: its prompt's place
    in the request's list of prompts)."""

    def __init__(self, req: LlamaCompletionBody, n_prompt: int, prompt_text: str, settings: dict, index: int = 0):
        self.index = index
        self.return_tokens = bool(req.return_tokens)
        self.return_progress = bool(req.return_progress)
        self.timings_per_token = bool(req.timings_per_token)
        self.response_fields = req.response_fields or []
        self.n_predict_zero = False
        self.n_prompt = n_prompt
        self.prompt_text = prompt_text
        self.settings = settings
        self.stop = settings.get("stop") or []
        self.n_probs = settings.get("n_probs", 0)
        self.post_sampling_probs = bool(req.post_sampling_probs)


def _slot(job) -> int:
    """The engine slot a job ran on (0 before it reached one)."""
    r = getattr(job, "request", None)
    return r.slot if r is not None and r.slot is not None else 0


def _truncated(job) -> bool:
    """llama-server's ``truncated``: the slot's context filled (it shifted, or the answer ended there)."""
    r = getattr(job, "request", None)
    return bool(getattr(r, "truncated", False))


def completion(body: dict, model: ModelAccess) -> List[Tuple[Plan, Options]]:
    """``POST /completion``: a :class:`Plan` and its :class:`Options` for each prompt of the
    request (:func:`prompts_of`)."""
    if "prompt" not in body:
        raise RequestError(400, "'prompt' is required", param="prompt", code="invalid_value")
    prompts = prompts_of(body["prompt"])
    req = validated(LlamaCompletionBody, body, model)
    param = (lambda i: "prompt") if len(prompts) == 1 else (lambda i: f"prompt[{i}]")
    return [_completion(req, model, p, param(i), i) for i, p in enumerate(prompts)]


def _completion(req: LlamaCompletionBody, model: ModelAccess, prompt, param: str,
                index: int) -> Tuple[Plan, Options]:
    kwargs = dict(_DEFAULTS)
    if model.temperature is not None:
        kwargs["temperature"] = model.temperature
    for field, kw in _NUMBERS.items():
        value = getattr(req, field)
        if value is not None:
            kwargs[kw] = int(value) if kw in ("top_k", "mirostat_mode") else float(value)
    n_predict = req.n_predict if req.n_predict is not None else req.max_tokens
    if n_predict is None or n_predict == -1:  # llama-server: -1 (or none) takes the server's -n
        n_predict = model.n_predict if model.n_predict is not None else -1
    stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
    seed = req.seed
    if seed is None and model.seed != -1:  # llama-server's: the server's -s, when it was given
        seed = model.seed
    stream = req.stream
    plan = Plan(kind="completion", kwargs=kwargs, stream=stream, prompt_param=param,
                id_slot=req.id_slot if req.id_slot is not None and req.id_slot >= 0 else None,
                cache_prompt=model.cache_prompt if req.cache_prompt is None else req.cache_prompt,
                return_progress=bool(req.return_progress), timings_per_token=bool(req.timings_per_token))
    ids = prompt_tokens(model, prompt, param, True, True, {})
    if not ids:
        raise RequestError(400, f"the prompt is empty: send a non-empty {param!r}", param=param, code="invalid_value")
    plan.n_prompt = len(ids)
    model.check_context(plan.n_prompt, param)
    kwargs.update(prompt=ids, max_tokens=n_predict if n_predict > 0 else None, stop=stop, stream=stream,
                  seed=None if seed in (None, -1) else seed, model=model.alias)
    grammar = req.grammar
    if req.json_schema is not None:
        grammar, plan.grammar_param = model.schema_grammar(req.json_schema, "json_schema"), "json_schema"
    elif grammar is not None:
        model.check_grammar(grammar, "grammar")
        plan.grammar_param = "grammar"
    if grammar:
        from ..native.binding import llama_cpp

        kwargs["grammar"] = llama_cpp.LlamaGrammar.from_string(grammar, verbose=False)
    plan.min_tokens = req.min_tokens
    if req.logit_bias or req.ignore_eos:
        plan.logit_bias = _logit_bias(model, req.logit_bias or [], bool(req.ignore_eos))
    n_probs = req.n_probs
    if n_probs:
        kwargs["logprobs"] = n_probs
        if req.post_sampling_probs:
            # the candidates top_k leaves (every token without it): the truncation that follows
            # needs them all, and the n_probs best are shown
            k = kwargs["top_k"]
            kwargs["logprobs"] = min(max(n_probs, k if k > 0 else model.n_vocab), model.n_vocab)
    settings = {"n_predict": n_predict, "max_tokens": n_predict, "seed": seed if seed is not None else -1,
                "temperature": kwargs["temperature"], "top_k": kwargs["top_k"], "top_p": kwargs["top_p"],
                "min_p": kwargs["min_p"], "typical_p": kwargs["typical_p"], "repeat_penalty": kwargs["repeat_penalty"],
                "presence_penalty": kwargs["presence_penalty"], "frequency_penalty": kwargs["frequency_penalty"],
                "mirostat": kwargs["mirostat_mode"], "mirostat_tau": kwargs["mirostat_tau"],
                "mirostat_eta": kwargs["mirostat_eta"], "stop": stop, "stream": stream, "n_probs": n_probs,
                "min_keep": 0, "ignore_eos": bool(req.ignore_eos), "grammar": grammar or "",
                "timings_per_token": bool(req.timings_per_token), "speculative": model.drafting,
                # llama-server's list of {token, bias}: -inf (never; ignore_eos's end tokens) is null
                "logit_bias": [{"token": t, "bias": None if b == float("-inf") else b}
                               for t, b in sorted((plan.logit_bias or {}).items())]}
    plan.info = settings
    options = Options(req, plan.n_prompt, model.llm.detokenize(ids, special=True).decode("utf-8", "replace"),
                      settings, index)
    options.n_predict_zero = n_predict == 0
    return plan, options


def timings_now(piece: dict, n_prompt: int) -> dict:
    """A stream event's timings, measured by the worker (``timings_per_token``)."""
    t_first = piece.get("t_first") or piece["t"]
    prompt_ms = (t_first - piece["t_started"]) * 1e3 if piece.get("t_started") else 0.0
    predicted_ms = (piece["t"] - t_first) * 1e3
    n = piece["n_decoded"]
    return {"prompt_n": n_prompt, "prompt_ms": prompt_ms,
            "prompt_per_second": n_prompt / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
            "predicted_n": n, "predicted_ms": predicted_ms,
            "predicted_per_second": n / predicted_ms * 1e3 if predicted_ms > 0 and n else 0.0}


def progress_json(report) -> dict:
    """llama-server's ``prompt_progress`` of an engine :class:`~llama_metaws.engine.request.PromptProgress`."""
    return {"total": report.total, "cache": report.cache, "processed": report.processed,
            "time_ms": int(report.time_ms)}


def progress_timings(report) -> dict:
    """The ``timings`` a prompt progress report carries (``timings_per_token``): the prompt's so
    far, nothing predicted yet; all zero before the first batch."""
    n, ms = report.prompt_n, report.prompt_ms
    return {"cache_n": report.cache, "prompt_n": n, "prompt_ms": ms,
            "prompt_per_token_ms": ms / n if n else 0.0, "prompt_per_second": n / ms * 1e3 if n and ms > 0 else 0.0,
            "predicted_n": 0, "predicted_ms": 0.0, "predicted_per_token_ms": 0.0, "predicted_per_second": 0.0}


def _post_sampling(ranked: List[list], settings: dict) -> List[tuple]:
    """``(id, prob)`` after the binding's chain truncates and tempers the ``top_k`` candidates
    (``ranked``: ``[id, logprob]``, best first): top-p, min-p, then the temperature; best first,
    no zero probabilities."""
    import math

    if not ranked:
        return []
    temp = settings.get("temperature", 0.8)
    if temp <= 0:  # greedy: the best token is certain
        return [(ranked[0][0], 1.0)]
    lps = [lp for _, lp in ranked]
    top = lps[0]
    probs = [math.exp(lp - top) for lp in lps]
    total = sum(probs)
    probs = [p / total for p in probs]
    keep = len(probs)
    top_p = settings.get("top_p", 1.0)
    if top_p < 1.0:
        acc = 0.0
        for i, p in enumerate(probs):
            acc += p
            if acc >= top_p:
                keep = i + 1
                break
    min_p = settings.get("min_p", 0.0)
    if min_p > 0.0:
        keep = max(1, min(keep, sum(1 for p in probs[:keep] if p >= min_p * probs[0])))
    weights = [math.exp((lp - top) / temp) for lp in lps[:keep]]
    total = sum(weights)
    return [(ranked[i][0], w / total) for i, w in enumerate(weights) if w > 0.0]


def _select(res: dict, fields) -> dict:
    """``response_fields``: the named fields only; ``a/b`` takes ``b`` out of ``a`` as ``a/b``."""
    out = {}
    for path in fields:
        node = res
        for part in str(path).split("/"):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            out[path] = node
    return out


class Responder:
    """How one /completion request's results become llama-server's answers."""

    dialect = LLAMA

    def __init__(self, plan: Plan, options: Options, model: ModelAccess):
        self.plan, self.options, self.model = plan, options, model
        self.text = ""  # a stream's text so far

    def _stop(self, text: str, finish_reason: Optional[str], token_ids: List[int]) -> tuple:
        """llama-server's stop_type and stopping_word from the finish reason and the tokens
        sampled: a stop word is what they say beyond the answer's text."""
        if finish_reason != "stop":
            return "limit", ""
        full = self.model.llm.detokenize(token_ids, special=False).decode("utf-8", "replace")
        at = full.find(text) if text else 0
        rest = full[at + len(text):] if at >= 0 else full
        word = next((s for s in self.options.stop if s and s in rest), "")
        return ("word", word) if word else ("eos", "")

    def final(self, text: str, token_ids: List[int], timings: Optional[dict], finish_reason, slot: int = 0,
              truncated: bool = False) -> dict:
        """The last answer: ``text`` the whole answer's, ``token_ids`` every token sampled, ``slot``
        the engine slot it ran on, ``truncated`` whether its context filled."""
        t = timings or {}
        stop_type, word = self._stop(text, finish_reason, token_ids)
        res = {"index": self.options.index, "content": "" if self.plan.stream else text,
               "tokens": list(token_ids) if self.options.return_tokens and not self.plan.stream else [],
               "id_slot": slot, "stop": True, "model": self.model.alias, "tokens_predicted": len(token_ids),
               "tokens_evaluated": self.options.n_prompt, "generation_settings": self.options.settings,
               "prompt": self.options.prompt_text, "has_new_line": "\n" in text, "truncated": truncated,
               "stop_type": stop_type, "stopping_word": word,
               "tokens_cached": t.get("cache_n", 0) + t.get("prompt_n", 0) + len(token_ids), "timings": t}
        if self.options.response_fields:
            res = _select(res, self.options.response_fields)
        return res

    def response(self, out: dict, job) -> dict:
        choice = out["choices"][0]
        res = self.final(choice.get("text", ""), job.token_ids, out.get("timings"), choice.get("finish_reason"),
                         _slot(job), _truncated(job))
        if self.options.n_probs and not self.options.response_fields:
            res["completion_probabilities"] = self.probabilities(choice.get("logprobs"))
        return res

    def _piece(self, token: int) -> dict:
        raw = self.model.llm.detokenize([token], special=True)
        return {"id": token, "token": raw.decode("utf-8", "replace"), "bytes": list(raw)}

    def probabilities(self, lp: Optional[dict]) -> List[dict]:
        """llama-server's ``completion_probabilities`` from a logprobs object (see
        :mod:`llama_metaws.api.completion`: its ``token_ids`` and ``top_ids``)."""
        if not lp or "token_ids" not in lp:
            return []
        n, out = self.options.n_probs, []
        for token, logprob, ranked in zip(lp["token_ids"], lp["token_logprobs"], lp["top_ids"]):
            entry = self._piece(token)
            if self.options.post_sampling_probs:
                post = _post_sampling(ranked, self.options.settings)
                entry["prob"] = next((p for t, p in post if t == token), 0.0)
                entry["top_probs"] = [dict(self._piece(t), prob=p) for t, p in post[:n]]
            else:
                entry["logprob"] = logprob
                entry["top_logprobs"] = [dict(self._piece(t), logprob=v) for t, v in ranked[:n]]
            out.append(entry)
        return out

    def zero(self) -> dict:
        """n_predict 0: the prompt, tokenized; nothing generated."""
        return self.final("", [], {"cache_n": 0, "prompt_n": 0}, "length")

    def first(self, job) -> List[dict]:
        return []

    def progress(self, report, job) -> List[dict]:
        """A stream's ``prompt_progress`` event (``return_progress``)."""
        event = {"index": self.options.index, "content": "", "tokens": [], "stop": False, "id_slot": _slot(job),
                 "tokens_predicted": 0, "tokens_evaluated": self.options.n_prompt,
                 "prompt_progress": progress_json(report)}
        if self.options.timings_per_token:
            event["timings"] = progress_timings(report)
        return [event]

    def events(self, piece: dict, job) -> List[dict]:
        chunk = piece["chunk"]
        choice = chunk["choices"][0]
        text = choice.get("text") or ""
        self.text += text
        out = []
        if text or piece["tokens"]:
            event = {"index": self.options.index, "content": text, "tokens": piece["tokens"], "stop": False,
                     "id_slot": _slot(job),
                     "tokens_predicted": piece["n_decoded"], "tokens_evaluated": self.options.n_prompt}
            if self.options.timings_per_token:
                event["timings"] = timings_now(piece, self.options.n_prompt)
            if self.options.n_probs:
                event["completion_probabilities"] = self.probabilities(choice.get("logprobs"))
            out.append(event)
        if choice.get("finish_reason") is not None:
            out.append(self.final(self.text, job.token_ids, chunk.get("timings"), choice["finish_reason"], _slot(job),
                                  _truncated(job)))
        return out

    def end(self) -> List[str]:
        return []


def props(model: ModelAccess, *, total_slots: int, slots_endpoint: bool, metrics: bool, model_path: str,
          build_info: str) -> dict:
    """GET /props: this server as it is (one slot, its defaults, its template)."""
    llm = model.llm
    params = dict(_DEFAULTS, n_predict=model.n_predict if model.n_predict is not None else -1, seed=model.seed,
                  stop=[], stream=False, n_probs=0, min_keep=0, ignore_eos=False, grammar="")
    params["mirostat"] = params.pop("mirostat_mode")
    if model.temperature is not None:
        params["temperature"] = model.temperature

    def text(token: int) -> str:
        return llm.detokenize([token], special=True).decode("utf-8", "replace") if token >= 0 else ""

    return {"default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": model.n_ctx,
                                            "speculative": model.drafting, "is_processing": False,
                                            "params": params},
            "total_slots": total_slots, "model_alias": model.alias, "model_path": model_path,
            "modalities": {"vision": False, "audio": False, "video": False},
            "endpoint_slots": slots_endpoint, "endpoint_props": False, "endpoint_metrics": metrics,
            "chat_template": model.chat.source if model.chat is not None else "",
            "chat_template_caps": model.chat.caps if model.chat is not None else {}, "bos_token": text(llm.token_bos()), "eos_token": text(llm.token_eos()),
            "build_info": build_info, "is_sleeping": False,
            # ours: the phase-aware workspace of the target and its MTP draft context (mode None: none)
            "phase_aware_workspace": {"enabled": llm.workspace_mode is not None, "mode": llm.workspace_mode}}


def tokenize(body: dict, model: ModelAccess) -> dict:
    """POST /tokenize: ``content`` (a string, or ids and strings mixed), ``add_special``
    (default false), ``parse_special`` (default true), ``with_pieces``."""
    if "content" not in body:
        return {"tokens": []}
    ids = prompt_tokens(model, body["content"], "content", bool(body.get("add_special", False)),
                        bool(body.get("parse_special", True)), {})
    if not body.get("with_pieces"):
        return {"tokens": ids}
    out = []
    for t in ids:
        piece = model.llm.detokenize([t], special=True)
        try:
            out.append({"id": t, "piece": piece.decode("utf-8")})
        except UnicodeDecodeError:
            out.append({"id": t, "piece": list(piece)})
    return {"tokens": out}


def detokenize(body: dict, model: ModelAccess) -> dict:
    """POST /detokenize: ``tokens`` as text."""
    ids = model.check_tokens(body.get("tokens", []), "tokens")
    return {"content": model.llm.detokenize(ids, special=True).decode("utf-8", "replace")}


def apply_template(body: dict, model: ModelAccess) -> dict:
    """POST /apply-template: the prompt a chat request with this body runs (llama.cpp's chat
    layer, as for ``/v1/chat/completions``)."""
    from .chat import request_of

    validated(MessagesBody, body)
    return {"prompt": request_of(body, model).params.prompt}
