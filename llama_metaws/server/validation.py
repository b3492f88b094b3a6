"""What a request may ask for, checked before it reaches the model; what it runs as (:class:`Plan`).

The request layer talks to the model through :class:`ModelAccess` only: ``Llama``'s public calls
that are safe from any thread while the model's thread generates (tokenize, detokenize,
check_grammar, the vocabulary's size, the context's), and the chat template. Everything here runs
off the model's thread (the app calls it in a worker thread): a prompt is tokenized here, and a
grammar parsed here, so a bad one is a 400 before it is queued and a huge prompt costs the model
nothing. The tokens travel with the plan (:attr:`Plan.tokens`), keyed as the binding asks for
them, and the model's ``tokenize`` answers from them.

OpenAI's routes (:func:`completion`, :func:`chat`) take llama-cpp-python's server types
(``CreateCompletionRequest``, ``CreateChatCompletionRequest``) plus the OpenAI fields listed in
:data:`OPENAI_ACCEPTED`; a parameter neither knows is a 400 naming it. llama-server's own
``/completion`` is :mod:`.llama_api`'s, on the same :class:`Plan`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Dict, List, Optional, Tuple

from . import chat as _chat
from .errors import RequestError

# parameters of the request types that are not keyword arguments of the Llama calls
_NOT_KWARGS = {"model", "n", "best_of", "user", "logit_bias", "logit_bias_type", "min_tokens", "grammar",
               "max_completion_tokens"}

#: OpenAI fields the binding's types do not have, accepted here: ``stream_options.include_usage``
#: is honoured (a last chunk with the usage), and on a chat ``parallel_tool_calls`` and
#: ``reasoning_effort`` (given to llama.cpp's chat layer, as llama-server does); ``store``,
#: ``metadata`` and ``service_tier`` are accepted and ignored.
OPENAI_ACCEPTED = {"stream_options", "parallel_tool_calls", "store", "metadata", "reasoning_effort",
                   "service_tier"}

#: llama-server's own chat fields, for its chat layer: ``reasoning_format`` (none, auto,
#: deepseek, deepseek-legacy), ``chat_template_kwargs`` (``enable_thinking``, ...),
#: ``json_schema``, ``add_generation_prompt``, ``continue_final_message``, the reasoning budget's
LLAMA_SERVER_CHAT = {"reasoning_format", "chat_template_kwargs", "json_schema", "add_generation_prompt",
                     "continue_final_message",
                     "reasoning_budget_tokens", "thinking_budget_tokens", "reasoning_budget_message"}

#: llama-server's own fields its OpenAI routes take too: ``cache_prompt`` (true, the default:
#: reuse the prefix of the prompt a slot holds; false: evaluate the whole prompt),
#: ``timings_per_token`` (each streamed chunk carries the ``timings`` so far),
#: ``return_progress`` (a stream's first chunk carries ``prompt_progress``, once the prompt is done)
#: ``id_slot`` (the engine slot to run on; -1: any) and ``verbose`` (the answer carries
#: ``__verbose``: the prompt's tokens as text, BOS and special tokens included, and the answer's
#: text; also for every request of a server started with -v); ``n_predict`` is llama-server's
#: name of ``max_tokens`` (-1: up to the context)
LLAMA_SERVER_ACCEPTED = {"cache_prompt", "timings_per_token", "return_progress", "id_slot", "verbose", "n_predict"}

TokenKey = Tuple[bytes, bool, bool]  # what the binding passes to Llama.tokenize: text, add_bos, special


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is out of a double's range")
    return value


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 (as RFC 8259 has it: no NaN or Infinity, no number out
    of a double's range; no lone UTF-16 surrogate in a string)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise RequestError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", code="invalid_json")
    _check_unicode(body)
    return body


def _check_unicode(body) -> None:
    """JSON's ``\\ud800`` escapes may leave a lone UTF-16 surrogate in a string, which no UTF-8
    text (a prompt, a stop string, a grammar) can hold: a 400 here, not a failure later."""
    todo = [body]
    while todo:
        value = todo.pop()
        if isinstance(value, dict):
            todo.extend(value.keys())
            todo.extend(value.values())
        elif isinstance(value, list):
            todo.extend(value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(400, f"the request body is not valid Unicode: a string holds a lone surrogate "
                                   f"({value[e.start]!r})", code="invalid_json") from None


class ModelAccess:
    """The request layer's door to the model (see the module docstring), and the server's defaults
    (``--temp``, ``-n``, ``-s``, ``--spm-infill``, ``--no-cache-prompt``) and names (``-a``: ``aliases``, the first in
    sorted order the ``alias`` answers carry; ``--tags``)."""

    def __init__(self, llm, chat_templates=None, *, alias: str = "model",
                 temperature: Optional[float] = None, n_predict: Optional[int] = None,
                 aliases: Optional[List[str]] = None, tags: Optional[List[str]] = None, seed: int = -1,
                 verbose: bool = False, spm_infill: bool = False, cache_prompt: bool = True):
        self.llm = llm
        self.cache_prompt = cache_prompt  # --cache-prompt / --no-cache-prompt: requests' default
        self.spm_infill = spm_infill  # --spm-infill: /infill's suffix before its prefix
        self.chat = chat_templates  # a chat_layer.ChatTemplates: the model's, or the flags'
        self.aliases = sorted(set(aliases)) if aliases else [alias]
        self.alias = self.aliases[0]
        self.tags = sorted(set(tags or []))
        self.seed = seed
        self.verbose = verbose  # -v: every answer carries llama-server's __verbose
        self.temperature = temperature
        self.n_predict = n_predict
        # the context one sequence (one slot) has: all of it with -kvu (or one slot), else its share
        self.n_ctx = int(llm.n_ctx_slot())
        self.n_batch = int(llm.n_batch)
        self.n_slots = len(llm.slots())
        self.n_vocab = int(llm.n_vocab())
        # the tokens a string prompt gets around it (BOS, EOS) when the binding completes it
        self.n_specials = len(llm.tokenize(b"a", add_bos=True)) - len(llm.tokenize(b"a", add_bos=False))
        self.drafting = bool(llm.drafting)

    def tokenize(self, text: str, add_bos: bool, special: bool, tokens: Dict[TokenKey, List[int]]) -> List[int]:
        key = (text.encode("utf-8"), add_bos, special)
        if key not in tokens:
            tokens[key] = list(self.llm.tokenize(key[0], add_bos=add_bos, special=special))
        return tokens[key]

    def check_tokens(self, ids, param: str) -> List[int]:
        """Token ids, each inside the vocabulary (llama.cpp would throw on one outside it)."""
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError(400, f"invalid {param!r}: a list of token ids (integers) is expected", param=param,
                               code="invalid_value")
        bad = next((t for t in ids if not 0 <= t < self.n_vocab), None)
        if bad is not None:
            raise RequestError(400, f"invalid {param!r}: token {bad} is outside the vocabulary [0, {self.n_vocab})",
                               param=param, code="invalid_value")
        return ids

    def check_context(self, n_prompt: int, param: str) -> None:
        """The binding's own check, before the request waits for the model."""
        if n_prompt >= self.n_ctx:
            raise RequestError(400, f"the request exceeds the available context size: Requested tokens ({n_prompt}) "
                               f"exceed context window of {self.n_ctx}; use a shorter prompt or start the server "
                               "with a larger -c", param=param, code="context_length_exceeded",
                               extra={"n_prompt_tokens": n_prompt, "n_ctx": self.n_ctx})

    def check_grammar(self, text: str, param: str) -> None:
        try:
            self.llm.check_grammar(text)
        except ValueError as e:
            raise RequestError(400, f"invalid {param!r}: {e}", param=param, code="invalid_grammar") from None

    def schema_grammar(self, schema, param: str) -> str:
        """A JSON schema's grammar as the binding makes it, checked; a 400 when it cannot be."""
        from ..native.binding import llama_cpp

        try:
            text = llama_cpp.llama_grammar.json_schema_to_gbnf(json.dumps(schema))
        except Exception as e:  # noqa: BLE001 - the converter raises what it meets (KeyError, ValueError, ...)
            raise RequestError(400, f"invalid {param!r}: the JSON schema cannot be turned into a grammar: "
                               f"{type(e).__name__}: {e}", param=param, code="invalid_value") from None
        self.check_grammar(text, param)
        return text


