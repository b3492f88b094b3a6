"""llama.cpp's chat layer through the shim (llama_metaws.api.chat_layer): templates from the vendored
tree (read from the patched source at test time), apply, parse (full and partial), diffs, the
grammar it makes, and every C++ exception as a Python one (the process goes on)."""

import json
import subprocess
import sys

import pytest

from llama_metaws.api.chat_layer import (ChatGrammar, ChatTemplates, MessageParser, chat_request, delta_json,
                                     message_json)
from llama_metaws.errors import ChatLayerError
from llama_metaws.native.runtime import require_build

TEMPLATES = require_build().src_dir / "models" / "templates"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "the time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
HI = [{"role": "user", "content": "What is the weather in Paris?"}]


def templates(name: str, **options) -> ChatTemplates:
    return ChatTemplates(None, (TEMPLATES / name).read_text())


def applied(t: ChatTemplates, messages=HI, **fields):
    req = chat_request(t, messages, **fields)
    return req, req.applied(t)


def parse(params, text: str, reasoning_format="deepseek", partial=False):
    parser = MessageParser(params, reasoning_format, stream=False)
    msg, _ = parser.update(text, partial)
    return msg


def test_the_vendored_templates_are_in_the_patched_tree():
    for name in ("Qwen3.5-4B.jinja", "Qwen-Qwen3-0.6B.jinja", "Qwen3-Coder.jinja", "Qwen-QwQ-32B.jinja",
                 "meta-llama-Llama-3.1-8B-Instruct.jinja", "llama-cpp-deepseek-r1.jinja",
                 "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja"):
        assert (TEMPLATES / name).is_file(), name


def test_apply_renders_the_prompt_and_the_generation_prompt_of_qwen35():
    t = templates("Qwen3.5-4B.jinja")
    _, p = applied(t)
    assert p.prompt.endswith("<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert p.generation_prompt.endswith("<think>\n")
    assert p.grammar == ""  # no tools, no schema: nothing constrains the answer
    _, off = applied(t, chat_template_kwargs={"enable_thinking": False})
    assert off.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tools_give_a_lazy_grammar_with_triggers_and_a_required_choice_an_eager_one():
    t = templates("Qwen3.5-4B.jinja")
    _, auto = applied(t, tools=[WEATHER])
    assert "get_weather" in auto.prompt  # the template describes the tool
    assert auto.grammar and auto.grammar_lazy and auto.grammar_triggers
    assert any("<tool_call>" in tr["value"] for tr in auto.grammar_triggers)
    _, required = applied(t, tools=[WEATHER], tool_choice="required")
    assert required.grammar and not required.grammar_lazy
    _, named = applied(t, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert "get_time" in named.grammar and "get_weather" not in named.grammar  # the named tool only
    assert not named.grammar_lazy


def test_a_json_schema_response_format_goes_through_the_layer():
    t = templates("Qwen3.5-4B.jinja")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    _, p = applied(t, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert p.grammar and not p.grammar_lazy and '"\\"n\\""' in p.grammar.replace(" ", "") or '\\"n\\"' in p.grammar


def test_the_parser_reads_thinking_and_a_tool_call_from_qwen35_output():
    t = templates("Qwen3.5-4B.jinja")
    _, p = applied(t, tools=[WEATHER], tool_choice="required")
    text = ("thinking it over\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n</function>\n</tool_call>")
    msg = parse(p, text)
    assert msg["reasoning_content"] == "thinking it over\n"  # the layer's cut (llama-server's answer too)
    assert msg["content"] == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in msg["tool_calls"]] == [("get_weather", {"city": "Paris"})]
    assert len(msg["tool_calls"][0]["id"]) == 32  # an id, as llama-server gives one
    out = message_json(msg)
    assert out["tool_calls"][0]["type"] == "function" and out["tool_calls"][0]["function"]["name"] == "get_weather"
    # reasoning_format none (asked of apply: the parser is built there) leaves the thinking in the content
    _, none = applied(t, reasoning_format="none")
    plain = parse(none, "thinking it over\n</think>\n\nhello", reasoning_format="none")
    assert plain["reasoning_content"] == "" and "thinking it over" in plain["content"]


def test_partial_parses_give_deltas_with_the_call_id_and_name_once_and_the_arguments_in_pieces():
    t = templates("Qwen3.5-4B.jinja")
    _, p = applied(t, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=True)
    text = ("hmm\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n"
            "</function>\n</tool_call>")
    parser = MessageParser(p, "deepseek", stream=True)
    deltas = []
    for i in range(0, len(text), 3):
        deltas += [delta_json(d) for d in parser.update(text[i:i + 3], True)[1]]
    msg, last = parser.update("", False)
    deltas += [delta_json(d) for d in last]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == msg["reasoning_content"] == "hmm\n"
    calls = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"ids": [], "names": [], "args": ""})
            if "id" in tc:
                c["ids"].append(tc["id"])
            fn = tc.get("function", {})
            if "name" in fn:
                c["names"].append(fn["name"])
            c["args"] += fn.get("arguments", "")
    assert sorted(calls) == [0, 1]
    for i, want in enumerate(msg["tool_calls"]):
        assert calls[i]["ids"] == [want["id"]] and calls[i]["names"] == [want["name"]]
        assert calls[i]["args"] == want["arguments"]
    assert [json.loads(c["arguments"]) for c in msg["tool_calls"]] == [{"city": "Paris"}, {"zone": "CET"}]
    assert sum(1 for d in deltas if any("arguments" in tc.get("function", {}) for tc in d.get("tool_calls", []))) > 2


