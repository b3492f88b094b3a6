"""llama.cpp's chat layer (``common/chat.h``) through the shim: the one module of ours that calls it.

llama-server runs every chat through this layer, and so do ``/v1/chat/completions``,
``/apply-template`` and ``Llama.create_chat_completion`` here: the routes and ``Llama`` only
translate a request into it (:func:`chat_request`), and this module does the rest, as llama-server
does in ``oaicompat_chat_params_parse`` and its task's ``update_chat_msg``:

1. :class:`ChatTemplates` (``common_chat_templates_init``): the model's template, or
   ``--chat-template`` / ``--chat-template-file``'s;
2. :meth:`ChatTemplates.apply` (``common_chat_templates_apply``): the messages, tools,
   ``tool_choice``, ``parallel_tool_calls``, ``json_schema``, ``reasoning_format``,
   ``enable_thinking``, ``add_generation_prompt``, ``continue_final_message`` (a last assistant
   message continued: asked for, or llama-server's ``prefill_assistant``) and
   ``chat_template_kwargs`` give the prompt,
   a grammar that may be lazy (its triggers), the preserved tokens, the additional stops and a
   parser (:class:`ChatParams`);
3. the generation runs with that grammar (:class:`~llama_metaws.engine.samplers.ChatGrammar`),
   the stops added, and the preserved tokens rendered as text (as the server renders them);
4. :class:`MessageParser` (``common_chat_parse``, partial while a stream runs, and
   ``common_chat_msg_diff``) turns the text into ``content``, ``reasoning_content`` and
   ``tool_calls``, and into a stream's deltas.

Nothing here reads a model's tool-call or thinking format itself: the layer does. What it throws
is a :class:`~llama_metaws.errors.ChatLayerError` (a ``ValueError``: a 400 on the server).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Dict, Iterator, List, Optional

from ..engine.samplers import ChatGrammar, ReasoningBudget
from ..errors import ChatLayerError
from ..native.shim import check_error, ffi, lib

__all__ = ["ChatTemplates", "ChatParams", "ChatOptions", "ChatRequest", "MessageParser", "chat_request",
           "message_json", "delta_json", "run_chat", "REASONING_FORMATS"]

#: llama-server's ``--reasoning-format`` values (``common_reasoning_format_from_name``)
REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")


def _refused(message: str, param: str) -> ChatLayerError:
    """A refusal of a request's field (``param``: the field, for a 400's ``param``)."""
    e = ChatLayerError(message)
    e.param = param
    return e


def _json_out(call, *args):
    """A shim call that answers JSON through its last ``char **`` argument."""
    out = ffi.new("char **")
    check_error(call(*args, out))
    try:
        return json.loads(ffi.string(out[0]).decode("utf-8"))
    finally:
        lib.lmws_chat_free_string(out[0])


def _text(value: str):
    return ffi.new("char[]", value.encode("utf-8"))


@dataclasses.dataclass
class ChatOptions:
    """What llama-server's flags set for every chat (its ``server_chat_params``)."""

    reasoning_format: str = "deepseek"        # --reasoning-format (llama-server's default)
    reasoning: int = -1                       # --reasoning on (1) / off (0) / auto (-1)
    chat_template_kwargs: Dict[str, str] = dataclasses.field(default_factory=dict)  # key -> JSON text
    use_jinja: bool = True                    # --jinja / --no-jinja
    reasoning_budget: int = -1                # --reasoning-budget (-1: unrestricted)
    reasoning_budget_message: str = ""        # --reasoning-budget-message
    prefill_assistant: bool = True            # --[no-]prefill-assistant: a last assistant message continued

    def __post_init__(self):
        if self.reasoning_format not in REASONING_FORMATS:
            raise ValueError(f"--reasoning-format {self.reasoning_format!r}: one of {', '.join(REASONING_FORMATS)}")
        if self.reasoning_budget < -1:
            raise ValueError(f"--reasoning-budget {self.reasoning_budget}: -1 or more")