def logit_bias_processor(bias: Dict[int, float]):
    """A logits processor adding ``bias`` to the scores, as the binding's own does."""
    import numpy as np

    ids = np.array(list(bias), dtype=np.intc)
    values = np.array(list(bias.values()), dtype=np.single)

    def apply(input_ids, scores):
        scores = np.copy(scores)
        scores[ids] += values
        return scores

    return apply


@dataclasses.dataclass
class Plan:
    """A checked request: which call, its keyword arguments, and what it brings along."""

    kind: str                      # "completion" | "chat"
    kwargs: dict
    stream: bool
    prompt_param: str              # where a too-long prompt is reported: "prompt" | "messages"
    grammar_param: Optional[str] = None  # what constrains the output: "grammar", "response_format", ...
    logit_bias: Optional[Dict[int, float]] = None
    min_tokens: int = 0
    include_usage: bool = False
    tokens: Dict[TokenKey, List[int]] = dataclasses.field(default_factory=dict)  # tokenized already
    n_prompt: Optional[int] = None  # the prompt's tokens, when known before the run
    info: dict = dataclasses.field(default_factory=dict)  # what GET /slots shows as the request's params
    id_slot: Optional[int] = None  # llama-server's id_slot: the engine slot to run on (None: any)
    cache_prompt: bool = True      # llama-server's cache_prompt: reuse what the slot holds of the prompt
    n_choices: int = 1             # OpenAI's n: the choices to generate, one after the other
    timings_per_token: bool = False  # llama-server's: every streamed chunk carries the timings so far
    return_progress: bool = False    # llama-server's: a stream's first chunk carries prompt_progress
    verbose: bool = False            # llama-server's: the answer carries __verbose (the prompt as it ran)
    prompt_text: Optional[str] = None  # the prompt as it runs, its tokens as text (a chat's rendered)

    def call_kwargs(self, llm) -> dict:
        """The keyword arguments, completed with what needs the loaded model. A logit bias goes
        into our own processor list: the binding's ``LogitsProcessorList.extend`` returns None,
        so its own bias dropped ``min_tokens`` and itself when both were given."""
        from ..native.binding import llama_cpp

        kw = dict(self.kwargs)
        processors = []
        if self.min_tokens > 0:
            processors.append(llama_cpp.MinTokensLogitsProcessor(self.min_tokens, llm.token_eos()))
        if self.logit_bias:
            processors.append(logit_bias_processor(self.logit_bias))
        if processors:
            kw["logits_processor"] = llama_cpp.LogitsProcessorList(processors)
        return kw

    def run(self, llm):
        """``create_completion`` or ``create_chat_completion`` with these arguments (on the slot
        asked for, if any), ``n_choices`` times: one answer whose choices are indexed 0 to n - 1
        and whose usage counts them all, or one stream of their chunks, each choice's after the
        other's."""
        call: Callable = llm.create_completion if self.kind == "completion" else llm.create_chat_completion
        if self.stream:
            return self._stream(llm, call)
        outs = []
        for _ in range(self.n_choices):
            with llm.on_slot(self.id_slot, cache_prompt=self.cache_prompt):
                outs.append(call(**self.call_kwargs(llm)))
        if len(outs) == 1:
            return outs[0]
        out = dict(outs[0], choices=[dict(c, index=i) for i, o in enumerate(outs) for c in o["choices"]])
        if all(o.get("usage") for o in outs):
            completion = sum(o["usage"]["completion_tokens"] for o in outs)
            prompt = outs[0]["usage"]["prompt_tokens"]
            out["usage"] = dict(outs[0]["usage"], completion_tokens=completion, total_tokens=prompt + completion)
        return out

    def _stream(self, llm, call):
        # the slot is chosen when the generator first runs: on_slot is entered there
        for i in range(self.n_choices):
            with llm.on_slot(self.id_slot, cache_prompt=self.cache_prompt):
                for chunk in call(**self.call_kwargs(llm)):
                    if i and chunk.get("choices"):
                        chunk = dict(chunk, choices=[dict(c, index=i) for c in chunk["choices"]])
                    yield chunk


