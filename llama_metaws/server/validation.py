"""What a request may ask for, checked before it reaches the model; what it runs as (:class:`Plan`).

Every request body is checked by a pydantic model (:class:`CompletionBody`,
:class:`ChatBody`, :class:`LlamaCompletionBody`, :class:`MessagesBody`), and :func:`validated`
is the one place where a refusal becomes an answer: the first error, naming its field, as a 400
:class:`~.errors.RequestError`, which the route answers in its API's shape (OpenAI's, llama-server's
or Anthropic's, :mod:`.errors`). A field no model declares is a 400 naming it on OpenAI's routes
(``unsupported_parameter``) and ignored on llama-server's ``/completion``, as llama-server ignores it.

OpenAI's routes (:func:`completion`, :func:`chat`) take llama-cpp-python's server types
(``CreateCompletionRequest``, ``CreateChatCompletionRequest``), extended with the OpenAI fields the
binding lacks and llama-server's own (:class:`OpenAIExtras`, :class:`LlamaServerFields`).
llama-server's ``/completion`` is :mod:`.llama_api`'s, on the same :class:`Plan`.

The request layer talks to the model through :class:`ModelAccess` only: ``Llama``'s public calls
that are safe from any thread while the model's thread generates (tokenize, detokenize,
check_grammar, the vocabulary's size, the context's), and the chat template. Everything here runs
off the model's thread (the app calls it in a worker thread): a prompt is tokenized here, and a
grammar parsed here, so a bad one is a 400 before it is queued and a huge prompt costs the model
nothing. The tokens travel with the plan (:attr:`Plan.tokens`), keyed as the binding asks for
them, and the model's ``tokenize`` answers from them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from pydantic import (BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError,
                      ValidationInfo, field_validator, model_validator)
from pydantic_core import PydanticCustomError

from ..native.binding import llama_cpp  # first: the build check, which the binding's types need
from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest  # noqa: E402

from . import chat as _chat
from .errors import RequestError

# parameters of the request types that are not keyword arguments of the Llama calls
_NOT_KWARGS = {"model", "n", "best_of", "user", "logit_bias", "logit_bias_type", "min_tokens", "grammar",
               "max_completion_tokens"}

#: the most choices (``n``) one request may ask for
MAX_CHOICES = 16

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
        """The keyword arguments, completed with what needs the loaded model and llama-server's
        ``id_slot`` and ``cache_prompt``. A logit bias goes into our own processor list: the
        binding's ``LogitsProcessorList.extend`` returns None, so its own bias dropped
        ``min_tokens`` and itself when both were given."""
        from ..native.binding import llama_cpp

        kw = dict(self.kwargs, id_slot=self.id_slot, cache_prompt=self.cache_prompt)
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
        for i in range(self.n_choices):
            for chunk in call(**self.call_kwargs(llm)):
                if i and chunk.get("choices"):
                    chunk = dict(chunk, choices=[dict(c, index=i) for c in chunk["choices"]])
                yield chunk



# --- the request bodies' models, and the one place their refusals become answers -------------


def refusal(message: str, param: Optional[str] = None, code: str = "invalid_value") -> PydanticCustomError:
    """A validator's refusal: ``message`` is the whole message (it names its field), ``param`` the
    field when the validator is the model's (a field's validator names its own), ``code`` the
    error's code on OpenAI's routes."""
    return PydanticCustomError(code, message, {"param": param} if param else None)


_OUR_CODES = {"invalid_value", "unsupported_value", "unsupported_parameter", "unsupported_content"}


def request_error(error: ValidationError) -> RequestError:
    """A pydantic refusal as the 400 the routes answer: the fields no model declares first (named
    in one message), else the first error, its field named (``invalid 'temperature': Input should
    be a valid number, ...``)."""
    errors = error.errors(include_url=False)
    unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
    if unknown:
        also = f"; also unsupported: {', '.join(map(repr, unknown[1:]))}" if unknown[1:] else ""
        return RequestError(400, f"unsupported parameter: {unknown[0]!r} (this server does not implement it){also}",
                            param=unknown[0], code="unsupported_parameter")
    first = errors[0]
    loc = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in first["loc"]).lstrip(".")  # tools[0].name
    param = (first.get("ctx") or {}).get("param") or (str(first["loc"][0]) if first["loc"] else None)
    if first["type"] in _OUR_CODES:
        return RequestError(400, first["msg"], param=param, code=first["type"])
    if first["type"] == "missing":
        return RequestError(400, f"{loc!r} is required", param=param, code="invalid_value")
    # a nested model's refusal names the object as JSON does, not our class
    msg = "Input should be an object" if first["type"] in ("model_type", "model_attributes_type") else first["msg"]
    return RequestError(400, f"invalid {loc!r}: {msg}" if loc else msg, param=param, code="invalid_value")


def validated(model_type, body: dict, model: Optional["ModelAccess"] = None):
    """``body`` as a ``model_type``, checked against the server (its slots, its vocabulary); a
    400 naming the field otherwise (:func:`request_error`)."""
    context = {"n_slots": model.n_slots, "n_vocab": model.n_vocab} if model is not None else {}
    try:
        return model_type.model_validate(body, context=context)
    except ValidationError as e:
        raise request_error(e) from None


def _slot_in_range(value: Optional[int], info: ValidationInfo) -> Optional[int]:
    """llama-server's ``id_slot``: a slot of this server, or -1 (any)."""
    n = (info.context or {}).get("n_slots")
    if value is not None and n is not None and not -1 <= value < n:
        raise refusal(f"invalid 'id_slot': {value!r}: this server has slots 0 to {n - 1} (or -1: any)")
    return value


