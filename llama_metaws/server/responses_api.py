"""OpenAI's Responses API (``POST /v1/responses``) over the chat route, as llama-server serves it.

A request becomes a chat completion request (:func:`to_chat`), runs as one (the chat layer
renders, constrains and parses it), and its answer becomes a ``response`` object
(:class:`Responder`); a stream becomes the Responses API's typed events.

Request: ``input`` (a string: one user message; or a list of items: messages of the roles
``user`` / ``system`` / ``developer`` / ``assistant`` with text content, ``function_call`` and
``function_call_output`` items, ``reasoning`` items whose text goes back to the template as the
next assistant message's ``reasoning_content``), ``instructions`` (a system message first),
``tools`` (``function`` tools; other kinds are skipped, as llama-server skips them),
``tool_choice`` (``auto`` / ``none`` / ``required`` / ``{"type": "function", "name"}``),
``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``,
``text.format`` (``json_schema`` / ``json_object``: the chat's ``response_format``),
``reasoning.effort``. Accepted without effect: :data:`IGNORED`. ``previous_response_id`` is
refused (nothing is stored here, as llama-server stores nothing). Any other field goes to the
chat request as it is, as llama-server passes it (its own fields, ``chat_template_kwargs`` or
``logit_bias``; one the chat route does not know is a 400 naming it). The fields are checked by
:class:`ResponsesBody`, the chat request they become by the chat route's :class:`~.validation.ChatBody`.

Answer: ``output`` holds a ``reasoning`` item (the chat's ``reasoning_content``), a ``message``
item (its ``content``, one ``output_text`` part) and a ``function_call`` item per tool call
(``call_id`` the chat's tool call id, ``arguments`` its JSON text), in that order; ``status`` is
``completed``, or ``incomplete`` with ``incomplete_details.reason = "max_output_tokens"`` when the
token budget ended it (as OpenAI reports it; llama-server says ``completed``); ``usage`` counts
``input_tokens`` (``input_tokens_details.cached_tokens``: reused from the slot) and
``output_tokens``. A stream: ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, its parts and deltas (``response.reasoning_text.delta``,
``response.content_part.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``) and their ``.done`` events, then
``response.completed`` with the whole response (its ``status`` as above; OpenAI's clients take
the final response from that event only, and llama-server sends it always); every event has
its ``sequence_number``, ``output_index`` and ``item_id`` as OpenAI's clients read them.
llama-server's telemetry, as it sends it: with ``return_progress`` each report of the prompt's
progress is a ``response.in_progress`` event carrying ``prompt_progress`` (the first right after
``response.created``), with ``timings_per_token`` the last event of each piece carries the
``timings`` so far; ``response.completed`` carries the request's ``timings``.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator, model_validator

from .errors import OPENAI, RequestError
from .validation import refusal, validated

#: Responses fields that change nothing here (nothing is stored, no server-side tools)
IGNORED = {"store", "include", "metadata", "prompt_cache_key", "safety_identifier", "service_tier", "truncation",
           "user", "background", "max_tool_calls", "stream_options", "top_logprobs"}
_PASSED = {"model", "temperature", "top_p", "stream", "parallel_tool_calls"}
_KNOWN = _PASSED | IGNORED | {"input", "instructions", "tools", "tool_choice", "max_output_tokens", "text",
                              "reasoning", "previous_response_id", "conversation", "prompt"}


def _bad(message: str, param: Optional[str] = None) -> RequestError:
    return RequestError(400, message, param=param, code="invalid_value")


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: StrictStr


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: Optional[TextFormat] = None


class ResponsesBody(BaseModel):
    """``POST /v1/responses`` (the module docstring says what each field does); a field not
    declared here goes to the chat request as it is."""

    model_config = ConfigDict(extra="allow")

    input: Union[StrictStr, List[Any]]
    instructions: Optional[StrictStr] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Union[Literal["auto", "none", "required"], FunctionChoice, None] = None
    max_output_tokens: Optional[StrictInt] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[Dict[str, Any]] = None
    previous_response_id: Any = None
    conversation: Any = None
    prompt: Any = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, value):
        if value is None or value in ("auto", "none", "required") or (
                isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str)):
            return value
        raise refusal("'tool_choice' must be auto, none, required or {\"type\": \"function\", \"name\": ...}")

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value):
        if isinstance(value, list) and not value:
            raise refusal("'input' must be a string or a non-empty list of items")
        return value

    @field_validator("max_output_tokens")
    @classmethod
    def _at_least_one(cls, value):
        if value is not None and value < 1:
            raise refusal(f"invalid 'max_output_tokens': {value}; it must be at least 1")
        return value

    @field_validator("previous_response_id", "conversation", "prompt")
    @classmethod
    def _stored(cls, value, info):
        if value:
            raise refusal(f"{info.field_name!r} is not supported: this server stores no responses or prompts; "
                          "send the whole conversation as 'input'", code="unsupported_parameter")
        return value

    @model_validator(mode="after")
    def _forced_tool(self):
        functions = [t for t in self.tools or [] if t.get("type") == "function"]
        if not functions and self.tool_choice not in (None, "auto", "none"):
            raise refusal("'tool_choice' forces a tool, but no function tools were given", "tool_choice")
        return self


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _text_of(content, param: str, kinds=("input_text",)) -> str:
    """A message item's text: a string, or its text parts joined (no other kind is served)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{param}: a string or a list of content parts is expected", param)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in kinds or kind in ("input_text", "output_text"):
            if not isinstance(part.get("text"), str):
                raise _bad(f"{param}: a {kind} part needs a 'text' string", param)
            texts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise RequestError(400, f"{param}: {kind} parts are not supported (no model here takes them)",
                               param=param, code="unsupported_content")
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            raise _bad(f"{param}: unknown content part type {kind!r}", param)
    return "\n".join(texts)