def _request_types():
    from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest

    return CreateCompletionRequest, CreateChatCompletionRequest


_PLAN_FLAGS = ("timings_per_token", "return_progress", "id_slot", "verbose")


def _n_predict(body: dict) -> dict:
    """llama-server's ``n_predict`` as ``max_tokens`` (when that is absent); -1 or 0: no limit
    but the context's."""
    if "n_predict" not in body or body.get("max_tokens") is not None:
        return body
    value = body["n_predict"]
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise RequestError(400, f"invalid 'n_predict': {value!r}; an integer, -1 (up to the context) or more",
                           param="n_predict", code="invalid_value")
    return dict(body, max_tokens=value if value > 0 else None)


def llama_server_fields(body: dict, plan: "Plan", model: "ModelAccess") -> None:
    """llama-server's ``timings_per_token``, ``return_progress`` (booleans) and ``id_slot`` (a
    slot, or -1) onto the plan; a 400 for any other value."""
    for key in ("timings_per_token", "return_progress", "verbose"):
        value = body.get(key, False)
        if not isinstance(value, bool):
            raise RequestError(400, f"invalid {key!r}: true or false is expected, got {value!r}", param=key,
                               code="invalid_value")
        setattr(plan, key, value)
    slot = body.get("id_slot", -1)
    if slot is not None and (isinstance(slot, bool) or not isinstance(slot, int) or not -1 <= slot < model.n_slots):
        raise RequestError(400, f"invalid 'id_slot': {slot!r}: this server has slots 0 to {model.n_slots - 1} "
                           "(or -1: any)", param="id_slot", code="invalid_value")
    plan.id_slot = slot if slot is not None and slot >= 0 else None
    plan.verbose = plan.verbose or model.verbose