def _token_ids(ids: List[int], param: str, info: ValidationInfo) -> List[int]:
    """Token ids inside the vocabulary (llama.cpp would throw on one outside it)."""
    n = (info.context or {}).get("n_vocab")
    bad = next((t for t in ids if n is not None and not 0 <= t < n), None)
    if bad is not None:
        raise refusal(f"invalid {param!r}: token {bad} is outside the vocabulary [0, {n})")
    return ids


def _n_predict_range(value: Optional[int], info: ValidationInfo) -> Optional[int]:
    """llama-server's token budget: -1 (up to the context) or more."""
    if value is not None and value < -1:
        raise refusal(f"invalid {info.field_name!r}: {value!r}; an integer, -1 (up to the context) or more")
    return value


class LlamaServerFields(BaseModel):
    """llama-server's own fields its OpenAI routes take too."""

    #: true: reuse the prefix of the prompt a slot holds; false: evaluate the whole prompt; absent
    #: or null: the server's default (``--cache-prompt``, true, or ``--no-cache-prompt``)
    cache_prompt: Optional[StrictBool] = None
    #: each streamed chunk carries the ``timings`` so far
    timings_per_token: StrictBool = False
    #: a stream's first chunk carries ``prompt_progress``, once the prompt is done
    return_progress: StrictBool = False
    #: the answer carries ``__verbose``: the prompt's tokens as text, BOS and special tokens
    #: included, and the answer's text (also for every request of a server started with -v)
    verbose: StrictBool = False
    #: the engine slot to run on; -1: any
    id_slot: Optional[StrictInt] = -1
    #: llama-server's name of ``max_tokens`` (-1: up to the context), where that is absent
    n_predict: Optional[StrictInt] = None

    _slot = field_validator("id_slot")(_slot_in_range)
    _n_predict = field_validator("n_predict")(_n_predict_range)


