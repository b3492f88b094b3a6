"""The agents' APIs on ``serve``, through their official clients: OpenAI's Responses API
(``client.responses.create`` / ``.stream``) and Anthropic's Messages API (``messages.create`` /
``.stream`` / ``.count_tokens``). Each request is served by the chat route, so each answer must
equal the chat completion of the same conversation, and a forced tool call must come back as the
API's own item or block, streamed or not.
"""

import json

import anthropic
import openai
import pytest

from llama_metaws.native.runtime import require_build
from llama_metaws_dev.testing import EOS_TOKEN, N_VOCAB, make_tiny_mtp_model, make_tiny_model
from llama_metaws.demo.vocab import chat_vocab
from serving import Server

N = 8
# a boolean argument: the chat layer's grammar spells it out (an XML format's string is free text)
TOOL_SCHEMA = {"type": "object", "properties": {"hot": {"type": "boolean"}}, "required": ["hot"],
               "additionalProperties": False}
QWEN_TEMPLATE = require_build().src_dir / "models" / "templates" / "Qwen3.5-4B.jinja"
QWEN_TOKENS = {t: i for i, t in enumerate(chat_vocab("qwen", N_VOCAB)[0])}
# a random tiny model would not begin a call by itself: a bias toward <tool_call> (the chat
# layer's grammar takes over from there), the end favoured once the grammar allows it (the model's
# EOS; the family's other end tokens ruled out), as tests/test_server_chat.py steers it
STEER = {"logit_bias": {str(QWEN_TOKENS["<tool_call>"]): 50, str(EOS_TOKEN): 100,
                        str(QWEN_TOKENS["<|im_end|>"]): -100, str(QWEN_TOKENS["<|endoftext|>"]): -100}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "the weather in a city",
                  "parameters": TOOL_SCHEMA}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "the weather in a city", "input_schema": TOOL_SCHEMA}


@pytest.fixture(scope="module")
def server(models_dir, tmp_path_factory):
    model = make_tiny_model(models_dir / "agents-chars.gguf", seed=52, vocab="chars")
    tmp = tmp_path_factory.mktemp("agents")
    srv = Server(model, "--chat-template", "chatml", "-c", "1024", "--temp", "0", "-a", "tiny",
                 log_path=tmp / "agents.log")
    yield from srv.running()


@pytest.fixture(scope="module")
def tool_server(models_dir, tmp_path_factory):
    """A template that takes tools (the vendored Qwen3.5-4B, its special tokens in the vocabulary),
    on a drafting MTP model: the chat layer's own grammar forces the calls."""
    model = make_tiny_mtp_model(models_dir / "agents-qwen.gguf", vocab="chat-qwen", seed=7)
    srv = Server(model, "--spec-type", "draft-mtp", "-c", "4096", "--chat-template-file", str(QWEN_TEMPLATE),
                 "--temp", "0", "-a", "qwen", log_path=tmp_path_factory.mktemp("agents-tools") / "tools.log")
    yield from srv.running()


@pytest.fixture(scope="module")
def oai(server):
    return server.client()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0, timeout=60)


def _chat(oai, messages, **kw):
    out = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=N, temperature=0, **kw)
    return out.choices[0], out.usage


# --- OpenAI's Responses API ---------------------------------------------------------------------