def _messages(req: ResponsesBody) -> List[dict]:
    out: List[dict] = []
    if req.instructions is not None:
        out.append({"role": "system", "content": req.instructions})
    items = req.input
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]

    def assistant() -> dict:
        """The assistant message the next output item joins (a new one after any other role)."""
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        return out[-1]

    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{param}: an item object is expected", param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role in ("user", "system", "developer"):
                out.append({"role": "system" if role == "developer" else role,
                            "content": _text_of(item.get("content"), param)})
            elif role == "assistant":
                msg = assistant()
                text = _text_of(item.get("content"), param, kinds=("output_text",))
                msg["content"] = (msg["content"] + "\n" + text) if msg["content"] else text
            else:
                raise _bad(f"{param}: role must be user, system, developer or assistant, got {role!r}", param)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise _bad(f"{param}: a function_call item needs a string {key!r}", param)
            assistant().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{param}: a function_call_output item needs a string 'call_id'", param)
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text_of(output, param)})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
            msg = assistant()
            msg["reasoning_content"] = msg.get("reasoning_content", "") + text
        else:
            raise _bad(f"{param}: unknown item type {kind!r}", param)
    return out


def _tools(req: ResponsesBody) -> Optional[List[dict]]:
    out = []
    for i, tool in enumerate(req.tools or []):
        if tool.get("type") != "function":
            continue  # web search, file search, ...: nothing here serves them (llama-server skips them too)
        if not isinstance(tool.get("name"), str):
            raise _bad(f"tools[{i}]: a function tool needs a 'name'", "tools")
        fn = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(choice):
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(text: Optional[TextConfig]) -> Optional[dict]:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name or "response", "schema": fmt.schema_ or {}}
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    return {"type": "json_schema", "json_schema": schema}


def to_chat(body: dict) -> dict:
    """The chat completion request that serves a Responses request (a 400 for what cannot)."""
    req = validated(ResponsesBody, body)
    # as llama-server does, any other field goes to the chat request (llama-server's own, such as
    # chat_template_kwargs or logit_bias; one the chat route does not know is its 400 there)
    chat: Dict = {k: v for k, v in body.items() if k not in _KNOWN or k in _PASSED}
    chat = {k: v for k, v in chat.items() if v is not None}
    chat["messages"] = _messages(req)
    tools = _tools(req)
    if tools:
        chat["tools"] = tools
        if req.tool_choice is not None:
            chat["tool_choice"] = _tool_choice(req.tool_choice)
    if req.max_output_tokens is not None:
        chat["max_tokens"] = req.max_output_tokens
    fmt = _response_format(req.text)
    if fmt is not None:
        chat["response_format"] = fmt
    if req.reasoning is not None and req.reasoning.get("effort") is not None:
        chat["reasoning_effort"] = req.reasoning["effort"]
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