def cache_prompt(body: dict, model: "ModelAccess") -> bool:
    """llama-server's ``cache_prompt`` (when absent: the server's, ``--cache-prompt`` / ``--no-cache-prompt``,
    true by default); anything but a boolean is a 400."""
    value = body.get("cache_prompt", model.cache_prompt)
    if not isinstance(value, bool):
        raise RequestError(400, f"invalid 'cache_prompt': true or false is expected, got {value!r}",
                           param="cache_prompt", code="invalid_value")
    return value


def check_known(body: dict, known) -> None:
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise RequestError(400, f"unsupported parameter: {unknown[0]!r} (this server does not implement "
                           "it)" + (f"; also unsupported: {', '.join(map(repr, unknown[1:]))}" if unknown[1:] else ""),
                           param=unknown[0], code="unsupported_parameter")


def check_max_tokens(body: dict, key: str) -> None:
    value = body.get(key)
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        return  # absent, null, or a type the request type reports
    if value < 1:
        raise RequestError(400, f"invalid {key!r}: {value}; it must be at least 1", param=key,
                           code="invalid_value")


def choices_wanted(body: dict, key: str = "n") -> int:
    """OpenAI's ``n``: how many choices to generate (1 when absent)."""
    value = body.get(key, 1)
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHOICES:
        raise RequestError(400, f"invalid {key!r}: {value!r}; it must be an integer from 1 to {MAX_CHOICES}",
                           param=key, code="invalid_value")
    return value


#: the most choices (``n``) one request may ask for
MAX_CHOICES = 16


def check_one_choice(body: dict, key: str) -> None:
    value = body.get(key, 1)
    if value is not None and value != 1:
        raise RequestError(400, f"{key}={value!r} is not supported: this server returns one choice per "
                           f"request; send {key}=1 (or leave it out) and repeat the request for more",
                           param=key, code="unsupported_value")


def validate(model_type, body: dict):
    from pydantic import ValidationError

    try:
        return model_type.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise RequestError(400, f"invalid {loc!r}: {first.get('msg', 'invalid value')}" if loc else
                           str(first.get("msg")), param=loc.split(".")[0] or None,
                           code="invalid_value") from None


def _stream_options(body: dict) -> bool:
    """Whether a stream ends with a usage chunk; ``stream_options`` only goes with ``stream``."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise RequestError(400, "invalid 'stream_options': an object such as {\"include_usage\": true} is expected",
                           param="stream_options", code="invalid_value")
    if not body.get("stream"):
        raise RequestError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options",
                           code="invalid_value")
    return bool(opts.get("include_usage"))


def _logit_bias(model: ModelAccess, req, kind: str) -> Optional[Dict[int, float]]:
    """The request's logit bias by token id: keys are ids, or with ``logit_bias_type: tokens``
    texts whose every token gets the bias."""
    if not req.logit_bias:
        return None
    bias: Dict[int, float] = {}
    for key, score in req.logit_bias.items():
        if req.logit_bias_type == "tokens":
            for token in model.tokenize(key, add_bos=False, special=True, tokens={}):
                bias[token] = float(score)
        else:
            try:
                token = int(key)
            except ValueError:
                raise RequestError(400, f"invalid 'logit_bias': key {key!r} is not a token id (send "
                                   "logit_bias_type: tokens for texts)", param="logit_bias",
                                   code="invalid_value") from None
            model.check_tokens([token], "logit_bias")
            bias[token] = float(score)
    return bias


def _defaults(model: ModelAccess, body: dict, max_key: str) -> dict:
    """The server's --temp, -n and -s where the request does not say (llama-server's: a request
    without a seed samples with the server's), and llama-server's repeat penalty, 1.0 (none), where
    the binding's request types would put their 1.1."""
    if body.get("repeat_penalty") is None:
        body = dict(body, repeat_penalty=1.0)
    if model.temperature is not None and body.get("temperature") is None:
        body = dict(body, temperature=model.temperature)
    if model.seed != -1 and body.get("seed") is None:
        body = dict(body, seed=model.seed)
    if model.n_predict is not None and body.get(max_key) is None and body.get("max_completion_tokens") is None:
        body = dict(body, **{max_key: model.n_predict if model.n_predict > 0 else None})
    return body


