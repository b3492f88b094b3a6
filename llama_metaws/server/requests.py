"""What a completion or chat request may ask for, checked before it reaches the model.

The request bodies are llama-cpp-python's server types (``CreateCompletionRequest``,
``CreateChatCompletionRequest``); on top of their validation a request is refused, with a 4xx
in OpenAI's error shape, when it names a parameter those types do not know, a model this server
does not serve, ``max_tokens`` below 1, ``n``/``best_of`` other than 1 (one choice per request
here), an empty prompt or no messages, or several prompts at once. :class:`Plan` holds what is
left: the keyword arguments of ``Llama.create_completion`` / ``create_chat_completion``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Dict, Iterable, Optional

from .errors import RequestError

# parameters of the request types that are not keyword arguments of the Llama calls
_NOT_KWARGS = {"model", "n", "best_of", "user", "logit_bias", "logit_bias_type", "min_tokens", "grammar",
               "max_completion_tokens"}


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object", code="invalid_json")
    return body


@dataclasses.dataclass
class Plan:
    """A checked request: which call, its keyword arguments, and what needs the model first."""

    kind: str                      # "completion" | "chat"
    kwargs: dict
    stream: bool
    prompt_param: str              # where a too-long prompt is reported: "prompt" | "messages"
    logit_bias: Optional[Dict[str, float]] = None
    logit_bias_tokens: bool = False
    min_tokens: int = 0

    def call_kwargs(self, llm) -> dict:
        """The keyword arguments, completed with what needs the loaded model."""
        from ..native.binding import llama_cpp

        kw = dict(self.kwargs)
        if self.logit_bias:
            if self.logit_bias_tokens:
                bias: Dict[str, float] = {}
                for text, score in self.logit_bias.items():
                    for token in llm.tokenize(text.encode("utf-8"), add_bos=False, special=True):
                        bias[str(token)] = score
                kw["logit_bias"] = bias
            else:
                kw["logit_bias"] = self.logit_bias
        if self.min_tokens > 0:
            kw["logits_processor"] = llama_cpp.LogitsProcessorList(
                [llama_cpp.MinTokensLogitsProcessor(self.min_tokens, llm.token_eos())])
        return kw

    def run(self, llm):
        """``create_completion`` or ``create_chat_completion`` with these arguments."""
        call: Callable = llm.create_completion if self.kind == "completion" else llm.create_chat_completion
        return call(**self.call_kwargs(llm))


def _request_types():
    from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest

    return CreateCompletionRequest, CreateChatCompletionRequest


def _check_known(body: dict, known: Iterable[str]) -> None:
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise RequestError(400, f"unsupported parameter: {unknown[0]!r} (this server does not implement "
                           "it)" + (f"; also unsupported: {', '.join(map(repr, unknown[1:]))}" if unknown[1:] else ""),
                           param=unknown[0], code="unsupported_parameter")


def _check_model(body: dict, names: Iterable[str]) -> None:
    model = body.get("model")
    if model is None:
        return
    names = list(names)
    if model not in names:
        # the requested name is not echoed back: it is the client's text
        raise RequestError(404, f"the requested model does not exist here; this server serves "
                           f"{names[0]!r} (GET /v1/models)", param="model", code="model_not_found")


def _check_max_tokens(body: dict, key: str) -> None:
    value = body.get(key)
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        return  # absent, null, or a type the request type reports
    if value < 1:
        raise RequestError(400, f"invalid {key!r}: {value}; it must be at least 1", param=key,
                           code="invalid_value")


def _check_one_choice(body: dict, key: str) -> None:
    value = body.get(key, 1)
    if value is not None and value != 1:
        raise RequestError(400, f"{key}={value!r} is not supported: this server returns one choice per "
                           f"request; send {key}=1 (or leave it out) and repeat the request for more",
                           param=key, code="unsupported_value")


def _validate(model_type, body: dict):
    from pydantic import ValidationError

    try:
        return model_type.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()))
        raise RequestError(400, f"invalid {loc!r}: {first.get('msg', 'invalid value')}" if loc else
                           str(first.get("msg")), param=loc.split(".")[0] or None,
                           code="invalid_value") from None


def _grammar(text: Optional[str]):
    if text is None:
        return None
    from ..native.binding import llama_cpp

    try:
        return llama_cpp.LlamaGrammar.from_string(text, verbose=False)
    except Exception as e:  # noqa: BLE001 - the binding raises ValueError or RuntimeError
        raise RequestError(400, f"invalid 'grammar': {e}", param="grammar", code="invalid_value") from None


def _plan(kind: str, req, body: dict, kwargs: dict, prompt_param: str, alias: str) -> Plan:
    kwargs["model"] = alias  # the response names the model as /v1/models does
    grammar = _grammar(req.grammar)
    if grammar is not None:
        kwargs["grammar"] = grammar
    return Plan(kind=kind, kwargs=kwargs, stream=bool(req.stream), prompt_param=prompt_param,
                logit_bias=req.logit_bias, logit_bias_tokens=req.logit_bias_type == "tokens",
                min_tokens=req.min_tokens)


def completion(body: dict, names: Iterable[str], alias: str) -> Plan:
    """``POST /v1/completions``."""
    completion_type, _ = _request_types()
    _check_known(body, completion_type.model_fields)
    _check_model(body, names)
    _check_max_tokens(body, "max_tokens")
    _check_one_choice(body, "n")
    _check_one_choice(body, "best_of")
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) > 1:
            raise RequestError(400, f"{len(prompt)} prompts in one request: send one prompt per request",
                               param="prompt", code="unsupported_value")
        prompt = prompt[0] if prompt else ""
        body = dict(body, prompt=prompt)
    if prompt is None or prompt == "":
        raise RequestError(400, "the prompt is empty: send a non-empty 'prompt'", param="prompt",
                           code="invalid_value")
    req = _validate(completion_type, body)
    kwargs = req.model_dump(exclude=_NOT_KWARGS)
    kwargs["echo"] = bool(kwargs.get("echo"))
    return _plan("completion", req, body, kwargs, "prompt", alias)


def chat(body: dict, names: Iterable[str], alias: str) -> Plan:
    """``POST /v1/chat/completions``; ``max_completion_tokens`` is OpenAI's newer ``max_tokens``."""
    _, chat_type = _request_types()
    _check_known(body, set(chat_type.model_fields) | {"max_completion_tokens"})
    _check_model(body, names)
    _check_max_tokens(body, "max_tokens")
    _check_max_tokens(body, "max_completion_tokens")
    if body.get("max_completion_tokens") is not None:
        if body.get("max_tokens") is not None and body["max_tokens"] != body["max_completion_tokens"]:
            raise RequestError(400, "max_tokens and max_completion_tokens differ: send one of them",
                               param="max_completion_tokens", code="invalid_value")
        body = dict(body, max_tokens=body["max_completion_tokens"])
    _check_one_choice(body, "n")
    if not body.get("messages"):
        raise RequestError(400, "no messages: send a non-empty 'messages' list", param="messages",
                           code="invalid_value")
    req = _validate(chat_type, body)
    kwargs = req.model_dump(exclude=_NOT_KWARGS)
    return _plan("chat", req, body, kwargs, "messages", alias)