def test_a_response_is_the_chat_completion_of_the_same_conversation(oai):
    choice, usage = _chat(oai, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
    r = oai.responses.create(model="tiny", instructions="be brief", input="hello", max_output_tokens=N,
                             temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == choice.message.content and [o.type for o in r.output] == ["message"]
    assert r.usage.input_tokens == usage.prompt_tokens and r.usage.output_tokens == usage.completion_tokens
    # the token budget ended it: incomplete, as OpenAI reports it
    assert choice.finish_reason == "length" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"


def test_input_items_become_the_same_messages(oai):
    """A conversation given as items (an earlier call and its output, reasoning, an assistant
    message) prompts exactly as the chat messages they stand for."""
    items = [{"role": "developer", "content": "answer briefly"},
             {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "ask the tool"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
             {"role": "user", "content": "thanks"}]
    messages = [{"role": "system", "content": "answer briefly"}, {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "reasoning_content": "ask the tool",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "thanks"}]
    choice, usage = _chat(oai, messages)
    r = oai.responses.create(model="tiny", input=items, max_output_tokens=N, temperature=0)
    assert r.output_text == choice.message.content and r.usage.input_tokens == usage.prompt_tokens


def test_a_streamed_response_builds_the_same_response_in_openais_events(oai):
    whole = oai.responses.create(model="tiny", input="hello", max_output_tokens=N, temperature=0)
    with oai.responses.stream(model="tiny", input="hello", max_output_tokens=N, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.output_item.done"} <= set(kinds)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.id == events[0].response.id


def test_a_forced_function_call_is_a_function_call_item_streamed_or_not(tool_server):
    oai = tool_server.client()
    kw = dict(model="qwen", input="Is it hot in Paris?", tools=[RESPONSES_TOOL], max_output_tokens=96,
              tool_choice={"type": "function", "name": "get_weather"}, reasoning={"effort": "none"},
              extra_body=STEER)
    r = oai.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    assert json.loads(calls[0].arguments) in ({"hot": True}, {"hot": False})
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = [o for o in final.output if o.type == "function_call"]
    assert len(streamed) == 1 and streamed[0].arguments == calls[0].arguments and streamed[0].name == "get_weather"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert pieces and "".join(pieces) == calls[0].arguments
    # the next turn sends the call and its output back, as an agent loop does
    follow = oai.responses.create(model="qwen", max_output_tokens=N, tools=[RESPONSES_TOOL], reasoning={"effort": "none"},
                                  input=[{"role": "user", "content": "Is it hot in Paris?"},
                                         {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                                          "arguments": calls[0].arguments},
                                         {"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": "yes"}])
    assert follow.output and follow.usage.input_tokens > r.usage.input_tokens


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
    ({"input": [{"type": "nonsense"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0]"),
    ({}, "input"),
])
def test_bad_responses_requests_are_400s_in_openais_shape(server, body, param):
    status, res = server.json("POST", "/v1/responses", dict(body, model="tiny"))
    assert status == 400 and set(res) == {"error"} and res["error"]["param"] == param, res


# --- Anthropic's Messages API -------------------------------------------------------------------


def test_a_message_is_the_chat_completion_of_the_same_conversation(oai, claude):
    choice, usage = _chat(oai, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
    m = claude.messages.create(model="tiny", max_tokens=N, system=[{"type": "text", "text": "be brief"}],
                               messages=[{"role": "user", "content": "hello"}])
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == choice.message.content
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == usage.completion_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage.prompt_tokens


def test_a_stop_sequence_is_reported_as_anthropic_reports_it(claude):
    messages = [{"role": "user", "content": "count"}]
    text = claude.messages.create(model="tiny", max_tokens=N, messages=messages).content[0].text
    stop = text[3:5]
    assert stop.strip() and stop not in text[:3]
    m = claude.messages.create(model="tiny", max_tokens=N, messages=messages, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop and m.content[0].text == text[:3]


def test_a_streamed_message_builds_the_same_message_in_anthropics_events(claude):
    kw = dict(model="tiny", max_tokens=N, messages=[{"role": "user", "content": "hello"}])
    whole = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type not in ("text", "input_json")]  # the helper's own events
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and "content_block_stop" in kinds
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_forced_tool_is_a_tool_use_block_and_its_result_goes_back(tool_server):
    claude = anthropic.Anthropic(base_url=tool_server.base, api_key="none", max_retries=0, timeout=60)
    kw = dict(model="qwen", max_tokens=96, tools=[ANTHROPIC_TOOL], thinking={"type": "disabled"},
              tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
              messages=[{"role": "user", "content": "Is it hot in Paris?"}], extra_body=STEER)
    m = claude.messages.create(**kw)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather", m
    assert uses[0].input in ({"hot": True}, {"hot": False}) and uses[0].id
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].type == "tool_use"
    assert final.content[-1].input == uses[0].input and final.content[-1].id
    follow = claude.messages.create(model="qwen", max_tokens=N, tools=[ANTHROPIC_TOOL], messages=[
        {"role": "user", "content": "Is it hot in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "ask the tool", "signature": ""},
                                          {"type": "tool_use", "id": uses[0].id, "name": "get_weather",
                                           "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "yes"}]}])
    assert follow.content and follow.usage.input_tokens + follow.usage.cache_read_input_tokens > \
        m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_count_tokens_counts_the_prompt_a_message_runs(oai, claude):
    messages = [{"role": "user", "content": "hello there"}]
    n = claude.messages.count_tokens(model="tiny", system="be brief", messages=messages).input_tokens
    _, usage = _chat(oai, [{"role": "system", "content": "be brief"}] + messages)
    assert n == usage.prompt_tokens


def test_an_empty_messages_list_is_answered_as_llama_server_answers_it(oai, claude, server):
    """llama-server takes ``messages: []`` (the system prompt, if any, and the template's
    generation prompt make the prompt): a message, as the chat completion of the same (empty)
    conversation; without ``messages`` it is a 400."""
    m = claude.messages.create(model="tiny", max_tokens=N, system="be brief", messages=[])
    choice, usage = _chat(oai, [{"role": "system", "content": "be brief"}])
    assert m.type == "message" and m.role == "assistant" and m.content[0].text == choice.message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage.prompt_tokens
    assert claude.messages.count_tokens(model="tiny", messages=[]).input_tokens > 0
    status, body = server.json("POST", "/v1/messages", {"model": "tiny", "max_tokens": N})
    assert status == 400 and body["type"] == "error" and "'messages' is required" in body["error"]["message"]


def test_output_config_s_format_is_structured_output_and_its_effort_the_chat_s(oai, claude, server):
    """The 2026 clients' ``output_config``: ``format`` a JSON schema the answer's text follows (the
    chat layer's grammar, as the chat route's ``response_format``), ``effort`` the chat's
    ``reasoning_effort``; the clients' other new fields (``cache_control``, ...) are taken."""
    schema = {"type": "object", "properties": {"hot": {"type": "boolean"}}, "required": ["hot"],
              "additionalProperties": False}
    m = claude.messages.create(model="tiny", max_tokens=32, messages=[{"role": "user", "content": "hot?"}],
                               output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
                               cache_control={"type": "ephemeral"})
    text = m.content[0].text
    assert isinstance(json.loads(text)["hot"], bool), text
    same = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hot?"}], max_tokens=32,
                                       temperature=0, reasoning_effort="low", response_format={
                                           "type": "json_schema", "json_schema": {"name": "output", "schema": schema}})
    assert same.choices[0].message.content == text
    for bad in ({"format": {"type": "xml"}}, {"effort": 3}, "high"):
        status, body = server.json("POST", "/v1/messages", {"model": "tiny", "max_tokens": 4, "output_config": bad,
                                                            "messages": [{"role": "user", "content": "x"}]})
        assert status == 400 and body["type"] == "error" and "output_config" in body["error"]["message"]


@pytest.mark.parametrize("body", [
    {"max_tokens": 4, "messages": "hello"},
    {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    {"max_tokens": 4, "messages": [{"role": "robot", "content": "x"}]},
    {"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
    {"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "extra_body": {"frobnicate": True}},
])
def test_bad_messages_are_400s_in_anthropics_shape(claude, server, body):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny", **body)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert server.json("GET", "/health")[0] == 200


def test_a_missing_key_is_anthropics_authentication_error(models_dir, tmp_path):
    model = make_tiny_model(models_dir / "agents-chars.gguf", seed=52, vocab="chars")
    srv = Server(model, "--chat-template", "chatml", "-c", "256", log_path=tmp_path / "key.log", api_key="k")
    try:
        bad = anthropic.Anthropic(base_url=srv.base, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
        assert e.value.body["error"]["type"] == "authentication_error"
        good = anthropic.Anthropic(base_url=srv.base, api_key="k", max_retries=0)  # X-Api-Key, as Anthropic sends it
        assert good.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}]).content
        ok = openai.OpenAI(base_url=srv.base + "/v1", api_key="k", max_retries=0)
        assert ok.responses.create(model="tiny", input="x", max_output_tokens=2).output
    finally:
        srv.kill()


def test_the_answers_are_json_a_client_without_sdk_reads(server):
    """The raw events: Anthropic's and OpenAI's typed SSE, ``event:`` then ``data:``."""
    status, hdrs, data = server.request("POST", "/v1/messages", {"model": "tiny", "max_tokens": 3, "stream": True,
                                                                "messages": [{"role": "user", "content": "x"}]})
    assert status == 200 and hdrs["content-type"].startswith("text/event-stream")
    blocks = [b for b in data.decode().split("\n\n") if b.strip()]
    for block in blocks:
        event, payload = block.split("\n", 1)
        assert event.startswith("event: ") and payload.startswith("data: ")
        assert json.loads(payload[len("data: "):])["type"] == event[len("event: "):]