def _info(kwargs: dict, stream: bool) -> dict:
    """llama-server's generation settings of a request, as far as they exist here (GET /slots)."""
    return {"n_predict": kwargs.get("max_tokens") or -1, "max_tokens": kwargs.get("max_tokens") or -1,
            "temperature": kwargs.get("temperature"), "top_k": kwargs.get("top_k"), "top_p": kwargs.get("top_p"),
            "min_p": kwargs.get("min_p"), "typical_p": kwargs.get("typical_p", 1.0),
            "repeat_penalty": kwargs.get("repeat_penalty"), "presence_penalty": kwargs.get("presence_penalty"),
            "frequency_penalty": kwargs.get("frequency_penalty"), "mirostat": kwargs.get("mirostat_mode", 0),
            "mirostat_tau": kwargs.get("mirostat_tau"), "mirostat_eta": kwargs.get("mirostat_eta"),
            "seed": kwargs.get("seed") if kwargs.get("seed") is not None else -1,
            "stop": kwargs.get("stop") or [], "stream": stream}


def completion(body: dict, model: ModelAccess) -> Plan:
    """``POST /v1/completions``. Any model name is served (there is one model)."""
    completion_type, _ = _request_types()
    check_known(body, set(completion_type.model_fields) | OPENAI_ACCEPTED | LLAMA_SERVER_ACCEPTED)
    include_usage = _stream_options(body)
    reuse = cache_prompt(body, model)
    flags = {k: body[k] for k in _PLAN_FLAGS if k in body}
    body = _n_predict(body)
    body = {k: v for k, v in body.items() if k not in OPENAI_ACCEPTED | LLAMA_SERVER_ACCEPTED}
    check_max_tokens(body, "max_tokens")
    n_choices = choices_wanted(body)
    check_one_choice(body, "best_of")
    body = _defaults(model, body, "max_tokens")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        token_prompt = model.check_tokens(prompt, "prompt")  # OpenAI's token-array prompt
        body = dict(body, prompt="tokens")
    else:
        token_prompt = None
        if isinstance(prompt, list):
            if len(prompt) > 1:
                raise RequestError(400, f"{len(prompt)} prompts in one request: send one prompt per request",
                                   param="prompt", code="unsupported_value")
            prompt = prompt[0] if prompt else ""
            body = dict(body, prompt=prompt)
        if prompt is None or prompt == "":
            raise RequestError(400, "the prompt is empty: send a non-empty 'prompt'", param="prompt",
                               code="invalid_value")
    req = validate(completion_type, body)
    kwargs = req.model_dump(exclude=_NOT_KWARGS)
    kwargs["echo"] = bool(kwargs.get("echo"))
    plan = _plan("completion", req, kwargs, "prompt", model)
    plan.n_choices = n_choices
    llama_server_fields(flags, plan, model)
    plan.cache_prompt = reuse
    plan.include_usage = include_usage
    if token_prompt is not None:
        kwargs["prompt"] = token_prompt
        plan.n_prompt = len(token_prompt)
    else:  # as the binding will ask for it: no BOS (it adds its own), special tokens parsed without a suffix
        n = len(model.tokenize(req.prompt, add_bos=False, special=req.suffix is None, tokens=plan.tokens))
        plan.n_prompt = n + model.n_specials
        plan.prompt_text = req.prompt
    model.check_context(plan.n_prompt, "prompt")
    return plan