class ChatTemplates:
    """One model's chat templates in llama.cpp's chat layer (``common_chat_templates``).

    ``source``: a template's text, or ``"chatml"`` (llama.cpp's one built-in name with Jinja
    text); None: the model's own (``tokenizer.chat_template``, and its ``tool_use`` variant),
    else llama.cpp's ChatML. With ``use_jinja=False`` the source may be any of llama.cpp's
    built-in names (``llama_chat_builtin_templates``), applied without Jinja as llama-server's
    ``--no-jinja`` does.
    """

    def __init__(self, model, source: Optional[str] = None, options: Optional[ChatOptions] = None):
        from ..native.shim import address

        self.options = options or ChatOptions()
        ptr = ffi.new("struct lmws_chat_templates **")
        model_ptr = ffi.cast("struct llama_model *", address(model))
        check_error(lib.lmws_chat_templates_init(model_ptr, _text(source) if source else ffi.NULL, ptr))
        self._handle = ffi.gc(ptr[0], lib.lmws_chat_templates_free)
        info = _json_out(lib.lmws_chat_templates_info, self._handle)
        self.source: str = info["source"]
        self.caps: Dict[str, bool] = info["caps"]
        self.was_explicit: bool = info["was_explicit"]
        # llama-server: thinking on unless --reasoning off, where the template supports it
        self.enable_thinking = (self.options.use_jinja and self.options.reasoning != 0
                                and bool(info["supports_enable_thinking"]))

    @classmethod
    def for_llama(cls, llm, chat_template: Optional[str] = None, chat_template_file: Optional[str] = None,
                  options: Optional[ChatOptions] = None) -> "ChatTemplates":
        """The templates a server (or ``Llama``) on ``llm`` uses: ``--chat-template``'s text or
        name, ``--chat-template-file``'s text, else the model's."""
        if chat_template is not None and chat_template_file is not None:
            raise ValueError("--chat-template and --chat-template-file both given: choose one")
        if chat_template_file is not None:
            try:
                with open(chat_template_file, encoding="utf-8") as f:
                    chat_template = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"--chat-template-file {chat_template_file}: {e}") from None
        return cls(llm._model.model, chat_template, options)

    def apply(self, inputs: dict) -> "ChatParams":
        """``common_chat_templates_apply`` on :func:`chat_request`'s inputs."""
        doc = dict(inputs, use_jinja=self.options.use_jinja)
        return ChatParams(**_json_out(lib.lmws_chat_templates_apply, self._handle, _text(json.dumps(doc))))

    def close(self) -> None:
        if self._handle is not None:
            lib.lmws_chat_templates_free(ffi.gc(self._handle, None))
            self._handle = None


@dataclasses.dataclass
class ChatParams:
    """``common_chat_params``: what a template's application gives (see the module docstring)."""

    format: int
    format_name: str
    prompt: str
    grammar: str
    grammar_lazy: bool
    generation_prompt: str
    supports_thinking: bool
    thinking_start_tag: str
    thinking_end_tags: List[str]
    grammar_triggers: List[dict]
    preserved_tokens: List[str]
    additional_stops: List[str]
    parser: str


@dataclasses.dataclass
class ChatRequest:
    """A chat request as the layer takes it: the inputs of ``apply`` and what the run needs."""

    inputs: dict
    reasoning_format: str
    user_grammar: Optional[str] = None   # a request's own ``grammar`` (without tools)
    stop: List[str] = dataclasses.field(default_factory=list)
    reasoning_budget: int = -1           # tokens of thinking at most (-1: unrestricted)
    reasoning_budget_message: str = ""
    continuation: bool = False           # continue_final_message asked for (not prefill_assistant's)
    params: Optional[ChatParams] = None  # once applied

    def applied(self, templates: ChatTemplates) -> ChatParams:
        if self.params is None:
            self.params = templates.apply(self.inputs)
        return self.params


def _tool_choice(tool_choice, tools):
    """OpenAI's ``tool_choice`` as the layer's (``auto`` / ``required`` / ``none``) and the tools
    it leaves: a named tool is that one tool, required (llama-server reads a name as ``auto``)."""
    if tool_choice is None:
        return "auto", tools
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "required", "none"):
            raise _refused(f"Invalid tool_choice: {tool_choice}", "tool_choice")
        return tool_choice, tools
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        named = [t for t in tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)
                 and t["function"].get("name") == name]
        if not named:
            raise _refused(f"invalid 'tool_choice': no tool named {name!r} in 'tools'", "tool_choice")
        return "required", named
    raise _refused(f"Invalid tool_choice: {tool_choice!r}", "tool_choice")


