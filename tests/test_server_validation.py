"""The request bodies' pydantic models (llama_metaws.server.validation), without a server: what
each refuses, the field its 400 names, and what reaches the Llama call.

The routes' answers to the same bodies are checked against a running server in test_server.py,
test_server_llama_shapes.py and test_server_agents.py; here each refusal is traced to its field.
"""

from __future__ import annotations

import inspect

import pytest

from llama_metaws.server import validation as v
from llama_metaws.server.errors import ANTHROPIC, LLAMA, OPENAI, RequestError


class Server:
    """What the models read of the server: its slots and its vocabulary."""

    n_slots = 2
    n_vocab = 100


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def refusal(model_type, body) -> RequestError:
    with pytest.raises(RequestError) as exc:
        v.validated(model_type, body, Server)
    assert exc.value.status == 400
    return exc.value


@pytest.mark.parametrize("model_type, body, param, code, words", [
    (v.CompletionBody, {"prompt": "a", "temperature": "hot"}, "temperature", "invalid_value", "valid number"),
    (v.CompletionBody, {"prompt": "a", "max_tokens": 0}, "max_tokens", "invalid_value", "at least 1"),
    (v.CompletionBody, {"prompt": "a", "n": 17}, "n", "invalid_value", "from 1 to 16"),
    (v.CompletionBody, {"prompt": "a", "n": True}, "n", "invalid_value", "valid integer"),
    (v.CompletionBody, {"prompt": "a", "best_of": 3}, "best_of", "unsupported_value", "best_of=3 is not supported"),
    (v.CompletionBody, {"prompt": ["a", "b"]}, "prompt", "unsupported_value", "2 prompts in one request"),
    (v.CompletionBody, {"prompt": ""}, "prompt", "invalid_value", "the prompt is empty"),
    (v.CompletionBody, {}, "prompt", "invalid_value", "the prompt is empty"),
    (v.CompletionBody, {"prompt": [1, 100]}, "prompt", "invalid_value", "token 100 is outside the vocabulary"),
    (v.CompletionBody, {"prompt": "a", "id_slot": 2}, "id_slot", "invalid_value", "slots 0 to 1"),
    (v.CompletionBody, {"prompt": "a", "n_predict": -2}, "n_predict", "invalid_value", "-1 (up to the context)"),
    (v.CompletionBody, {"prompt": "a", "cache_prompt": "no"}, "cache_prompt", "invalid_value", "valid boolean"),
    (v.CompletionBody, {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options",
     "invalid_value", "only allowed with 'stream': true"),
    (v.CompletionBody, {"prompt": "a", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options",
     "invalid_value", "include_usage"),
    (v.ChatBody, {}, "messages", "invalid_value", "'messages' is required"),
    (v.ChatBody, {"messages": "hello"}, "messages", "invalid_value", "Expected 'messages' to be an array"),
    (v.ChatBody, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages",
     "unsupported_content", "text parts only"),
    (v.ChatBody, dict(CHAT, max_completion_tokens=-1), "max_completion_tokens", "invalid_value", "at least 1"),
    (v.ChatBody, dict(CHAT, max_completion_tokens=3, max_tokens=4), "max_completion_tokens", "invalid_value",
     "differ"),
    (v.ChatBody, dict(CHAT, timings_per_token="yes"), "timings_per_token", "invalid_value", "valid boolean"),
    (v.ChatBody, dict(CHAT, web_search_options={}), "web_search_options", "unsupported_parameter",
     "unsupported parameter: 'web_search_options'"),
    (v.LlamaCompletionBody, {"dry_multiplier": 1.5}, "dry_multiplier", "unsupported_parameter", "not implemented"),
    (v.LlamaCompletionBody, {"temperature": True}, "temperature", "invalid_value", "valid number"),
    (v.LlamaCompletionBody, {"max_tokens": -2}, "max_tokens", "invalid_value", "-1 (up to the context)"),
    (v.LlamaCompletionBody, {"n_probs": -1}, "n_probs", "invalid_value", ">= 0"),
    (v.LlamaCompletionBody, {"id_slot": 7}, "id_slot", "invalid_value", "slots 0 to 1"),
    (v.LlamaCompletionBody, {"grammar": "root ::= \"a\"", "json_schema": {}}, "grammar", "invalid_value",
     "send one"),
    (v.LlamaCompletionBody, {"response_fields": "content"}, "response_fields", "invalid_value", "valid list"),
    (v.MessagesBody, {"messages": 5}, "messages", "invalid_value", "Expected 'messages' to be an array"),
])
def test_a_refusal_names_its_field_in_one_message(model_type, body, param, code, words):
    error = refusal(model_type, body)
    assert (error.param, error.code) == (param, code), error.message
    assert words in error.message and param in error.message, error.message


def test_every_unknown_field_is_named_and_the_first_is_the_param():
    error = refusal(v.CompletionBody, {"prompt": "a", "zeta": 1, "frobnicate": 2, "temperature": "hot"})
    assert error.code == "unsupported_parameter" and error.param == "frobnicate"
    assert error.message == ("unsupported parameter: 'frobnicate' (this server does not implement it); "
                             "also unsupported: 'zeta'")


def test_llama_servers_completion_ignores_fields_it_does_not_know():
    req = v.validated(v.LlamaCompletionBody, {"frobnicate": 1, "top_k": 40.0, "samplers": ["top_k"]}, Server)
    assert req.top_k == 40.0 and not hasattr(req, "frobnicate")


@pytest.mark.parametrize("dialect, shape", [
    (OPENAI, lambda b: b["error"]["param"] == "temperature" and b["error"]["code"] == "invalid_value"),
    (LLAMA, lambda b: b["error"]["code"] == 400 and b["error"]["type"] == "invalid_request_error"),
    (ANTHROPIC, lambda b: b["type"] == "error" and b["error"]["type"] == "invalid_request_error"),
])
def test_a_refusal_answers_in_each_apis_shape(dialect, shape):
    body = refusal(v.ChatBody, dict(CHAT, temperature="hot")).body(dialect)
    assert shape(body), body
    message = body["error"]["message"]
    assert message.startswith("invalid 'temperature': Input should be a valid number"), message


def test_n_predict_is_max_tokens_where_that_is_absent():
    assert v.validated(v.CompletionBody, {"prompt": "a", "n_predict": 5}, Server).max_tokens == 5
    assert v.validated(v.CompletionBody, {"prompt": "a", "n_predict": -1}, Server).max_tokens is None
    assert v.validated(v.CompletionBody, {"prompt": "a", "n_predict": 5, "max_tokens": 3}, Server).max_tokens == 3
    assert v.validated(v.ChatBody, dict(CHAT, max_completion_tokens=7), Server).max_tokens == 7


def test_the_servers_n_predict_holds_where_the_request_says_minus_one():
    """llama-server: ``n_predict_max = request's n_predict != -1 ? it : -n``."""
    class Started(Server):
        n_predict = 6
        temperature = None
        seed = -1

    for body in ({"prompt": "a"}, {"prompt": "a", "n_predict": -1}):
        assert v.validated(v.CompletionBody, v._defaults(Started, body, "max_tokens"), Started).max_tokens == 6
    assert v.validated(v.CompletionBody, v._defaults(Started, {"prompt": "a", "n_predict": 9}, "max_tokens"),
                       Started).max_tokens == 9
    assert v.validated(v.CompletionBody, v._defaults(Started, {"prompt": "a", "max_tokens": 2}, "max_tokens"),
                       Started).max_tokens == 2


def test_a_token_array_prompt_and_a_list_of_one_prompt():
    assert v.validated(v.CompletionBody, {"prompt": [1, 2, 99]}, Server).prompt == [1, 2, 99]
    assert v.validated(v.CompletionBody, {"prompt": ["one"]}, Server).prompt == "one"


def test_only_the_llama_calls_keywords_reach_them():
    """Our fields (llama-server's, OpenAI's extras) are read into the plan, never passed on to the
    binding's calls, which ``Llama`` runs."""
    from llama_metaws.native.binding import llama_cpp

    Llama = llama_cpp.Llama
    extras = {"cache_prompt": False, "timings_per_token": True, "id_slot": 1, "verbose": True, "n_predict": 3,
              "store": True, "metadata": {"a": "b"}, "service_tier": "auto", "stream": True,
              "stream_options": {"include_usage": True}}
    completion = v.validated(v.CompletionBody, dict(extras, prompt="a"), Server)
    taken = set(inspect.signature(Llama.create_completion).parameters)
    assert set(completion.kwargs()) <= taken, set(completion.kwargs()) - taken
    chat = v.validated(v.ChatBody, dict(CHAT, **extras, reasoning_format="auto", parallel_tool_calls=False), Server)
    kwargs = chat.kwargs(exclude=set(v._chat.CHAT_FIELDS) | {"messages", "functions", "function_call"})
    taken = set(inspect.signature(Llama.create_chat_completion).parameters)
    assert set(kwargs) <= taken, set(kwargs) - taken
    assert (chat.id_slot, chat.cache_prompt, chat.include_usage, chat.max_tokens) == (1, False, True, 3)


MESSAGES = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("body, param, words", [
    ({"max_tokens": 4}, "messages", "'messages' is required"),
    ({"messages": "hello"}, "messages", "a list is expected"),
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens", "an integer >= 1"),
    ({"messages": MESSAGES, "frobnicate": 1}, "frobnicate", "unsupported parameter: 'frobnicate'"),
    ({"messages": MESSAGES, "output_config": "high"}, "output_config", "should be an object"),
    ({"messages": MESSAGES, "output_config": {"format": {"type": "xml"}}}, "output_config", "'json_schema'"),
    ({"messages": MESSAGES, "tools": [{"description": "x"}]}, "tools", "'tools[0].name' is required"),
    ({"messages": MESSAGES, "tools": [{"name": "f"}], "tool_choice": {"type": "tool"}}, "tool_choice",
     "needs the tool's 'name'"),
    ({"messages": MESSAGES, "stop_sequences": "a"}, "stop_sequences", "valid list"),
])
def test_anthropics_fields_are_refused_by_name(body, param, words):
    from llama_metaws.server.anthropic_api import to_chat

    with pytest.raises(RequestError) as exc:
        to_chat(body)
    assert exc.value.param == param and words in exc.value.message, exc.value.message
    assert exc.value.body(ANTHROPIC)["error"]["type"] == "invalid_request_error"


def test_anthropics_request_becomes_the_chat_request():
    from llama_metaws.server.anthropic_api import to_chat

    chat = to_chat({"messages": MESSAGES, "stream": True, "thinking": {"type": "enabled", "budget_tokens": 5},
                    "tools": [{"name": "f", "input_schema": {"type": "object"}}, {"name": "w", "type": "web_search"}],
                    "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
                    "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}, "effort": "low"}})
    assert chat["max_tokens"] == 4096 and chat["stream_options"] == {"include_usage": True}
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["parallel_tool_calls"] is False and chat["reasoning_effort"] == "low"
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert chat["chat_template_kwargs"] == {"enable_thinking": True} and chat["thinking_budget_tokens"] == 5


@pytest.mark.parametrize("body, param, code, words", [
    ({}, "input", "invalid_value", "'input' is required"),
    ({"input": []}, "input", "invalid_value", "non-empty list"),
    ({"input": "x", "conversation": "c1"}, "conversation", "unsupported_parameter", "stores no responses"),
    ({"input": "x", "tool_choice": 5}, "tool_choice", "invalid_value", "must be auto, none, required"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "invalid_value", "no function tools"),
    ({"input": "x", "instructions": 3}, "instructions", "invalid_value", "valid string"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "invalid_value", "at least 1"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text", "invalid_value", "'text.format.type'"),
])
def test_responses_fields_are_refused_by_name(body, param, code, words):
    from llama_metaws.server.responses_api import to_chat

    with pytest.raises(RequestError) as exc:
        to_chat(body)
    assert (exc.value.param, exc.value.code) == (param, code) and words in exc.value.message, exc.value.message


def test_a_responses_request_becomes_the_chat_request():
    from llama_metaws.server.responses_api import to_chat

    chat = to_chat({"input": "x", "instructions": "be brief", "store": False, "chat_template_kwargs": {"a": 1},
                    "tools": [{"type": "function", "name": "f"}, {"type": "web_search"}],
                    "tool_choice": {"type": "function", "name": "f"}, "max_output_tokens": 9,
                    "text": {"format": {"type": "json_schema", "schema": {"type": "object"}, "strict": True}}})
    assert chat["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]
    assert [t["function"]["name"] for t in chat["tools"]] == ["f"] and chat["max_tokens"] == 9
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"]["json_schema"] == {"name": "response", "schema": {"type": "object"}, "strict": True}
    assert chat["chat_template_kwargs"] == {"a": 1} and "store" not in chat