def chat(body: dict, model: ModelAccess) -> Plan:
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is OpenAI's newer ``max_tokens``.
    The chat fields go to llama.cpp's chat layer (:mod:`.chat`), applied here: its prompt is
    tokenized here, and the request carries what the model's thread runs."""
    _, chat_type = _request_types()
    check_known(body, set(chat_type.model_fields) | {"max_completion_tokens"} | OPENAI_ACCEPTED
                | LLAMA_SERVER_ACCEPTED | LLAMA_SERVER_CHAT)
    include_usage = _stream_options(body)
    reuse = cache_prompt(body, model)
    flags = {k: body[k] for k in _PLAN_FLAGS if k in body}
    body = _n_predict(body)
    chat_body = body
    body = {k: v for k, v in body.items() if k not in OPENAI_ACCEPTED | LLAMA_SERVER_ACCEPTED | LLAMA_SERVER_CHAT}
    check_max_tokens(body, "max_tokens")
    check_max_tokens(body, "max_completion_tokens")
    if body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None and body["max_tokens"] != body["max_completion_tokens"]:
            raise RequestError(400, "max_tokens and max_completion_tokens differ: send one of them",
                               param="max_completion_tokens", code="invalid_value")
        body = dict(body, max_tokens=body["max_completion_tokens"])
    n_choices = choices_wanted(body)
    check_messages(body)
    body = _defaults(model, body, "max_tokens")
    # the binding's types check the other fields' types; the messages are checked as llama-server
    # checks them (the binding's message types refuse OpenAI's developer role and an assistant's
    # null content beside its tool calls), then read by the chat layer; response_format is the
    # chat layer's to read (OpenAI's json_schema form, which the binding's type lacks, included)
    _chat.checked_messages(body["messages"])
    req = validate(chat_type, dict(body, response_format=None, messages=[]))
    chat_req = _chat.request_of(chat_body, model)
    kwargs = req.model_dump(exclude=_NOT_KWARGS | set(_chat.CHAT_FIELDS) | {"messages", "functions", "function_call"})
    plan = _plan("chat", req, kwargs, "messages", model)
    kwargs.pop("grammar", None)  # the request carries it (a grammar beside tools is refused there)
    kwargs["request"] = chat_req
    plan.n_choices = n_choices
    llama_server_fields(flags, plan, model)
    plan.include_usage = include_usage
    plan.cache_prompt = reuse
    if chat_req.params.grammar:
        plan.grammar_param = "tools" if chat_body.get("tools") else "response_format"
    ids = model.tokenize(chat_req.params.prompt, add_bos=False, special=True, tokens=plan.tokens)
    plan.n_prompt = len(ids) + model.n_specials
    if plan.verbose:  # llama-server's __verbose shows the prompt's tokens as they run, BOS included
        shown = model.tokenize(chat_req.params.prompt, add_bos=True, special=True, tokens={})
        plan.prompt_text = model.llm.detokenize(shown, special=True).decode("utf-8", "replace")
    if plan.n_prompt == 0:
        raise RequestError(400, "the chat template renders these messages as an empty prompt: send a message",
                           param="messages", code="invalid_value")
    model.check_context(plan.n_prompt, "messages")
    return plan


def check_messages(body: dict) -> None:
    """A chat's ``messages``: a list, as llama-server takes it (an empty one too: the template
    renders what it renders, its generation prompt at least)."""
    if "messages" not in body:
        raise RequestError(400, "'messages' is required", param="messages", code="invalid_value")
    if not isinstance(body["messages"], list):
        raise RequestError(400, "Expected 'messages' to be an array", param="messages", code="invalid_value")


def chat_input_tokens(body: dict, model: ModelAccess) -> dict:
    """``POST /v1/chat/completions/input_tokens`` (llama-server's token count): the tokens the
    prompt of a chat request with these ``messages`` (and ``tools``) has, as it would run;
    nothing is generated and no other field is needed."""
    check_messages(body)
    fields = {k: body[k] for k in ("messages", "tools", "tool_choice") if k in body}
    prompt = _chat.request_of(fields, model).params.prompt
    return {"input_tokens": len(model.tokenize(prompt, add_bos=False, special=True, tokens={})) + model.n_specials}


def _plan(kind: str, req, kwargs: dict, prompt_param: str, model: ModelAccess) -> Plan:
    kwargs["model"] = model.alias  # the response names the model as /v1/models does
    grammar_param = None
    if req.grammar is not None:
        model.check_grammar(req.grammar, "grammar")
        from ..native.binding import llama_cpp

        kwargs["grammar"] = llama_cpp.LlamaGrammar.from_string(req.grammar, verbose=False)
        grammar_param = "grammar"
    return Plan(kind=kind, kwargs=kwargs, stream=bool(req.stream), prompt_param=prompt_param,
                grammar_param=grammar_param, logit_bias=_logit_bias(model, req, kind), min_tokens=req.min_tokens,
                info=_info(kwargs, bool(req.stream)))