def _json_schema(response_format, json_schema):
    """llama-server's reading of ``response_format`` (and its own ``json_schema``)."""
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise _refused("response_format must be an object", "response_format")
        kind = response_format.get("type") or ""
        if kind == "json_object":
            if "schema" in response_format or not json_schema:
                json_schema = response_format.get("schema", {})
        elif kind == "json_schema":
            wrapper = response_format.get("json_schema") or {}
            json_schema = wrapper.get("schema", {}) if isinstance(wrapper, dict) else {}
        elif kind not in ("", "text"):
            raise _refused(f'response_format type must be one of "text" or "json_object", but got: {kind}', "response_format")
    if isinstance(json_schema, dict) and not json_schema:
        json_schema = {"type": "object"}  # an absent or empty schema means any object
    return json_schema


def _continued(messages, continue_final_message, add_generation_prompt: bool, prefill_assistant: bool):
    """``continue_final_message`` and ``add_generation_prompt`` as llama-server settles them: a
    request's ``continue_final_message`` (true, ``"content"`` or ``"reasoning_content"``, as
    ``common_chat_continuation_parse`` reads it; anything else is none), else with
    ``prefill_assistant`` a last assistant message is continued (and the generation prompt left
    off); the refusals are its own. Also whether the request asked for it."""
    asked = continue_final_message is True or continue_final_message in ("content", "reasoning_content")
    value = continue_final_message if asked else None
    last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
    if value is None and prefill_assistant and last.get("role") == "assistant":
        if len(messages) >= 2 and isinstance(messages[-2], dict) and messages[-2].get("role") == "assistant":
            raise _refused("Cannot have 2 or more assistant messages at the end of the list.", "messages")
        value, add_generation_prompt = True, False
    if value is not None and add_generation_prompt:
        raise _refused("Cannot set both add_generation_prompt and continue_final_message to true.",
                       "continue_final_message")
    if value is not None and last.get("role") == "assistant" and last.get("tool_calls"):
        raise _refused("Cannot continue an assistant message that contains tool calls.", "messages")
    return value, add_generation_prompt, asked


def chat_request(templates: ChatTemplates, messages, *, tools=None, tool_choice=None, parallel_tool_calls=None,
                 response_format=None, json_schema=None, grammar: Optional[str] = None, stop=None,
                 reasoning_format: Optional[str] = None, chat_template_kwargs: Optional[dict] = None,
                 add_generation_prompt: bool = True, continue_final_message=None,
                 reasoning_effort: Optional[str] = None, reasoning_budget_tokens: Optional[int] = None,
                 thinking_budget_tokens: Optional[int] = None,
                 reasoning_budget_message: Optional[str] = None) -> ChatRequest:
    """An OpenAI chat request as the layer's inputs, read as llama-server reads it
    (``oaicompat_chat_params_parse``); a :class:`ChatLayerError` for what it refuses."""
    opts = templates.options
    if not isinstance(messages, list):
        raise _refused("Expected 'messages' to be an array", "messages")
    continued, add_generation_prompt, asked = _continued(
        messages, continue_final_message, bool(add_generation_prompt), opts.prefill_assistant)
    if tools is not None and not isinstance(tools, list):
        raise _refused(f"Expected 'tools' to be an array, got {json.dumps(tools)}", "tools")
    choice, tools = _tool_choice(tool_choice, tools)
    if not opts.use_jinja and (tools or choice != "auto"):
        raise _refused("tools param requires --jinja flag", "tools")
    if json_schema is not None and grammar:
        raise _refused("Cannot use both json_schema and grammar", "grammar")
    schema = _json_schema(response_format, json_schema)
    if tools and choice != "none" and grammar is not None:
        raise _refused("Cannot use custom grammar constraints with tools.", "grammar")
    kwargs = dict(opts.chat_template_kwargs)
    for key, value in (chat_template_kwargs or {}).items():
        kwargs[key] = json.dumps(value)
    enable_thinking = templates.enable_thinking
    flag = kwargs.get("enable_thinking", "")
    if flag == "true":
        enable_thinking = True
    elif flag == "false":
        enable_thinking = False
    elif flag.startswith('"'):
        raise _refused('invalid type for "enable_thinking" (expected boolean, got string)', "chat_template_kwargs")
    if reasoning_effort == "none":
        enable_thinking = False
        kwargs.pop("reasoning_effort", None)
    elif reasoning_effort:
        kwargs["reasoning_effort"] = json.dumps(reasoning_effort)
    rf = reasoning_format if reasoning_format is not None else opts.reasoning_format
    if rf not in REASONING_FORMATS:
        raise _refused(f"unknown reasoning_format {rf!r}: one of {', '.join(REASONING_FORMATS)}", "reasoning_format")
    if parallel_tool_calls is None:
        parallel_tool_calls = bool(templates.caps.get("supports_parallel_tool_calls", False))
    inputs = {"messages": messages, "tools": tools or [], "tool_choice": choice,
              "json_schema": json.dumps(schema) if schema is not None else "", "grammar": grammar or "",
              "parallel_tool_calls": bool(parallel_tool_calls), "add_generation_prompt": bool(add_generation_prompt),
              "reasoning_format": rf, "enable_thinking": enable_thinking, "chat_template_kwargs": kwargs}
    if continued is not None:
        inputs["continue_final_message"] = continued
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    budget = reasoning_budget_tokens if reasoning_budget_tokens is not None else thinking_budget_tokens
    if budget is None or budget == -1:
        budget = opts.reasoning_budget
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < -1:
        raise _refused(f"invalid reasoning_budget_tokens {budget!r}: -1 (unrestricted) or more",
                       "reasoning_budget_tokens")
    message = reasoning_budget_message if reasoning_budget_message is not None else opts.reasoning_budget_message
    return ChatRequest(inputs=inputs, reasoning_format=rf, user_grammar=grammar or None, stop=stops,
                       reasoning_budget=budget, reasoning_budget_message=str(message), continuation=asked)


