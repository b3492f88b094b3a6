"""A chat request as the server hands it to llama.cpp's chat layer (:mod:`llama_metaws.api.chat_layer`).

``/v1/chat/completions`` and ``/apply-template`` read the request's chat fields here, as
llama-server's ``oaicompat_chat_params_parse`` reads them, into one
:class:`~llama_metaws.api.chat_layer.ChatRequest`, and apply the template to it at once (off the
model's thread): what the layer refuses (a template that cannot render these messages, tools it
cannot read, a schema it cannot turn into a grammar) is a 400 before the request waits for the
model, and the prompt is tokenized here. The model's thread then runs the same request
(``Llama.create_chat_completion(request=...)``), which ``Llama`` itself runs the same way.

Content given as a list of parts is passed on as llama-server passes it (the layer joins or
keeps the text parts as the template takes them); parts of other kinds (images, audio) are
refused: no model served here takes them.
"""

from __future__ import annotations

from typing import List

from ..api.chat_layer import ChatRequest, chat_request
from ..errors import ChatLayerError, GrammarError
from .errors import RequestError

#: the request fields the chat layer reads (besides messages), as llama-server names them
CHAT_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "response_format", "json_schema", "grammar",
               "stop", "reasoning_format", "chat_template_kwargs", "reasoning_effort", "add_generation_prompt",
               "continue_final_message", "reasoning_budget_tokens", "thinking_budget_tokens", "reasoning_budget_message")


def check_content(messages) -> List[dict]:
    """The messages as sent, with a 400 for a content part that is not text."""
    if not isinstance(messages, list):
        raise RequestError(400, "Expected 'messages' to be an array", param="messages", code="invalid_value")
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(400, f"messages[{i}].content[{j}] is a {kind!r} part: this server takes "
                                       "text parts only (the model has no image or audio input)",
                                       param="messages", code="unsupported_content")
    return messages


def checked_messages(messages) -> List[dict]:
    """The messages as llama-server's ``oaicompat_chat_params_parse`` checks them (a 400 in its
    words): a list of objects with a string role; every message but an assistant's has a
    ``content``, an assistant's a ``content`` or ``tool_calls`` (``content: null`` beside tool
    calls, as OpenAI's clients send an assistant turn back); a content is a string, null or a
    list of text parts. Roles are the template's to read: llama.cpp's chat layer maps OpenAI's
    ``developer`` to ``system`` (but for GPT-OSS, whose template has it) and refuses what it
    cannot render."""
    if not isinstance(messages, list):
        raise RequestError(400, "Expected 'messages' to be an array", param="messages", code="invalid_value")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(400, f"messages[{i}]: an object is expected", param="messages", code="invalid_value")
        role = m.get("role")
        if not isinstance(role, str):
            raise RequestError(400, f"messages[{i}].role: a string is expected", param="messages",
                               code="invalid_value")
        if role == "assistant":
            if "content" not in m and "tool_calls" not in m:
                raise RequestError(400, "Assistant message must contain either 'content' or 'tool_calls'!",
                                   param="messages", code="invalid_value")
        elif "content" not in m:
            raise RequestError(400, "All non-assistant messages must contain 'content'", param="messages",
                               code="invalid_value")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(400, f"messages[{i}].content: Expected 'content' to be a string or an array",
                               param="messages", code="invalid_value")
    return check_content(messages)


def request_of(body: dict, model) -> ChatRequest:
    """The chat request of ``body``, applied to the model's templates; a 400 for what the chat
    layer refuses, or for a grammar it makes that llama.cpp would not take (too deep, too big)."""
    fields = {k: body[k] for k in CHAT_FIELDS if body.get(k) is not None}
    if body.get("functions") and not body.get("tools"):  # OpenAI's older form of tools
        fields["tools"] = [{"type": "function", "function": f} for f in body["functions"]]
        call = body.get("function_call")
        if isinstance(call, dict) or call in ("auto", "none"):
            fields["tool_choice"] = {"type": "function", "function": call} if isinstance(call, dict) else call
    try:
        req = chat_request(model.chat, check_content(body.get("messages")), **fields)
        params = req.applied(model.chat)
    except ChatLayerError as e:
        raise RequestError(400, str(e), param=_param_of(e, fields), code="invalid_value") from None
    if params.grammar:
        try:
            model.llm.check_grammar(params.grammar)
        except GrammarError as e:
            raise RequestError(400, f"the grammar the chat layer makes for this request is refused: {e}",
                               param="tools" if fields.get("tools") else "response_format",
                               code="invalid_grammar") from None
    return req


def _param_of(error: ChatLayerError, fields: dict) -> str:
    """The field a refusal names: the request layer's own, else what the layer's message is about."""
    if getattr(error, "param", None):
        return error.param
    text = str(error).lower()
    if "tool" in text and fields.get("tools") is not None:
        return "tools"
    if ("schema" in text or "grammar" in text) and fields.get("json_schema") is not None:
        return "json_schema"
    if ("schema" in text or "grammar" in text) and fields.get("response_format") is not None:
        return "response_format"
    return "messages"