@pytest.mark.parametrize("bad", [
    "{% if %}",                       # does not parse
    "{{ messages[0].content | nosuchfilter }}",
])
def test_a_bad_template_is_a_chat_layer_error(bad):
    with pytest.raises(ChatLayerError):
        t = ChatTemplates(None, bad)
        applied(t)


def test_a_template_that_raises_is_a_chat_layer_error():
    with pytest.raises(ChatLayerError, match="no system messages here"):
        t = ChatTemplates(None, "{{ raise_exception('no system messages here') }}")
        applied(t)
    # one that raises only on some messages: those are refused at apply, the others render
    t = ChatTemplates(None, "{% for m in messages %}{% if m.role == 'robot' %}{{ raise_exception('no robots') }}"
                            "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    with pytest.raises(ChatLayerError, match="no robots"):
        applied(t, [{"role": "robot", "content": "x"}])
    assert applied(t)[1].prompt.startswith("user: What is the weather")


@pytest.mark.parametrize("messages,tools", [
    ([{"content": "no role"}], None),
    ([{"role": "user", "content": 5}], None),
    (HI, [{"type": "function"}]),                     # no function
    (HI, [{"type": "retrieval", "function": {"name": "x"}}]),
])
def test_messages_or_tools_the_layer_cannot_read_are_chat_layer_errors(messages, tools):
    t = templates("Qwen3.5-4B.jinja")
    with pytest.raises(ChatLayerError):
        applied(t, messages, tools=tools)


def test_a_grammar_beside_tools_is_refused_as_llama_server_refuses_it():
    t = templates("Qwen3.5-4B.jinja")
    with pytest.raises(ChatLayerError, match="Cannot use custom grammar constraints with tools"):
        applied(t, tools=[WEATHER], grammar='root ::= "x"')


def test_no_template_and_no_model_is_a_value_error_not_an_abort():
    with pytest.raises(ValueError, match="neither a model nor a template"):
        ChatTemplates(None, None)


@pytest.fixture(scope="module")
def qwen_llm(models_dir):
    from llama_metaws import Llama
    from llama_metaws_dev.testing import make_tiny_model

    path = make_tiny_model(models_dir / "chat-layer-qwen.gguf", vocab="chat-qwen")
    with Llama(str(path), n_ctx=512, verbose=False) as llm:
        yield llm


def test_a_lazy_grammar_without_triggers_and_a_bad_parser_are_errors(qwen_llm):
    with pytest.raises(ChatLayerError, match="no triggers"):
        ChatGrammar('root ::= "x"', lazy=True).sampler(qwen_llm._model.vocab)
    # a trigger word that is one token must be a preserved token (llama-server's check)
    with pytest.raises(ChatLayerError, match="preserved token"):
        ChatGrammar('root ::= "x"', lazy=True, triggers=[{"type": 1, "value": "<tool_call>", "token": -1}]
                    ).sampler(qwen_llm._model.vocab)
    t = templates("Qwen3.5-4B.jinja")
    _, p = applied(t)
    p.format = 99
    with pytest.raises(ChatLayerError, match="unknown chat format"):
        MessageParser(p, "deepseek", stream=False)


def test_every_error_leaves_the_process_running():
    """The errors above in a child: it exits 0 after each (a C++ exception never ends it)."""
    code = (
        "from llama_metaws.api.chat_layer import ChatTemplates, chat_request\n"
        "from llama_metaws.errors import ChatLayerError\n"
        "for src in ['{% if %}', '{{ raise_exception(\"x\") }}']:\n"
        "    try:\n"
        "        t = ChatTemplates(None, src); chat_request(t, [{'role': 'user', 'content': 'a'}]).applied(t)\n"
        "    except ChatLayerError as e:\n"
        "        print('refused:', type(e).__name__)\n"
        "print('alive')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["refused:", "ChatLayerError", "refused:", "ChatLayerError", "alive"]


def _builtin_names():
    import ctypes

    from llama_metaws.native.binding import llama_cpp

    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * n)()
    llama_cpp.llama_chat_builtin_templates(names, n)
    return [x.decode() for x in names]


def test_every_built_in_template_name_renders_without_jinja_as_no_jinja_does():
    from llama_metaws.api.chat_layer import ChatOptions

    names = _builtin_names()
    assert {"chatml", "llama3", "mistral-v7", "deepseek3", "gemma"} <= set(names)
    for name in names:
        t = ChatTemplates(None, name, ChatOptions(use_jinja=False))
        prompt = applied(t, [{"role": "user", "content": "a question"}])[1].prompt
        assert "a question" in prompt, name  # (deepseek-ocr's is the content alone)
    t = ChatTemplates(None, "llama3", ChatOptions(use_jinja=False))
    assert "<|start_header_id|>user<|end_header_id|>" in applied(t)[1].prompt
    with pytest.raises(ChatLayerError, match="requires --jinja"):  # llama-server: no tools without Jinja
        applied(t, tools=[WEATHER])