class MessageParser:
    """The parse of one generation (``common_chat_parse``): :meth:`update` with each piece of
    text, ``partial`` while more may come; the message so far and its diffs from the last one.
    ``continuation``: the request's ``continue_final_message``, whose text (in the generation
    prompt) the first diff then leaves out, as llama-server's does."""

    def __init__(self, params: ChatParams, reasoning_format: str, stream: bool, continuation: bool = False):
        doc = {"format": params.format, "reasoning_format": reasoning_format,
               # llama-server: deepseek-legacy keeps the thinking inline in a stream's content
               "reasoning_in_content": bool(stream and reasoning_format == "deepseek-legacy"),
               "generation_prompt": params.generation_prompt, "parse_tool_calls": True,
               "parser": params.parser, "is_continuation": bool(continuation)}
        ptr = ffi.new("struct lmws_chat_parser **")
        check_error(lib.lmws_chat_parser_init(_text(json.dumps(doc)), ptr))
        self._handle = ffi.gc(ptr[0], lib.lmws_chat_parser_free)
        self.message = {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": []}

    def update(self, text: str, partial: bool):
        out = _json_out(lib.lmws_chat_parser_update, self._handle, _text(text), bool(partial))
        self.message = out["message"]
        return out["message"], out["diffs"]

    def finish(self, text: str, reason: Optional[str]):
        """The last :meth:`update` of a generation that ended with ``reason``. One the token budget
        cut (``length``) in the middle of what the format reads whole (a tool call half written)
        is read as far as it goes, as a stream's partial parses read it, and keeps its
        ``length``: llama-server answers it with an error, after the tokens were spent."""
        try:
            return self.update(text, False)
        except ChatLayerError:
            if reason != "length":
                raise
            return self.update("", True)  # the text was taken before the whole parse failed


def message_json(msg: dict) -> dict:
    """The parsed message as llama-server answers it (``common_chat_msg::to_json_oaicompat``)."""
    out = {"role": msg.get("role") or "assistant", "content": msg.get("content", "")}
    if msg.get("reasoning_content"):
        out["reasoning_content"] = msg["reasoning_content"]
    if msg.get("tool_calls"):
        out["tool_calls"] = []
        for tc in msg["tool_calls"]:
            call = {"type": "function", "function": {"name": tc["name"], "arguments": tc["arguments"]}}
            if tc.get("id"):
                call["id"] = tc["id"]
            out["tool_calls"].append(call)
    return out


def delta_json(diff: dict) -> dict:
    """One diff as a stream's ``delta`` (llama-server's ``server_chat_msg_diff_to_json_oaicompat``)."""
    delta = {}
    if diff["reasoning_content_delta"]:
        delta["reasoning_content"] = diff["reasoning_content_delta"]
    if diff["content_delta"]:
        delta["content"] = diff["content_delta"]
    if diff["tool_call_index"] >= 0:
        tc = diff["tool_call_delta"]
        call = {"index": diff["tool_call_index"]}
        if tc["id"]:
            call["id"] = tc["id"]
            call["type"] = "function"
        if tc["name"] or tc["arguments"]:
            call["function"] = {}
            if tc["name"]:
                call["function"]["name"] = tc["name"]
            if tc["arguments"]:
                call["function"]["arguments"] = tc["arguments"]
        delta["tool_calls"] = [call]
    return delta


def preserved_ids(llm, params: ChatParams) -> List[int]:
    """The preserved tokens that are one token of the vocabulary (as llama-server keeps them)."""
    ids = []
    for text in params.preserved_tokens:
        tokens = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        if len(tokens) == 1:
            ids.append(int(tokens[0]))
    return ids


def grammar_of(request: ChatRequest, params: ChatParams, preserved: List[int]) -> Optional[ChatGrammar]:
    """The grammar the generation samples under, as llama-server sets it: the layer's own
    (lazy with its triggers, or eager and fed the generation prompt first), else the request's."""
    if params.grammar:
        return ChatGrammar(params.grammar, lazy=params.grammar_lazy, triggers=params.grammar_triggers,
                           preserved=preserved, generation_prompt=params.generation_prompt, prefill=True)
    if request.user_grammar:
        return ChatGrammar(request.user_grammar, preserved=preserved)
    return None


def run_chat(llm, templates: ChatTemplates, request: ChatRequest, *, stream: bool = False,
             model: Optional[str] = None, stream_usage: bool = False, **sampling) -> object:
    """A chat completion (or its chunks, with ``stream``) on ``llm`` through the layer:
    ``sampling`` is ``create_completion``'s (temperature, max_tokens, seed, ...)."""
    params = request.applied(templates)
    preserved = preserved_ids(llm, params)
    stops = request.stop + [s for s in params.additional_stops if s not in request.stop]
    parser = MessageParser(params, request.reasoning_format, stream, request.continuation)
    # the binding's completion generator on the engine (a served model's, with its checks)
    budget = None
    if request.reasoning_budget >= 0 and params.thinking_start_tag and params.thinking_end_tags:
        budget = ReasoningBudget(params.thinking_start_tag, params.thinking_end_tags, request.reasoning_budget,
                                 request.reasoning_budget_message, params.generation_prompt)
    chunks = llm._create_completion(prompt=params.prompt, stream=stream, stop=stops or None,
                                    grammar=grammar_of(request, params, preserved), preserved_tokens=set(preserved),
                                    reasoning_budget=budget, model=model, stream_usage=stream_usage, **sampling)
    if stream:
        return _chat_stream(chunks, parser, model or llm.model_path)
    res = list(chunks)[-1]
    choice = res["choices"][0]
    msg, _ = parser.finish(choice["text"], choice["finish_reason"])
    return {"id": f"chatcmpl-{uuid.uuid4()}", "object": "chat.completion", "created": res["created"],
            "model": res["model"], "choices": [{"index": 0, "message": message_json(msg),
                                                "logprobs": _chat_logprobs(choice["logprobs"]),
                                                "finish_reason": _finish(choice["finish_reason"], msg)}],
            "usage": res["usage"]}


def _finish(reason: str, msg: dict) -> str:
    """llama-server's: ``tool_calls`` where an answer that stopped called a tool."""
    return "tool_calls" if reason == "stop" and msg["tool_calls"] else reason


def _chat_stream(chunks, parser: MessageParser, model_name: str) -> Iterator[dict]:
    """The completion's chunks as chat chunks: the deltas of each partial parse, then the final
    parse's, then the finish reason (``tool_calls`` where a tool was called), then usage. A
    piece's logprobs go on its last delta (as llama-server sends them)."""
    cid = f"chatcmpl-{uuid.uuid4()}"
    created = int(time.time())

    def chunk(delta: dict, finish=None) -> dict:
        return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    first = True
    try:
        for c in chunks:
            if not c["choices"]:  # the usage chunk
                yield dict(c, id=cid, object="chat.completion.chunk", created=created, model=model_name)
                continue
            choice = c["choices"][0]
            if first:  # as llama-server opens a stream
                first = False
                yield chunk({"role": "assistant", "content": None})
            final = choice["finish_reason"] is not None
            msg, diffs = parser.finish(choice["text"], choice["finish_reason"]) if final else \
                parser.update(choice["text"], True)
            pieces = [chunk(delta_json(d)) for d in diffs]
            if choice.get("logprobs") and pieces:
                pieces[-1]["choices"][0]["logprobs"] = _chat_logprobs(choice["logprobs"])
            yield from pieces
            if final:
                yield chunk({}, _finish(choice["finish_reason"], msg))
    finally:
        chunks.close()


# --------------------------------------------------------------------------------------------
# Llama.create_chat_completion on the layer

#: ``Llama(chat_format=LAYER_FORMAT)``: chats through llama.cpp's chat layer (also the default
#: for a model whose template the layer reads, when neither chat_format nor chat_handler is given)
LAYER_FORMAT = "llama.cpp"


def templates_for(llm, chat_format: Optional[str], chat_handler, chat_template: Optional[str],
                  options: Optional[ChatOptions] = None) -> Optional[ChatTemplates]:
    """The templates ``Llama`` chats with, or None for the binding's own chat formats: asked for
    (``chat_format="llama.cpp"`` or a ``chat_template``), or the model's own template when no
    format or handler is named and the layer reads that template."""
    if chat_format == LAYER_FORMAT or chat_template is not None:
        return ChatTemplates.for_llama(llm, chat_template, options=options)
    if chat_format is None and chat_handler is None and llm.metadata.get("tokenizer.chat_template"):
        try:
            return ChatTemplates.for_llama(llm, None, options=options)
        except ChatLayerError:
            return None  # the binding's Jinja2 formatter renders it, as before
    return None


def _chat_logprobs(logprobs):
    """A completion's logprobs in a chat's shape, as the binding's chat handlers give them."""
    from ..native.binding import llama_cpp

    return llama_cpp.llama_chat_format._convert_text_completion_logprobs_to_chat(logprobs)


def create_chat_completion(llm, templates: ChatTemplates, messages=None, functions=None, function_call=None,
                           tools=None, tool_choice=None, temperature: float = 0.2, top_p: float = 0.95,
                           top_k: int = 40, min_p: float = 0.05, typical_p: float = 1.0, stream: bool = False,
                           stop=None, seed=None, response_format=None, max_tokens=None,
                           presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                           repeat_penalty: float = 1.0, tfs_z: float = 1.0, mirostat_mode: int = 0,
                           mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, model=None,
                           logits_processor=None, grammar=None, logit_bias=None, logprobs=None,
                           top_logprobs=None, parallel_tool_calls=None, reasoning_format=None,
                           chat_template_kwargs=None, reasoning_effort=None, reasoning_budget_tokens=None,
                           reasoning_budget_message=None, add_generation_prompt: bool = True,
                           continue_final_message=None, stream_usage: bool = False,
                           request: Optional[ChatRequest] = None, id_slot: Optional[int] = None,
                           cache_prompt: bool = True):
    """``Llama.create_chat_completion`` through the layer (the binding's arguments, plus
    ``parallel_tool_calls``, ``reasoning_format``, ``chat_template_kwargs``, ``reasoning_effort``,
    ``reasoning_budget_tokens``, ``reasoning_budget_message``, ``add_generation_prompt`` and
    ``continue_final_message`` as llama-server takes them: a last assistant message is continued,
    as llama-server's ``prefill_assistant`` does by default); ``request``: one :func:`chat_request`
    made already (the server's), which then stands for the messages and their options; ``id_slot``
    and ``cache_prompt``: llama-server's request fields, onto the engine's request."""
    if request is None:
        if functions and not tools:  # OpenAI's older form of tools
            tools = [{"type": "function", "function": f} for f in functions]
            if isinstance(function_call, dict):
                tool_choice = {"type": "function", "function": function_call}
            elif function_call in ("auto", "none"):
                tool_choice = function_call
        text = getattr(grammar, "_grammar", grammar)
        request = chat_request(templates, messages, tools=tools, tool_choice=tool_choice,
                               parallel_tool_calls=parallel_tool_calls, response_format=response_format,
                               grammar=text, stop=stop, reasoning_format=reasoning_format,
                               chat_template_kwargs=chat_template_kwargs, reasoning_effort=reasoning_effort,
                               reasoning_budget_tokens=reasoning_budget_tokens,
                               reasoning_budget_message=reasoning_budget_message,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message)
    n_logprobs = (top_logprobs or 0) if logprobs else None
    out = run_chat(llm, templates, request, stream=stream, model=model, stream_usage=stream_usage,
                   temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, typical_p=typical_p,
                   seed=seed, max_tokens=max_tokens, presence_penalty=presence_penalty,
                   frequency_penalty=frequency_penalty, repeat_penalty=repeat_penalty, tfs_z=tfs_z,
                   mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta,
                   logits_processor=logits_processor, logit_bias=logit_bias, logprobs=n_logprobs,
                   id_slot=id_slot, cache_prompt=cache_prompt)
    return out
