"""``/v1/chat/completions`` and ``/apply-template`` on llama.cpp's chat layer: a server on a tiny MTP
model (drafting on) with the vendored Qwen3.5-4B template (``--chat-template-file``, read from the
patched tree), its vocabulary holding the family's special tokens. The official ``openai`` client
round-trips tool calls in a two-turn agent loop; a last assistant message is continued (llama-server's
prefill_assistant, continue_final_message); a custom grammar beside tools, a template that refuses
the messages, bad tools, a huge schema and a continuation llama-server refuses each get a 400, and
the server goes on."""

import json

import openai
import pytest

from llama_metaws.native.runtime import require_build
from llama_metaws_dev.testing import EOS_TOKEN, N_VOCAB, make_tiny_model, make_tiny_mtp_model
from llama_metaws.demo.vocab import chat_vocab
from llama_metaws_dev.testing.chat_tools import WEATHER
from serving import Server, error_of

TEMPLATE = require_build().src_dir / "models" / "templates" / "Qwen3.5-4B.jinja"
ASK = [{"role": "user", "content": "Weather in Paris?"}]
TOKENS = {t: i for i, t in enumerate(chat_vocab("qwen", N_VOCAB)[0])}
# a tiny model's random text would not begin a call by itself: a bias toward <tool_call> (the
# chat layer's grammar allows it where a call may begin), the end of generation favoured above
# it once allowed (the model's EOS; the family's other end tokens ruled out)
STEER = {"chat_template_kwargs": {"enable_thinking": False},
         "logit_bias": {str(TOKENS["<tool_call>"]): 50, str(EOS_TOKEN): 100, str(TOKENS["<|im_end|>"]): -100,
                        str(TOKENS["<|endoftext|>"]): -100}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
CALLED = {"role": "assistant", "content": "", "reasoning_content": "I will look",
          "tool_calls": [{"id": "c1", "type": "function", "function": {
              "name": "get_weather", "arguments": "{\"hot\": true}"}}]}
PREFILLED = ASK + [{"role": "assistant", "content": "Paris is"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
FORCED = ("thinking it over\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=hot>\ntrue\n"
          "</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def model(models_dir):
    return make_tiny_mtp_model(models_dir / "server-chat-qwen.gguf", vocab="chat-qwen", seed=7)


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = Server(model, "--spec-type", "draft-mtp", "-c", "4096", "--chat-template-file", str(TEMPLATE),
                 "-a", "qwen", log_path=tmp_path_factory.mktemp("srv") / "chat.log")
    yield from srv.running()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_the_issue_s_forced_answer_is_parsed_into_reasoning_and_a_tool_call(server):
    """The request of the issue: a get_weather tool and a grammar forcing a thinking answer with
    a call, here as llama-server takes it (a grammar beside tools is refused, so the chat
    layer's parser is shown on the same text without tools: the call stays content there,
    and tool_choice "required" gets it through the layer's own grammar, below)."""
    status, _, body = server.request("POST", "/v1/chat/completions", {
        "messages": ASK, "tools": [WEATHER], "grammar": "root ::= " + json.dumps(FORCED), "max_tokens": 96})
    assert status == 400 and b"Cannot use custom grammar constraints with tools" in body
    status, _, body = server.request("POST", "/v1/chat/completions", {
        "messages": ASK, "grammar": "root ::= " + json.dumps("thinking it over\n</think>\n\nParis is sunny."),
        "max_tokens": 96, "temperature": 0})
    assert status == 200, body
    res = json.loads(body)
    msg = res["choices"][0]["message"]
    assert (msg["reasoning_content"].strip(), msg["content"].strip()) == ("thinking it over", "Paris is sunny.")
    assert res["choices"][0]["finish_reason"] == "stop"


def test_tool_choice_required_gives_tool_calls_and_finish_reason_tool_calls(client):
    res = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], tool_choice="required",
                                         temperature=0, max_tokens=96, extra_body=STEER)
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) in ({"hot": True}, {"hot": False})
    # streamed: the id and the name once, the arguments in pieces, the same message
    chunks = list(client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER],
                                                 tool_choice="required", temperature=0, max_tokens=96,
                                                 stream=True, extra_body=STEER))
    assert chunks[0].choices[0].delta.role == "assistant"
    ids, names, args = [], [], ""
    for c in chunks:
        for tc in c.choices[0].delta.tool_calls or []:
            assert tc.index == 0
            ids += [tc.id] if tc.id else []
            names += [tc.function.name] if tc.function and tc.function.name else []
            args += tc.function.arguments or "" if tc.function else ""
    assert len(ids) == 1 and names == ["get_weather"] and args == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_two_turn_agent_loop_with_the_openai_client(client):
    """Turn 1 calls the tool; its result goes back with the call (and the reasoning) and turn 2
    answers; the second turn's prompt holds both, as /apply-template shows."""
    messages = list(ASK)
    first = client.chat.completions.create(model="qwen", messages=messages, tools=[WEATHER],
                                           tool_choice="required", temperature=0, max_tokens=96,
                                           extra_body=STEER)
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
    second = client.chat.completions.create(model="qwen", messages=messages, tools=[WEATHER], temperature=0,
                                            max_tokens=8, extra_body=NO_THINKING)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_apply_template_shows_the_prompt_with_the_call_and_its_result(server):
    messages = ASK + [CALLED, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    status, _, body = server.request("POST", "/apply-template", {"messages": messages, "tools": [WEATHER]})
    assert status == 200, body
    prompt = json.loads(body)["prompt"]
    assert "<function=get_weather>\n<parameter=hot>\nTrue" in prompt  # the template writes Jinja's True
    assert "<tool_response>\nsunny\n</tool_response>" in prompt and "I will look" in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")


def test_a_last_assistant_message_is_continued_as_llama_server_prefills_it(server, client):
    """llama-server's prefill_assistant (on by default) and a request's continue_final_message:
    the prompt ends with the message's text (the thinking closed, no new turn), as /apply-template
    and the __verbose prompt that ran show; the answer's content begins with that text, which a
    stream's deltas leave out only where the request asked for continue_final_message."""
    for extra in ({}, CONTINUE):
        status, _, raw = server.request("POST", "/apply-template", dict(messages=PREFILLED, **extra))
        assert status == 200 and json.loads(raw)["prompt"].endswith(
            "Weather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nParis is"), raw
    status, _, raw = server.request("POST", "/v1/chat/completions", {"messages": PREFILLED, "max_tokens": 2,
                                                                    "verbose": True})
    assert status == 200 and json.loads(raw)["__verbose"]["prompt"].endswith("</think>\n\nParis is"), raw
    req = dict(model="qwen", messages=PREFILLED, temperature=0, max_tokens=8)
    whole = client.chat.completions.create(**req, extra_body=CONTINUE).choices[0].message.content
    assert whole.startswith("Paris is") and whole != "Paris is", whole
    for extra, shown in (({}, whole), (CONTINUE, whole[len("Paris is"):])):
        chunks = client.chat.completions.create(**req, stream=True, extra_body=extra)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == shown
    with pytest.raises(openai.BadRequestError) as e:  # add_generation_prompt stays true (its default)
        client.chat.completions.create(**req, extra_body={"continue_final_message": True})
    err = error_of(e)
    assert "Cannot set both add_generation_prompt and continue_final_message" in err["message"]
    assert err["param"] == "continue_final_message"


def test_no_prefill_assistant_renders_a_last_assistant_message_whole(models_dir, tmp_path):
    """--no-prefill-assistant: a last assistant message is a whole turn and a new one is asked for
    (two at the end are taken then); continue_final_message still continues it."""
    model = make_tiny_model(models_dir / "server-chat-chars.gguf", seed=3, vocab="chars")
    srv = Server(model, "--chat-template", "chatml", "-c", "256", "--no-prefill-assistant",
                 log_path=tmp_path / "no-prefill.log")
    try:
        status, out = srv.json("POST", "/apply-template", {"messages": PREFILLED})
        assert status == 200 and out["prompt"].endswith("assistant\nParis is<|im_end|>\n<|im_start|>assistant\n")
        status, out = srv.json("POST", "/apply-template", dict(messages=PREFILLED, **CONTINUE))
        assert status == 200 and out["prompt"].endswith("<|im_start|>assistant\nParis is"), out
        status, out = srv.json("POST", "/v1/chat/completions", {
            "messages": PREFILLED + [{"role": "assistant", "content": "sunny"}], "max_tokens": 2})
        assert status == 200, out
    finally:
        srv.kill()


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),             # the template raises
    ({"messages": ASK, "tools": [{"type": "function"}]}, "tools"),              # no function in a tool
    ({"messages": ASK, "tools": "get_weather"}, "tools"),
    ({"messages": ASK, "tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
    ({"messages": ASK, "reasoning_format": "loud"}, "reasoning_format"),
    ({"messages": ASK, "chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs"),
    ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^[a-z]{1,3}$"} for i in range(3000)},
        "required": [f"p{i}" for i in range(3000)]}}}}, "response_format"),   # a huge schema
    # llama-server's refusals of a continued message
    ({"messages": PREFILLED + [{"role": "assistant", "content": "sunny"}]}, "messages"),  # two at the end
    ({"messages": ASK + [CALLED]}, "messages"),                                 # a message with tool calls
])
def test_what_the_chat_layer_refuses_is_a_400_and_the_server_goes_on(server, client, body, param):
    status, _, raw = server.request("POST", "/v1/chat/completions", dict(body, max_tokens=4))
    assert status == 400, raw
    err = json.loads(raw)["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    res = client.chat.completions.create(model="qwen", messages=ASK, max_tokens=4, extra_body=NO_THINKING)
    assert res.choices[0].finish_reason in ("stop", "length")


def test_the_server_and_llama_give_the_same_message(model, client):
    from llama_metaws import Llama

    req = dict(messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=96)
    served = client.chat.completions.create(model="qwen", extra_body=STEER, **req)
    with Llama(str(model), n_ctx=4096, verbose=False, chat_template=TEMPLATE.read_text(), draft="mtp") as llm:
        direct = llm.create_chat_completion(**req, chat_template_kwargs=STEER["chat_template_kwargs"],
                                            logit_bias={int(k): v for k, v in STEER["logit_bias"].items()})
    s, d = served.choices[0], direct["choices"][0]
    assert s.finish_reason == d["finish_reason"] == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in s.message.tool_calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in d["message"]["tool_calls"]]
    assert (s.message.content or "") == d["message"]["content"]