def _usage(timings: Optional[dict], usage: Optional[dict]) -> dict:
    if timings is not None:
        n_in, n_out, cached = timings["cache_n"] + timings["prompt_n"], timings["predicted_n"], timings["cache_n"]
    else:
        usage = usage or {}
        n_in, n_out = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}


class Responder:
    """A chat request's results (``inner``: :class:`~.openai_api.Responder`) as a ``response``
    (:meth:`responder` picks the streaming one for a streamed request)."""

    dialect = OPENAI

    def __init__(self, inner, body: dict, alias: str):
        self.inner = inner
        self.body = body
        self.model = alias
        self.id = _new_id("resp")
        self.created = int(time.time())

    def _response(self, status: str, output: List[dict], usage: Optional[dict]) -> dict:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status != "in_progress" else None, "error": None,
                "incomplete_details": incomplete, "instructions": b.get("instructions"),
                "max_output_tokens": b.get("max_output_tokens"), "model": self.model, "output": output,
                "parallel_tool_calls": b.get("parallel_tool_calls", True), "previous_response_id": None,
                "reasoning": {"effort": (b.get("reasoning") or {}).get("effort"), "summary": None},
                "store": False, "temperature": b.get("temperature"), "text": b.get("text") or {"format": {"type": "text"}},
                "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
                "top_p": b.get("top_p"), "truncation": "disabled", "usage": usage, "metadata": b.get("metadata") or {}}

    @staticmethod
    def responder(plan, inner, body: dict, alias: str) -> "Responder":
        return (StreamResponder if plan.stream else Responder)(inner, body, alias)

    @staticmethod
    def _status(finish: Optional[str]) -> str:
        return "incomplete" if finish == "length" else "completed"

    # non-streamed --------------------------------------------------------------------------

    def response(self, out: dict, job) -> dict:
        chat = self.inner.response(out, job)
        choice = chat["choices"][0]
        msg = choice.get("message") or {}
        output = []
        if msg.get("reasoning_content"):
            output.append(self._reasoning_item(_new_id("rs"), msg["reasoning_content"]))
        if msg.get("content"):
            output.append(self._message_item(_new_id("msg"), msg["content"]))
        for call in msg.get("tool_calls") or []:
            output.append(self._call_item(call.get("id") or _new_id("call"), call["function"]["name"],
                                          call["function"].get("arguments") or "", "completed"))
        return self._response(self._status(choice.get("finish_reason")), output,
                              _usage(chat.get("timings"), chat.get("usage")))

    @staticmethod
    def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
        return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None}

    @staticmethod
    def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
        return {"id": item_id, "type": "message", "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
        return {"id": "fc_" + call_id.removeprefix("call_"), "type": "function_call", "status": status,
                "call_id": call_id, "name": name, "arguments": arguments}

    def first(self, job) -> List[str]:
        return []

    def progress(self, report, job) -> List[str]:
        return []

    def events(self, piece: dict, job) -> List[str]:
        return []

    def end(self) -> List[str]:
        return []


class StreamResponder(Responder):
    """A streamed request's chunks as the Responses API's events, item by item."""

    def __init__(self, inner, body: dict, alias: str):
        super().__init__(inner, body, alias)
        self.seq = 0                     # the next event's sequence_number
        self.output: List[dict] = []     # the items so far, in output order
        self.open: Optional[int] = None  # the output index of the reasoning or message item open
        self.calls: Dict[int, int] = {}  # the chat's tool call index -> output index
        self.usage: Optional[dict] = None
        self.finish: Optional[str] = None
        self.timings: Optional[dict] = None  # the request's, from its last chunk
        self.in_progress = False             # response.in_progress was sent

    def _event(self, kind: str, **fields) -> str:
        data = dict(type=kind, sequence_number=self.seq, **fields)
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def first(self, job) -> List[str]:
        return [self._event("response.created", response=self._response("in_progress", [], None))]

    def _started(self, **telemetry) -> List[str]:
        """``response.in_progress``: once before the output (a progress report's each time)."""
        if self.in_progress and not telemetry:
            return []
        self.in_progress = True
        return [self._event("response.in_progress", response=self._response("in_progress", list(self.output), None),
                            **telemetry)]

    def progress(self, report, job) -> List[str]:
        from .llama_api import progress_json, progress_timings

        telemetry = {"prompt_progress": progress_json(report)}
        if self.inner.plan.timings_per_token:
            telemetry["timings"] = progress_timings(report)
        return self._started(**telemetry)

    def _close_open(self) -> List[str]:
        """The ``.done`` events of the reasoning or message item open."""
        if self.open is None:
            return []
        i, self.open = self.open, None
        item = self.output[i]
        part = item["content"][0]
        if item["type"] == "reasoning":
            item["status"] = "completed"
            return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0,
                                text=part["text"]),
                    self._event("response.output_item.done", output_index=i, item=item)]
        item["status"] = "completed"
        return [self._event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                            text=part["text"], logprobs=[]),
                self._event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=i, item=item)]

    def _text(self, kind: str, delta: str) -> List[str]:
        events = []
        if self.open is None or self.output[self.open]["type"] != kind:
            events += self._close_open()
            i = len(self.output)
            if kind == "reasoning":
                item = self._reasoning_item(_new_id("rs"), "", "in_progress")
                self.output.append(item)
                events.append(self._event("response.output_item.added", output_index=i,
                                          item=dict(item, content=[])))
            else:
                item = self._message_item(_new_id("msg"), "", "in_progress")
                self.output.append(item)
                events.append(self._event("response.output_item.added", output_index=i, item=dict(item, content=[])))
                events.append(self._event("response.content_part.added", item_id=item["id"], output_index=i,
                                          content_index=0, part=item["content"][0]))
            self.open = i
        i = self.open
        item = self.output[i]
        item["content"][0]["text"] += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(name, item_id=item["id"], output_index=i, content_index=0, delta=delta, **extra))
        return events

    def _call(self, call: dict) -> List[str]:
        events = []
        index = call.get("index", 0)
        fn = call.get("function") or {}
        if index not in self.calls:
            events += self._close_open()
            i = len(self.output)
            item = self._call_item(call.get("id") or _new_id("call"), fn.get("name") or "", "", "in_progress")
            self.output.append(item)
            self.calls[index] = i
            events.append(self._event("response.output_item.added", output_index=i, item=dict(item)))
        i = self.calls[index]
        item = self.output[i]
        if fn.get("name") and not item["name"]:
            item["name"] = fn["name"]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                      delta=fn["arguments"]))
        return events

    def events(self, piece: dict, job) -> List[str]:
        out: List[str] = self._started()
        final = piece["chunk"].get("timings")  # the request's, on its last chunk (the worker's)
        for chunk in self.inner.events(piece, job):
            if chunk.get("usage") is not None:
                self.usage = chunk["usage"]
            if final is not None:
                self.usage, self.timings = _usage(final, None), final
            n_before = len(out)
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    out += self._text("reasoning", delta["reasoning_content"])
                if delta.get("content"):
                    out += self._text("message", delta["content"])
                for call in delta.get("tool_calls") or []:
                    out += self._call(call)
                if choice.get("finish_reason") is not None:
                    self.finish = choice["finish_reason"]
            if self.inner.plan.timings_per_token and chunk.get("timings") is not None and len(out) > n_before:
                out[-1] = self._with(out[-1], timings=chunk["timings"])  # on the piece's last event
        return out

    @staticmethod
    def _with(event: str, **fields) -> str:
        """An SSE block with ``fields`` added to its data."""
        head, data = event.split("\ndata: ", 1)
        return f"{head}\ndata: {json.dumps(dict(json.loads(data), **fields))}\n\n"

    def end(self) -> List[str]:
        events = self._started() + self._close_open()
        for i in sorted(self.calls.values()):
            item = self.output[i]
            item["status"] = "completed"
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                      arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=i, item=item))
        usage = self.usage if self.usage is None or "input_tokens" in self.usage else _usage(None, self.usage)
        status = self._status(self.finish)  # the last event is response.completed either way, as
        # llama-server sends it (OpenAI's clients read the final response from it alone)
        telemetry = {"timings": self.timings} if self.timings is not None else {}
        events.append(self._event("response.completed", response=self._response(status, self.output, usage),
                                  **telemetry))
        return events

    def error_event(self, error: RequestError) -> str:
        return self._event("error", code=error.code, message=error.message, param=error.param)
