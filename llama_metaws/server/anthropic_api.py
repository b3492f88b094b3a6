"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the chat
route, as llama-server maps it.

A request becomes a chat completion request (:func:`to_chat`) and runs as one; the answer becomes
a ``message`` (:class:`Responder`), and a stream Anthropic's events.

Request: ``messages`` (``user`` / ``assistant``, an empty list too, as llama-server takes it; a
last ``assistant`` message is continued, as llama-server's chat continues it, the answer's text
beginning with it; content a string or blocks: ``text``,
``tool_use`` (an assistant's tool call, its ``input`` the arguments), ``tool_result`` (a user's
answer to one: a ``tool`` message), ``thinking`` (an assistant's reasoning, sent back to the
template as ``reasoning_content``); ``redacted_thinking`` is dropped; ``image`` and ``document``
are refused: no model here takes them), ``system`` (a string or text blocks), ``max_tokens``
(4096 when absent, as llama-server defaults it), ``stop_sequences``, ``temperature``, ``top_p``,
``top_k``, ``stream``, ``tools`` (``name``, ``description``, ``input_schema``), ``tool_choice``
(``auto``, ``any``: a call is forced, ``tool``: that one, ``none``; ``disable_parallel_tool_use``),
``thinking`` (``{"type": "enabled", "budget_tokens": N}``: the template's ``enable_thinking`` and
the reasoning budget, as llama-server maps it; ``"disabled"``: no thinking), ``metadata``,
``output_config`` (``format``: a JSON schema the answer's text follows, through the chat layer's
grammar; ``effort``: the chat's ``reasoning_effort``), Anthropic's ``cache_control``,
``inference_geo``, ``speed`` and ``diagnostics`` (accepted without effect), and llama-server's own
``chat_template_kwargs``, ``logit_bias`` and ``cache_prompt``. The fields are checked by
:class:`AnthropicBody` (a field it does not declare is a 400 naming it), the chat request they
become by the chat route's :class:`~.validation.ChatBody`.
Errors are in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``.

Answer: ``content`` holds a ``thinking`` block (the chat's ``reasoning_content``, an empty
``signature``: nothing here signs), a ``text`` block and a ``tool_use`` block per tool call (its
``input`` the parsed arguments), in that order; ``stop_reason`` is ``end_turn``,
``stop_sequence`` (with ``stop_sequence``: the one that matched), ``tool_use`` or ``max_tokens``;
``usage`` has ``input_tokens`` (those evaluated), ``cache_read_input_tokens`` (reused from the
slot) and ``output_tokens``. A stream: ``message_start``, per block ``content_block_start``,
its ``content_block_delta`` events (``thinking_delta`` then ``signature_delta``, ``text_delta``,
``input_json_delta``) and ``content_block_stop``, one block after the other, then
``message_delta`` (``stop_reason``, the whole ``usage``: ``message_start`` knew only the
prompt's length) and ``message_stop``.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Dict, List, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator, model_validator

from .errors import ANTHROPIC, RequestError
from .validation import refusal, validated

DEFAULT_MAX_TOKENS = 4096  # llama-server's, for a request without max_tokens
#: llama-server's own fields, passed to the chat request as they are (not Anthropic's)
LLAMA_SERVER_FIELDS = ("logit_bias", "cache_prompt")


class Tool(BaseModel):
    """A tool: a custom one (``type`` absent or ``custom``) becomes a chat function; Anthropic's
    server tools (web search, bash, ...) are accepted, and nothing here serves them."""

    model_config = ConfigDict(extra="allow")

    name: StrictStr
    type: Optional[str] = None
    description: Any = None
    input_schema: Optional[Dict[str, Any]] = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["auto", "any", "tool", "none"]
    name: Optional[StrictStr] = None
    disable_parallel_tool_use: Optional[bool] = None

    @model_validator(mode="after")
    def _named(self):
        if self.type == "tool" and self.name is None:
            raise refusal("invalid 'tool_choice': a tool choice of type tool needs the tool's 'name'", "tool_choice")
        return self


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: Dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: Optional[OutputFormat] = None
    effort: Optional[StrictStr] = None


class AnthropicBody(BaseModel):
    """``POST /v1/messages`` (the module docstring says what each field does)."""

    model_config = ConfigDict(extra="forbid")

    model: Any = None
    messages: List[Any]
    system: Any = None  # a string or text blocks (_text_blocks)
    max_tokens: StrictInt = DEFAULT_MAX_TOKENS
    stop_sequences: Optional[List[StrictStr]] = None
    temperature: Any = None  # these four as the chat route checks them
    top_p: Any = None
    top_k: Any = None
    stream: Any = None
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Any = None
    output_config: Optional[OutputConfig] = None
    # accepted without effect
    metadata: Any = None
    service_tier: Any = None
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    cache_control: Any = None
    inference_geo: Any = None
    speed: Any = None
    diagnostics: Any = None
    # llama-server's own
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    logit_bias: Any = None
    cache_prompt: Any = None

    @field_validator("messages", mode="before")
    @classmethod
    def _a_list(cls, value):
        if not isinstance(value, list):  # llama-server reads it as no messages
            raise refusal("invalid 'messages': a list is expected")
        return value

    @field_validator("max_tokens")
    @classmethod
    def _at_least_one(cls, value):
        if value < 1:
            raise refusal(f"invalid 'max_tokens': {value}; an integer >= 1 is expected")
        return value


def _bad(message: str, param: Optional[str] = None) -> RequestError:
    return RequestError(400, message, param=param, code="invalid_value")


def _text_blocks(value, param: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(f"{param}: a string or a list of text blocks is expected", param)
    texts = []
    for block in value:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in ("image", "document"):
                raise RequestError(400, f"{param}: {kind} blocks are not supported (no model here takes them)",
                                   param=param, code="unsupported_content")
            raise _bad(f"{param}: text blocks ({{'type': 'text', 'text': ...}}) are expected", param)
        texts.append(block["text"])
    return "\n".join(texts)


def _message(msg: dict, i: int) -> List[dict]:
    """One Anthropic message as chat messages (a user's tool results are ``tool`` messages)."""
    param = f"messages[{i}]"
    if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
        raise _bad(f"{param}: a message with role user or assistant is expected", param)
    role, content = msg["role"], msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{param}: content must be a string or a list of blocks", param)
    texts: List[str] = []
    calls: List[dict] = []
    results: List[dict] = []
    reasoning = ""
    for j, block in enumerate(content):
        where = f"{param}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise _bad(f"{where}: a text block needs a 'text' string", param)
            texts.append(block["text"])
        elif kind == "thinking":
            reasoning += str(block.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            if role != "assistant" or not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise _bad(f"{where}: a tool_use block (an assistant's) needs an 'id' and a 'name'", param)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise _bad(f"{where}: a tool_result block needs a 'tool_use_id'", param)
            value = block.get("content", "")
            text = _text_blocks(value, where) if value is not None else ""
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind in ("image", "document"):
            raise RequestError(400, f"{where}: {kind} blocks are not supported (no model here takes them)",
                               param=param, code="unsupported_content")
        else:
            raise _bad(f"{where}: unknown block type {kind!r}", param)
    out = list(results)  # a user's tool results answer the calls before; its text comes after them
    if texts or calls or reasoning or not results:
        m: Dict = {"role": role, "content": "\n".join(texts)}
        if calls:
            m["tool_calls"] = calls
        if reasoning:
            m["reasoning_content"] = reasoning
        out.append(m)
    return out


def to_chat(body: dict) -> dict:
    """The chat completion request that serves an Anthropic request (a 400 for what cannot)."""
    req = validated(AnthropicBody, body)
    chat: Dict = {"messages": []}
    if req.system is not None:
        chat["messages"].append({"role": "system", "content": _text_blocks(req.system, "system")})
    for i, msg in enumerate(req.messages):
        chat["messages"] += _message(msg, i)
    chat["max_tokens"] = req.max_tokens
    for key in ("model", "temperature", "top_p", "top_k", "stream") + LLAMA_SERVER_FIELDS:
        if getattr(req, key) is not None:
            chat[key] = getattr(req, key)
    if req.stop_sequences is not None:
        chat["stop"] = req.stop_sequences
    if req.tools:
        chat["tools"] = []
        for tool in req.tools:
            if tool.type not in (None, "custom"):
                continue  # Anthropic's server tools (web search, bash, ...): nothing here serves them
            fn = {"name": tool.name, "parameters": tool.input_schema or {"type": "object", "properties": {}}}
            if tool.description is not None:
                fn["description"] = tool.description
            chat["tools"].append({"type": "function", "function": fn})
        choice = req.tool_choice
        if choice is not None:
            if choice.type == "any":
                chat["tool_choice"] = "required"
            elif choice.type == "tool":
                chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            else:
                chat["tool_choice"] = choice.type
            if choice.disable_parallel_tool_use:
                chat["parallel_tool_calls"] = False
    kwargs = dict(req.chat_template_kwargs or {})  # llama-server's, passed through
    thinking = req.thinking
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        kwargs.setdefault("enable_thinking", thinking["type"] == "enabled")
        if thinking["type"] == "enabled" and isinstance(thinking.get("budget_tokens"), int):
            chat["thinking_budget_tokens"] = thinking["budget_tokens"]  # as llama-server maps it
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    chat.update(_output_config(req.output_config))
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


def _output_config(config: Optional[OutputConfig]) -> dict:
    """Anthropic's ``output_config`` as chat fields: ``format`` (``{"type": "json_schema", "schema":
    ...}``, structured output) the chat layer's JSON schema grammar, ``effort`` OpenAI's
    ``reasoning_effort`` (the template's ``reasoning_effort``, as llama-server passes it on)."""
    out: Dict = {}
    if config is not None and config.format is not None:
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "output", "schema": config.format.schema_}}
    if config is not None and config.effort is not None:
        out["reasoning_effort"] = config.effort
    return out


def _usage(timings: Optional[dict], n_prompt: int = 0) -> dict:
    t = timings or {}
    return {"input_tokens": t.get("prompt_n", n_prompt), "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": t.get("cache_n", 0), "output_tokens": t.get("predicted_n", 0)}


class Responder:
    """A chat request's results (``inner``: :class:`~.openai_api.Responder`) as Anthropic's answers."""

    dialect = ANTHROPIC

    def __init__(self, inner, body: dict, model):
        self.inner = inner
        self.stops = body.get("stop_sequences") or []
        self.access = model  # the request layer's door to the model: its detokenizer
        self.model = model.alias
        self.job = None
        self.id = "msg_" + secrets.token_hex(12)
        self.blocks: List[dict] = []          # a stream's blocks so far
        self.calls: Dict[int, int] = {}       # the chat's tool call index -> block index
        self.open: Optional[int] = None       # the block being streamed
        self.text = ""                        # a stream's text so far
        self.finish: Optional[str] = None
        self.timings: Optional[dict] = None

    def _stop_reason(self, finish: Optional[str], text: str, calls: bool, job):
        """``stop_reason`` and ``stop_sequence``: a stop sequence is one found in what the model
        sampled beyond the answer's text (the chat answer ends before it)."""
        if finish == "tool_calls" or (calls and finish == "stop"):
            return "tool_use", None
        if finish == "length":
            return "max_tokens", None
        if self.stops and job is not None:
            full = self.access.llm.detokenize(job.token_ids, special=False).decode("utf-8", "replace")
            at = full.find(text) if text else 0
            rest = full[at + len(text):] if at >= 0 else full
            word = next((s for s in self.stops if s and s in rest), None)
            if word is not None:
                return "stop_sequence", word
        return "end_turn", None

    def response(self, out: dict, job) -> dict:
        chat = self.inner.response(out, job)
        choice = chat["choices"][0]
        msg = choice.get("message") or {}
        content = []
        if msg.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
        if msg.get("content"):
            content.append({"type": "text", "text": msg["content"]})
        for call in msg.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": call.get("id") or "toolu_" + secrets.token_hex(12),
                            "name": call["function"]["name"], "input": _arguments(call["function"].get("arguments"))})
        reason, sequence = self._stop_reason(choice.get("finish_reason"), msg.get("content") or "",
                                             bool(msg.get("tool_calls")), job)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence,
                "usage": _usage(chat.get("timings"), job.n_prompt or 0)}

    # streamed ------------------------------------------------------------------------------

    @staticmethod
    def _event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps(dict(type=kind, **fields))}\n\n"

    def first(self, job) -> List[str]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": _usage(None, job.n_prompt or 0)}
        return [self._event("message_start", message=message)]

    def progress(self, report, job) -> List[str]:
        return []  # llama-server sends none on this API

    def _close(self) -> List[str]:
        if self.open is None:
            return []
        i, self.open = self.open, None
        events = []
        if self.blocks[i]["type"] == "thinking":
            events.append(self._event("content_block_delta", index=i, delta={"type": "signature_delta", "signature": ""}))
        return events + [self._event("content_block_stop", index=i)]

    def _start(self, block: dict) -> List[str]:
        events = self._close()
        self.blocks.append(block)
        self.open = len(self.blocks) - 1
        return events + [self._event("content_block_start", index=self.open, content_block=block)]

    def events(self, piece: dict, job) -> List[str]:
        out: List[str] = []
        self.job = job
        for chunk in self.inner.events(piece, job):
            if chunk.get("timings") is not None:
                self.timings = chunk["timings"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    if self.open is None or self.blocks[self.open]["type"] != "thinking":
                        out += self._start({"type": "thinking", "thinking": ""})
                    out.append(self._event("content_block_delta", index=self.open,
                                           delta={"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
                if delta.get("content"):
                    if self.open is None or self.blocks[self.open]["type"] != "text":
                        out += self._start({"type": "text", "text": ""})
                    self.text += delta["content"]
                    out.append(self._event("content_block_delta", index=self.open,
                                           delta={"type": "text_delta", "text": delta["content"]}))
                for call in delta.get("tool_calls") or []:
                    index, fn = call.get("index", 0), call.get("function") or {}
                    if index not in self.calls:
                        out += self._start({"type": "tool_use", "id": call.get("id") or "toolu_" + secrets.token_hex(12),
                                            "name": fn.get("name") or "", "input": {}})
                        self.calls[index] = self.open
                    if fn.get("arguments"):
                        out.append(self._event("content_block_delta", index=self.calls[index],
                                               delta={"type": "input_json_delta", "partial_json": fn["arguments"]}))
                if choice.get("finish_reason") is not None:
                    self.finish = choice["finish_reason"]
        return out

    def end(self) -> List[str]:
        events = self._close()
        reason, sequence = self._stop_reason(self.finish, self.text, bool(self.calls), self.job)
        usage = _usage(self.timings, self.job.n_prompt or 0 if self.job is not None else 0)
        events.append(self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                                  usage=usage))
        events.append(self._event("message_stop"))
        return events

    def error_event(self, error: RequestError) -> str:
        return self._event("error", error=error.body(ANTHROPIC)["error"])


def _arguments(text: Optional[str]) -> dict:
    """A tool call's arguments as the object Anthropic's ``input`` is (an object, as llama-server
    falls back to, where the model wrote no valid JSON)."""
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def count_tokens(body: dict, model, chat_check) -> dict:
    """``/v1/messages/count_tokens``: the prompt's tokens as the chat template renders it."""
    chat = to_chat(dict(body, max_tokens=body.get("max_tokens", 1)))
    chat.pop("stream", None)
    chat.pop("stream_options", None)
    plan = chat_check(chat, model)
    return {"input_tokens": plan.n_prompt}