def test_openai_s_older_functions_are_tools_to_the_layer(server):
    """``functions`` / ``function_call`` (OpenAI's older form) render and force as tools do."""
    fn = WEATHER["function"]
    body = {"messages": ASK, "functions": [fn], "function_call": {"name": "get_weather"}}
    status, _, raw = server.request("POST", "/apply-template", body)
    assert status == 200 and "get_weather" in json.loads(raw)["prompt"]
    status, _, raw = server.request("POST", "/v1/chat/completions", dict(body, max_tokens=96, temperature=0, **STEER))
    assert status == 200, raw
    res = json.loads(raw)
    assert res["choices"][0]["finish_reason"] == "tool_calls"
    assert res["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_a_reasoning_budget_per_request_ends_the_thinking(server):
    status, _, raw = server.request("POST", "/v1/chat/completions", {
        "messages": ASK, "max_tokens": 16, "temperature": 0, "reasoning_budget_tokens": 0,
        "reasoning_budget_message": "Done."})
    assert status == 200, raw
    msg = json.loads(raw)["choices"][0]["message"]
    # forced at once: the message, then </think>; llama.cpp's budget sampler, fed the generation
    # prompt first (as llama-server feeds it), counts its newline and is one token into the message
    thought = msg.get("reasoning_content", "").strip()
    assert thought and "Done.".endswith(thought), thought
    status, _, raw = server.request("POST", "/v1/chat/completions", {"messages": ASK, "reasoning_budget_tokens": -5})
    assert status == 400 and json.loads(raw)["error"]["param"] == "reasoning_budget_tokens"


def test_an_assistant_turn_sent_back_as_the_client_returned_it(client, server):
    """OpenAI's agent loop appends the returned message object itself: the client sends its
    ``content: null`` beside the tool calls (and OpenAI's ``developer`` role, which llama.cpp's
    chat layer reads as ``system``); both are a turn llama-server takes."""
    first = client.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=96, extra_body=STEER)
    # as OpenAI answers a call (content null; this server answers "", as llama-server), every
    # field of the client's message object sent back, its nulls included
    turn = first.choices[0].message.model_copy(update={"content": None})
    assert turn.tool_calls and "function_call" in turn.model_dump()
    messages = [{"role": "developer", "content": "Answer in one word."}, *ASK, turn,
                {"role": "tool", "tool_call_id": turn.tool_calls[0].id, "content": "sunny"}]
    second = client.chat.completions.create(model="qwen", messages=messages, tools=[WEATHER], temperature=0,
                                            max_tokens=4, extra_body=NO_THINKING)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    status, _, body = server.request("POST", "/apply-template", {"messages": [
        {"role": "developer", "content": "Answer in one word."}, *ASK,
        {"role": "assistant", "content": None, "tool_calls": CALLED["tool_calls"]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], "tools": [WEATHER]})
    assert status == 200, body
    prompt = json.loads(body)["prompt"]
    assert prompt.startswith("<|im_start|>system\n") and "Answer in one word." in prompt
    assert "<function=get_weather>" in prompt


@pytest.mark.parametrize("messages,words", [
    ([{"role": "user"}], "All non-assistant messages must contain 'content'"),
    ([{"role": "assistant"}], "Assistant message must contain either 'content' or 'tool_calls'"),
    ([{"role": 7, "content": "x"}], "messages[0].role: a string is expected"),
    ([{"role": "user", "content": 7}], "Expected 'content' to be a string or an array"),
    (["hello"], "messages[0]: an object is expected"),
])
def test_malformed_messages_are_a_400_in_llama_server_s_words(server, messages, words):
    status, _, body = server.request("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert status == 400, body
    assert words in json.loads(body)["error"]["message"]


CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("max_tokens", [12, 40])
def test_a_call_the_token_budget_cuts_is_read_as_far_as_it_goes(client, max_tokens):
    """A forced call cut by max_tokens halfway (a string argument the random model goes on
    writing): finish_reason "length" and the message parsed as far as it goes (a stream's
    partial parse), not an error after the tokens were spent."""
    kw = dict(model="qwen", messages=ASK, tools=[CITY], tool_choice="required", temperature=0,
              max_tokens=max_tokens, extra_body={"logit_bias": STEER["logit_bias"]})  # thinking on
    res = client.chat.completions.create(**kw)
    assert res.choices[0].finish_reason == "length" and res.usage.completion_tokens == max_tokens
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[-1].choices[0].finish_reason == "length"
    names = [tc.function.name for c in chunks for tc in c.choices[0].delta.tool_calls or []
             if tc.function and tc.function.name]
    assert names == [tc.function.name for tc in res.choices[0].message.tool_calls or []]
