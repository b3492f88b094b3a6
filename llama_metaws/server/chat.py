"""The chat template: messages to a prompt, as ``/v1/chat/completions`` and ``/apply-template`` see it.

The server renders chats with one Jinja template, the model's (``tokenizer.chat_template``) or
``--chat-template`` / ``--chat-template-file``'s, through the binding's ``Jinja2ChatFormatter``
(what the binding itself uses for a model's template), and makes the same formatter the model's
chat handler: ``/apply-template`` then shows exactly the prompt a chat request runs, and the
request layer can tokenize that prompt off the model's thread.

Messages are normalized first, as llama-server does for templates that take plain text: a
``content`` given as a list of text parts is their texts joined by newlines, for every role
(OpenAI's clients send an assistant's content that way). Parts of other kinds (images, audio)
are refused: no model served here takes them.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from ..native.binding import llama_cpp
from .errors import RequestError

# llama-server's built-in template names the binding has as Jinja text
BUILTIN = {
    "chatml": "CHATML_CHAT_TEMPLATE",
    "llama3": "LLAMA3_INSTRUCT_CHAT_TEMPLATE",
}


def template_source(flag_value: str) -> str:
    """``--chat-template``'s value as Jinja text: a template itself, or a built-in name."""
    if "{{" in flag_value or "{%" in flag_value:
        return flag_value
    name = flag_value.strip()
    if name in BUILTIN:
        return getattr(llama_cpp.llama_chat_format, BUILTIN[name])
    raise ValueError(f"--chat-template {name!r}: not a Jinja template, nor a built-in name this server has "
                     f"({', '.join(sorted(BUILTIN))}); give the template's text, or its file with "
                     "--chat-template-file")


def normalize_messages(messages) -> List[dict]:
    """The messages with every list of text parts joined into one string (a 400 for other parts)."""
    if not isinstance(messages, list):
        return messages  # the request types report the wrong type
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(400, f"messages[{i}].content[{j}] is a {kind!r} part: this server takes "
                                       "text parts only (the model has no image or audio input)",
                                       param="messages", code="unsupported_content")
                texts.append(part["text"])
            m = dict(m, content="\n".join(texts))
        out.append(m)
    return out


class ChatTemplate:
    """One Jinja chat template: :meth:`render` for requests, :attr:`handler` for the model."""

    def __init__(self, source: str, *, bos_token: str, eos_token: str, eos_id: int):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        fmt = llama_cpp.llama_chat_format
        try:
            self.formatter = fmt.Jinja2ChatFormatter(template=source, eos_token=eos_token, bos_token=bos_token,
                                                     stop_token_ids=[eos_id] if eos_id >= 0 else None)
        except Exception as e:  # noqa: BLE001 - jinja2's TemplateSyntaxError and kin
            raise ValueError(f"the chat template does not compile: {type(e).__name__}: {e}") from None
        self.handler = self.formatter.to_chat_handler()

    @classmethod
    def for_model(cls, llm, flag_value: Optional[str] = None, flag_file: Optional[str] = None):
        """The template a server on ``llm`` uses: the flag's, else the model's; None without either."""
        if flag_value is not None and flag_file is not None:
            raise ValueError("--chat-template and --chat-template-file both given: choose one")
        if flag_file is not None:
            try:
                with open(flag_file, encoding="utf-8") as f:
                    source = f.read()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"--chat-template-file {flag_file}: {e}") from None
        elif flag_value is not None:
            source = template_source(flag_value)
        else:
            source = llm.metadata.get("tokenizer.chat_template")
            if not source:
                return None

        def text(token: int) -> str:
            return llm.detokenize([token], special=True).decode("utf-8", "replace") if token >= 0 else ""

        return cls(source, bos_token=text(llm.token_bos()), eos_token=text(llm.token_eos()), eos_id=llm.token_eos())

    def render(self, messages, *, tools=None, tool_choice=None, functions=None, function_call=None) -> Tuple[str, bool]:
        """The prompt for ``messages`` (normalized) and whether it holds its special tokens
        (``added_special``: then the binding adds no BOS). A 400 when the template refuses."""
        try:
            res = self.formatter(messages=messages, tools=tools, tool_choice=tool_choice, functions=functions,
                                 function_call=function_call)
        except Exception as e:  # noqa: BLE001 - the template's raise_exception, jinja2's errors
            raise RequestError(400, f"the chat template cannot render these messages: {type(e).__name__}: {e}",
                               param="messages", code="invalid_value") from None
        return res.prompt, bool(res.added_special)