class OpenAIExtras(LlamaServerFields):
    """OpenAI's fields the binding's types lack: ``stream_options.include_usage`` is honoured (a
    last chunk with the usage); ``store``, ``metadata`` and ``service_tier`` are accepted and
    ignored. With llama-server's own fields, and every field not declared refused."""

    model_config = ConfigDict(extra="forbid")

    stream_options: Optional[Dict[str, Any]] = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None

    @field_validator("stream_options")
    @classmethod
    def _include_usage(cls, value):
        if value is not None and not isinstance(value.get("include_usage", False), bool):
            raise refusal("invalid 'stream_options': an object such as {\"include_usage\": true} is expected")
        return value

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _at_least_one(cls, value, info: ValidationInfo):
        if value is not None and value < 1:
            raise refusal(f"invalid {info.field_name!r}: {value}; it must be at least 1")
        return value

    @field_validator("n", check_fields=False)
    @classmethod
    def _choices(cls, value):
        """OpenAI's ``n``: how many choices to generate (1 when absent or null)."""
        if value is None:
            return 1
        if not 1 <= value <= MAX_CHOICES:
            raise refusal(f"invalid 'n': {value!r}; it must be an integer from 1 to {MAX_CHOICES}")
        return value

    @model_validator(mode="after")
    def _stream_options_with_stream(self):
        if self.stream_options is not None and not self.stream:
            raise refusal("'stream_options' is only allowed with 'stream': true", "stream_options")
        return self

    @model_validator(mode="after")
    def _n_predict_as_max_tokens(self):
        """llama-server's ``n_predict`` where ``max_tokens`` is absent; -1 or 0: no limit but the
        context's."""
        if self.n_predict is not None and (self.max_tokens is None or "max_tokens" not in self.model_fields_set):
            self.max_tokens = self.n_predict if self.n_predict > 0 else None
        return self

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool((self.stream_options or {}).get("include_usage"))

    def kwargs(self, exclude=()) -> dict:
        """The fields that are keyword arguments of the ``Llama`` call."""
        ours = set(type(self).model_fields) - set(self._binding_type().model_fields)
        return self.model_dump(exclude=_NOT_KWARGS | ours | set(exclude))

    @classmethod
    def _binding_type(cls):
        return next(b for b in cls.__mro__ if b in (CreateCompletionRequest, CreateChatCompletionRequest))


class CompletionBody(OpenAIExtras, CreateCompletionRequest):
    """``POST /v1/completions``: one prompt, a string or OpenAI's token array (a list of one
    string is that string)."""

    n: Optional[StrictInt] = 1
    prompt: Union[StrictStr, List[StrictInt]] = ""

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and not (value and all(isinstance(t, int) and not isinstance(t, bool)
                                                          for t in value)):
            if len(value) > 1:
                raise refusal(f"{len(value)} prompts in one request: send one prompt per request",
                              code="unsupported_value")
            return value[0] if value else ""
        return value

    @field_validator("prompt")
    @classmethod
    def _in_vocabulary(cls, value, info: ValidationInfo):
        return _token_ids(value, "prompt", info) if isinstance(value, list) else value

    @field_validator("best_of")
    @classmethod
    def _one_choice(cls, value):
        if value is not None and value != 1:
            raise refusal(f"best_of={value!r} is not supported: this server returns one choice per request; "
                          "send best_of=1 (or leave it out) and repeat the request for more",
                          code="unsupported_value")
        return value

    @model_validator(mode="after")
    def _not_empty(self):
        if self.prompt == "":
            raise refusal("the prompt is empty: send a non-empty 'prompt'", "prompt")
        return self


