"""OpenAI's clients against ``llama-metaws serve``: what they send, what they read (the official
``openai`` client throughout).

One server: the seed's configuration (MTP drafting, tensor split over CPU,CPU, the workspace) on a
tiny model whose vocabulary has characters, so JSON, schemas and tool calls can be generated.
"""

import json

import openai
import pytest

from llama_metaws_dev.testing import make_tiny_mtp_model
from serving import Server, error_of

CHAT = [{"role": "user", "content": "give me a number"}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def server(models_dir, tmp_path_factory):
    model = make_tiny_mtp_model(models_dir / "openai-chars.gguf", seed=51, agreement=0.8, vocab="chars")
    srv = Server(model, "--device", "CPU,CPU", "-sm", "tensor", "--spec-type", "draft-mtp",
                 "--phase-aware-workspace", "-c", "512", "-b", "64", "-ub", "64", "-a", "tiny-chars",
                 log_path=tmp_path_factory.mktemp("srv") / "openai.log")
    yield from srv.running()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _chat(client, **kw):
    kw.setdefault("max_tokens", 16)
    kw.setdefault("messages", CHAT)
    return client.chat.completions.create(model="gpt-4o-mini", temperature=0, **kw)


def test_stream_options_include_usage_ends_with_a_usage_chunk_without_choices(client):
    plain = _chat(client)
    chunks = list(_chat(client, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == plain.usage.prompt_tokens
    assert last.usage.completion_tokens == plain.usage.completion_tokens == 16  # a length stop
    assert last.usage.total_tokens == last.usage.prompt_tokens + 16
    assert last.usage.prompt_tokens_details.cached_tokens >= 0
    assert all(c.choices for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text.strip() == plain.choices[0].message.content.strip()  # the binding strips one, not the other
    # without the option, no usage chunk
    assert all(c.choices for c in _chat(client, stream=True))
    # completions too
    chunks = list(client.completions.create(model="x", prompt="once upon", max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_openais_other_fields_are_accepted_and_change_nothing_here(client):
    plain = _chat(client).choices[0].message.content
    res = _chat(client, parallel_tool_calls=False, store=True, metadata={"who": "test"}, reasoning_effort="low",
                service_tier="auto", user="u1")
    assert res.choices[0].message.content == plain


def test_an_assistant_message_with_text_parts_is_its_texts_joined(client):
    parts = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
             {"role": "user", "content": [{"type": "text", "text": "and"}]}]
    joined = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "one\ntwo"},
              {"role": "user", "content": "and"}]
    a, b = _chat(client, messages=parts), _chat(client, messages=joined)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as exc:  # an image: no model here takes one
        _chat(client, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert error_of(exc)["code"] == "unsupported_content"


def test_json_schema_in_openais_shape_gives_json_that_follows_it(client):
    res = _chat(client, max_tokens=64, response_format={
        "type": "json_schema", "json_schema": {"name": "number", "schema": SCHEMA, "strict": True}})
    assert res.choices[0].finish_reason == "stop"
    value = json.loads(res.choices[0].message.content)
    assert set(value) == {"n"} and isinstance(value["n"], int)
    # json_object with a schema (the binding's shape) and without
    res = _chat(client, max_tokens=64, response_format={"type": "json_object", "schema": SCHEMA})
    assert set(json.loads(res.choices[0].message.content)) == {"n"}
    res = _chat(client, max_tokens=24, response_format={"type": "json_object"})
    assert res.choices[0].message.content.startswith("{")


def test_tools_on_a_template_without_them_are_left_out_as_llama_server_leaves_them(client):
    """This model's template renders no tools: llama.cpp's chat layer gives no grammar and no
    parser for them, so the answer is text, as llama-server answers (templates with tools:
    tests/test_chat_families.py, tests/test_server_chat.py). A named tool must still exist."""
    tools = [{"type": "function", "function": {"name": "pick", "description": "pick a number",
                                               "parameters": SCHEMA}}]
    res = _chat(client, max_tokens=8, tools=tools, tool_choice={"type": "function", "function": {"name": "pick"}})
    plain = _chat(client, max_tokens=8)
    assert res.choices[0].message.tool_calls is None
    assert res.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(client, tools=tools, tool_choice={"type": "function", "function": {"name": "missing"}})
    assert error_of(exc)["param"] == "tool_choice"


def test_system_fingerprint_and_cached_tokens(client):
    long = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 4}]
    first = _chat(client, messages=long, max_tokens=4)
    second = _chat(client, messages=long + [{"role": "assistant", "content": first.choices[0].message.content},
                                            {"role": "user", "content": "and then"}], max_tokens=4)
    assert first.system_fingerprint and first.system_fingerprint.startswith("b0.3.36-")
    assert second.system_fingerprint == first.system_fingerprint
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == second.model_extra["timings"]["cache_n"] and cached >= first.usage.prompt_tokens // 2
    assert all(c.system_fingerprint == first.system_fingerprint for c in _chat(client, stream=True))
    res = client.completions.create(model="x", prompt="abc", max_tokens=2)
    assert res.system_fingerprint == first.system_fingerprint and res.usage.prompt_tokens_details is not None


def test_a_bad_grammar_is_a_400_with_llama_cpps_parse_message(server, client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="x", prompt="abc", max_tokens=4, extra_body={"grammar": "root ::= ("})
    err = error_of(exc)
    assert err["param"] == "grammar" and err["code"] == "invalid_grammar"
    assert "expecting ')' at" in err["message"], err
    with pytest.raises(openai.BadRequestError) as exc:  # a JSON schema whose grammar the binding cannot make
        _chat(client, response_format={"type": "json_object", "schema": {"$ref": "#/definitions/nowhere"}})
    assert error_of(exc)["param"] == "response_format"
    assert server.alive() and _chat(client).choices[0].message.content


def test_a_grammar_no_token_can_continue_is_a_400_for_that_request_alone(server, client):
    # the vocabulary has no "é": no token can start what the grammar asks for
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as exc:
            res = client.completions.create(model="x", prompt="abc", max_tokens=4, temperature=0, stream=stream,
                                            extra_body={"grammar": 'root ::= "é"'})
            list(res) if stream else None
        err = error_of(exc)
        assert err["code"] == "grammar_error" and "no token can be sampled" in err["message"], err
    assert server.alive() and _chat(client).choices[0].message.content


def _binding_logprobs(model, prompt, max_tokens, n):
    """The binding's own figures with logits_all (every row computed and kept)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(model), logits_all=True, n_ctx=512, n_batch=64, n_ubatch=64, verbose=False)
    try:
        return llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, logprobs=n)["choices"][0]
    finally:
        llm.close()


def test_logprobs_without_logits_all_equal_the_bindings_with_it(server, client, models_dir):
    """The server's model has no logits_all: logprobs come from the rows sampling reads."""
    model = models_dir / "openai-chars.gguf"
    got = client.completions.create(model="x", prompt="once upon a", max_tokens=12, temperature=0, logprobs=3)
    want = _binding_logprobs(model, "once upon a", 12, 3)
    lp = got.choices[0].logprobs
    assert got.choices[0].text == want["text"]
    assert lp.tokens == want["logprobs"]["tokens"]
    assert lp.token_logprobs == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-4)
    assert [sorted(t) for t in lp.top_logprobs] == [sorted(t) for t in want["logprobs"]["top_logprobs"]]
    # chat: OpenAI's shape, as the binding's chat handler makes it from the same completion figures
    import llama_cpp

    chat = _chat(client, logprobs=True, top_logprobs=2)
    llm = llama_cpp.Llama(str(model), logits_all=True, n_ctx=512, n_batch=64, n_ubatch=64, verbose=False)
    try:
        ref = llm.create_chat_completion(CHAT, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    finally:
        llm.close()
    content, want_content = chat.choices[0].logprobs.content, ref["choices"][0]["logprobs"]["content"]
    assert [c.token for c in content] == [c["token"] for c in want_content] and content
    assert [c.logprob for c in content] == pytest.approx([c["logprob"] for c in want_content], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 for c in content)