class ChatBody(OpenAIExtras, CreateChatCompletionRequest):
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is OpenAI's newer ``max_tokens``.
    The messages are checked as llama-server checks them (the binding's message types refuse
    OpenAI's developer role and an assistant's null content beside its tool calls), then read by
    the chat layer (:mod:`.chat`) with ``response_format`` (OpenAI's json_schema form, which the
    binding's type lacks, included) and llama-server's chat fields below, which it checks."""

    n: Optional[StrictInt] = 1
    messages: List[Any]
    response_format: Any = None
    max_completion_tokens: Optional[int] = None
    #: given to llama.cpp's chat layer, as llama-server does
    parallel_tool_calls: Any = None
    reasoning_effort: Any = None
    #: llama-server's: none, auto, deepseek, deepseek-legacy
    reasoning_format: Any = None
    #: llama-server's: the template's variables (``enable_thinking``, ...)
    chat_template_kwargs: Any = None
    json_schema: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    #: llama-server's reasoning budget
    reasoning_budget_tokens: Any = None
    thinking_budget_tokens: Any = None
    reasoning_budget_message: Any = None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages(cls, value):
        try:
            return _chat.checked_messages(value)
        except RequestError as e:  # in llama-server's words (chat.checked_messages)
            raise refusal(e.message, "messages", e.code or "invalid_value") from None

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise refusal("max_tokens and max_completion_tokens differ: send one of them",
                              "max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        return self


class MessagesBody(BaseModel):
    """The messages of a chat request whose other fields do not matter (a token count, a
    rendered template), as :class:`ChatBody` takes them."""

    messages: List[Any]

    @field_validator("messages", mode="before")
    @classmethod
    def _a_list(cls, value):
        if not isinstance(value, list):
            raise refusal("Expected 'messages' to be an array")
        return value


#: llama-server's ``/completion`` fields whose every other value is refused (a 400 naming it):
#: what they turn on is not here
OFF_ONLY = {"dynatemp_range": 0.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "n_indent": 0,
            "t_max_predict_ms": 0, "lora": [], "n_cmpl": 1, "n": 1}


class LlamaCompletionBody(BaseModel):
    """llama-server's ``POST /completion`` (:mod:`.llama_api`), but its ``prompt``, whose many
    forms are read as llama-server reads them (``llama_api.prompts_of``). A field not declared
    here is ignored, as llama-server ignores fields it does not know."""

    model_config = ConfigDict(extra="ignore")

    temperature: Optional[StrictFloat] = None
    top_k: Optional[StrictFloat] = None
    top_p: Optional[StrictFloat] = None
    min_p: Optional[StrictFloat] = None
    typical_p: Optional[StrictFloat] = None
    repeat_penalty: Optional[StrictFloat] = None
    presence_penalty: Optional[StrictFloat] = None
    frequency_penalty: Optional[StrictFloat] = None
    mirostat: Optional[StrictFloat] = None
    mirostat_tau: Optional[StrictFloat] = None
    mirostat_eta: Optional[StrictFloat] = None
    #: the tokens to generate (or ``max_tokens``); -1: up to the context; 0: the prompt is
    #: tokenized, nothing is generated
    n_predict: Optional[StrictInt] = None
    max_tokens: Optional[StrictInt] = None
    stop: Union[StrictStr, List[StrictStr], None] = None
    seed: Optional[StrictInt] = None
    stream: StrictBool = False
    id_slot: Optional[StrictInt] = -1
    cache_prompt: Optional[StrictBool] = None
    grammar: Optional[StrictStr] = None
    json_schema: Optional[Dict[str, Any]] = None
    min_tokens: StrictInt = 0
    n_probs: StrictInt = 0
    logit_bias: Any = None  # its array and object forms, read with the vocabulary (llama_api)
    ignore_eos: Optional[bool] = False
    post_sampling_probs: Optional[bool] = False
    return_tokens: Optional[bool] = False
    return_progress: Optional[bool] = False
    timings_per_token: Optional[bool] = False
    response_fields: Optional[List[StrictStr]] = None

    _slot = field_validator("id_slot")(_slot_in_range)
    _n_predict = field_validator("n_predict", "max_tokens")(_n_predict_range)

    @model_validator(mode="before")
    @classmethod
    def _off_only(cls, body):
        for key, off in OFF_ONLY.items():
            if isinstance(body, dict) and key in body and body[key] not in (off, None):
                raise refusal(f"{key!r} is not implemented by this server; leave it out or at {off!r}", key,
                              "unsupported_parameter")
        return body

    @field_validator("min_tokens", "n_probs")
    @classmethod
    def _not_negative(cls, value, info: ValidationInfo):
        if value < 0:
            raise refusal(f"invalid {info.field_name!r}: {value}; an integer >= 0 is expected")
        return value

    @model_validator(mode="after")
    def _one_constraint(self):
        if self.grammar is not None and self.json_schema is not None:
            raise refusal("both 'grammar' and 'json_schema' given: send one", "grammar")
        return self


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
    without a seed samples with the server's; its ``n_predict`` says how many tokens), and
    llama-server's repeat penalty, 1.0 (none), where the binding's request types would put their 1.1."""
    if body.get("repeat_penalty") is None:
        body = dict(body, repeat_penalty=1.0)
    if model.temperature is not None and body.get("temperature") is None:
        body = dict(body, temperature=model.temperature)
    if model.seed != -1 and body.get("seed") is None:
        body = dict(body, seed=model.seed)
    # llama-server's slot limit: the request's n_predict unless it is -1 (absent counts as -1), else -n
    if model.n_predict is not None and all(body.get(k) is None for k in (max_key, "max_completion_tokens")) \
            and body.get("n_predict") in (None, -1):
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
    """``POST /v1/completions`` (:class:`CompletionBody`). Any model name is served (there is one model)."""
    req = validated(CompletionBody, _defaults(model, body, "max_tokens"), model)
    kwargs = req.kwargs()
    kwargs["echo"] = bool(kwargs.get("echo"))
    plan = _plan("completion", req, kwargs, "prompt", model)
    if isinstance(req.prompt, list):  # OpenAI's token-array prompt
        plan.n_prompt = len(req.prompt)
    else:  # as the binding will ask for it: no BOS (it adds its own), special tokens parsed without a suffix
        n = len(model.tokenize(req.prompt, add_bos=False, special=req.suffix is None, tokens=plan.tokens))
        plan.n_prompt = n + model.n_specials
        plan.prompt_text = req.prompt
    model.check_context(plan.n_prompt, "prompt")
    return plan


def chat(body: dict, model: ModelAccess) -> Plan:
    """``POST /v1/chat/completions`` (:class:`ChatBody`). The chat fields go to llama.cpp's chat
    layer (:mod:`.chat`), applied here: its prompt is tokenized here, and the request carries what
    the model's thread runs."""
    req = validated(ChatBody, _defaults(model, body, "max_tokens"), model)
    chat_req = _chat.request_of(body, model)
    kwargs = req.kwargs(exclude=set(_chat.CHAT_FIELDS) | {"messages", "functions", "function_call"})
    plan = _plan("chat", req, kwargs, "messages", model)
    kwargs.pop("grammar", None)  # the request carries it (a grammar beside tools is refused there)
    kwargs["request"] = chat_req
    if chat_req.params.grammar:
        plan.grammar_param = "tools" if body.get("tools") else "response_format"
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


def chat_input_tokens(body: dict, model: ModelAccess) -> dict:
    """``POST /v1/chat/completions/input_tokens`` (llama-server's token count): the tokens the
    prompt of a chat request with these ``messages`` (and ``tools``) has, as it would run;
    nothing is generated and no other field is needed."""
    validated(MessagesBody, body)
    fields = {k: body[k] for k in ("messages", "tools", "tool_choice") if k in body}
    prompt = _chat.request_of(fields, model).params.prompt
    return {"input_tokens": len(model.tokenize(prompt, add_bos=False, special=True, tokens={})) + model.n_specials}


def _plan(kind: str, req: OpenAIExtras, kwargs: dict, prompt_param: str, model: ModelAccess) -> Plan:
    kwargs["model"] = model.alias  # the response names the model as /v1/models does
    grammar_param = None
    if req.grammar is not None:
        model.check_grammar(req.grammar, "grammar")
        kwargs["grammar"] = llama_cpp.LlamaGrammar.from_string(req.grammar, verbose=False)
        grammar_param = "grammar"
    return Plan(kind=kind, kwargs=kwargs, stream=bool(req.stream), prompt_param=prompt_param,
                grammar_param=grammar_param, logit_bias=_logit_bias(model, req, kind), min_tokens=req.min_tokens,
                info=_info(kwargs, bool(req.stream)), include_usage=req.include_usage, n_choices=req.n,
                id_slot=req.id_slot if req.id_slot is not None and req.id_slot >= 0 else None,
                cache_prompt=model.cache_prompt if req.cache_prompt is None else req.cache_prompt,
                timings_per_token=req.timings_per_token, return_progress=req.return_progress,
                verbose=req.verbose or model.verbose)
