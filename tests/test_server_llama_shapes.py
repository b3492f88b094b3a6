"""llama-server's shapes that its own clients (and its server suite) read, on ``llama-metaws serve``:
``completion_probabilities`` (``n_probs``, before and after sampling), ``exceed_context_size_error``
on OpenAI's routes, ``n`` choices, ``/props``' seed, ``/metrics``' families and header, timings
that are numbers only, ``aliases`` and ``tags`` in ``/v1/models``, ``--cors-origins``, the chat
token count, and ``timings_per_token`` / ``return_progress`` on OpenAI's streams.

One server with llama-server's flags: ``-a`` with two names, ``--tags``, ``-s``, ``--metrics``,
``-np 2``, ``--cors-origins localhost``, ``--no-cors-credentials``.
"""

import math
import time

import openai
import pytest

from llama_metaws_dev.testing import make_tiny_model
from serving import Server

PROMPT = "the quick brown fox"
N_CTX, N_SLOTS = 512, 2


@pytest.fixture(scope="module")
def server(models_dir, tmp_path_factory):
    model = make_tiny_model(models_dir / "llama-shapes-chars.gguf", seed=53, vocab="chars")
    tmp = tmp_path_factory.mktemp("shapes")
    srv = Server(model, "-a", "tiny-b,tiny-a", "--tags", "chat, small", "-s", "42", "--metrics",
                 "-np", str(N_SLOTS), "-c", str(N_CTX), "-b", "128", "-ub", "128",
                 "--cors-origins", "localhost", "--no-cors-credentials", log_path=tmp / "shapes.log")
    yield from srv.running()


def _piece_ok(entry):
    assert isinstance(entry["id"], int) and isinstance(entry["token"], str)
    assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]


def test_n_probs_are_completion_probabilities_with_ids_and_the_binding_s_logprobs(server):
    body = {"prompt": PROMPT, "n_predict": 4, "n_probs": 5, "temperature": 0, "return_tokens": True}
    status, res = server.json("POST", "/completion", body)
    assert status == 200, res
    probs = res["completion_probabilities"]
    assert [p["id"] for p in probs] == res["tokens"] and len(probs) == 4
    for p in probs:
        _piece_ok(p)
        assert p["logprob"] <= 0 and len(p["top_logprobs"]) == 5
        tops = [t["logprob"] for t in p["top_logprobs"]]
        assert tops == sorted(tops, reverse=True)
        assert p["top_logprobs"][0]["id"] == p["id"]  # greedy: the best is the token chosen
        for t in p["top_logprobs"]:
            _piece_ok(t)
    # the same figures as OpenAI's route gives (the binding's logprobs), which has no ids
    status, oai = server.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "logprobs": 5,
                                                         "temperature": 0})
    lp = oai["choices"][0]["logprobs"]
    assert "token_ids" not in lp and "top_ids" not in lp
    assert lp["token_logprobs"] == pytest.approx([p["logprob"] for p in probs], abs=1e-5)
    # streamed: one entry on each event, for the event's token
    status, hdrs, data = server.request("POST", "/completion", dict(body, stream=True))
    events = [__import__("json").loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: ")]
    partial = [e for e in events if not e["stop"]]
    assert partial and all(len(e["completion_probabilities"]) == 1 for e in partial)
    assert [e["completion_probabilities"][0]["id"] for e in partial] == [t for e in partial for t in e["tokens"]]


def test_post_sampling_probs_are_the_truncated_tempered_distribution(server):
    body = {"prompt": PROMPT, "n_predict": 3, "n_probs": 4, "temperature": 1.5, "top_k": 4, "top_p": 1.0,
            "min_p": 0.0, "post_sampling_probs": True, "seed": 7}
    status, res = server.json("POST", "/completion", body)
    assert status == 200, res
    for p in res["completion_probabilities"]:
        _piece_ok(p)
        assert "logprob" not in p and 0 < p["prob"] <= 1
        assert len(p["top_probs"]) == 4 and sum(t["prob"] for t in p["top_probs"]) == pytest.approx(1.0)
        assert p["id"] in [t["id"] for t in p["top_probs"]]  # top_k 4 left only these four
    # a cut by top_p keeps fewer, and they still sum to 1
    status, res = server.json("POST", "/completion", dict(body, temperature=1.0, top_k=40, top_p=0.1))
    for p in res["completion_probabilities"]:
        assert 1 <= len(p["top_probs"]) <= 4
        if len(p["top_probs"]) < 4:
            assert sum(t["prob"] for t in p["top_probs"]) == pytest.approx(1.0)


def test_a_prompt_too_long_is_exceed_context_size_error_on_openai_routes(server):
    client = server.client()
    long_text = "abc " * 400
    for call in (lambda: client.completions.create(model="x", prompt=long_text, max_tokens=2),
                 lambda: client.chat.completions.create(model="x", max_tokens=2,
                                                        messages=[{"role": "user", "content": long_text}])):
        with pytest.raises(openai.BadRequestError) as exc:
            call()
        err = exc.value.response.json()["error"]
        assert err["type"] == "exceed_context_size_error" and err["code"] == "context_length_exceeded"
        assert err["n_ctx"] == N_CTX // N_SLOTS and err["n_prompt_tokens"] > err["n_ctx"]


def test_n_choices_on_completions_and_chat(server):
    client = server.client()
    res = client.completions.create(model="x", prompt=PROMPT, max_tokens=3, n=2, temperature=0)
    assert [c.index for c in res.choices] == [0, 1] and res.choices[0].text == res.choices[1].text
    assert res.usage.completion_tokens == 6
    chunks = list(client.completions.create(model="x", prompt=PROMPT, max_tokens=3, n=2, temperature=0,
                                            stream=True))
    text = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            text[choice.index] += choice.text
    assert text[0] == text[1] == res.choices[0].text
    chat = client.chat.completions.create(model="x", max_tokens=2, n=3,
                                          messages=[{"role": "user", "content": "hi"}])
    assert [c.index for c in chat.choices] == [0, 1, 2]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="x", prompt=PROMPT, max_tokens=1, n=0)


def test_props_seed_models_aliases_and_tags(server):
    status, props = server.json("GET", "/props")
    assert props["default_generation_settings"]["params"]["seed"] == 42
    assert props["default_generation_settings"]["n_ctx"] == N_CTX // N_SLOTS
    status, models = server.json("GET", "/v1/models")
    m = models["data"][0]
    assert m["id"] == "tiny-a" and m["aliases"] == ["tiny-a", "tiny-b"] and m["tags"] == ["chat", "small"]
    assert server.client().completions.create(model="x", prompt=PROMPT, max_tokens=1).model == "tiny-a"


def _metrics(server):
    status, headers, data = server.request("GET", "/metrics")
    assert status == 200
    types, values = {}, {}
    for line in data.decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line.startswith("llamacpp:"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return headers, types, values


def test_metrics_families_header_and_numbers_only_timings(server):
    for _ in range(2):  # the second reuses the first's prompt
        status, res = server.json("POST", "/completion", {"prompt": PROMPT + " jumps", "n_predict": 5, "id_slot": 0})
        assert status == 200
        for key, value in res["timings"].items():
            assert isinstance(value, (int, float)) and math.isfinite(value) and value >= 0, (key, value)
    t = res["timings"]
    assert t["cache_n"] > 0
    # the rate is over the decode steps: the first token comes with the prompt
    assert t["predicted_per_second"] == pytest.approx(1e3 / t["predicted_ms"] * (t["predicted_n"] - 1))
    headers, types, values = _metrics(server)
    # llama-server's capitals, on the wire
    status, raw = _raw_header_names(server)
    assert "Process-Start-Time-Unix" in raw
    assert 0 < int(headers["process-start-time-unix"]) <= time.time()
    for name in ("llamacpp:prompt_tokens_cached_total", "llamacpp:n_decode_total", "llamacpp:n_tokens_max"):
        assert types[name] == "counter"
    for name in ("llamacpp:prompt_tokens_seconds", "llamacpp:predicted_tokens_seconds",
                 "llamacpp:n_busy_slots_per_decode"):
        assert types[name] == "gauge"
    assert values["llamacpp:prompt_tokens_cached_total"] >= t["cache_n"] > 0
    assert values["llamacpp:n_decode_total"] > 0 and values["llamacpp:n_tokens_max"] >= t["cache_n"] + t["prompt_n"]
    assert 1 <= values["llamacpp:n_busy_slots_per_decode"] <= N_SLOTS


def _raw_header_names(server):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("GET", "/metrics")
        r = conn.getresponse()
        r.read()
        return r.status, [k for k, _ in r.getheaders()]
    finally:
        conn.close()


@pytest.mark.parametrize("origin,echoed", [("http://localhost:3000", True), ("http://127.0.0.1", True),
                                           ("http://[::1]:8080", True), ("http://evil.com", False),
                                           ("http://localhost.evil.com", False)])
def test_cors_origins_localhost_echoes_local_origins_only(server, origin, echoed):
    status, headers, _ = server.request("OPTIONS", "/v1/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST"})
    assert status == 200
    assert headers.get("access-control-allow-origin") == (origin if echoed else None)
    assert headers["access-control-allow-credentials"] == "false"  # --no-cors-credentials


def test_chat_token_count_is_the_prompt_a_chat_runs(server):
    messages = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
    status, prompt = server.json("POST", "/apply-template", {"messages": messages})
    status, toks = server.json("POST", "/tokenize", {"content": prompt["prompt"], "add_special": True})
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        status, res = server.json("POST", path, {"messages": messages})
        assert status == 200 and res == {"input_tokens": len(toks["tokens"])}
    res = server.client().chat.completions.create(model="x", max_tokens=1, messages=messages)
    assert res.usage.prompt_tokens == len(toks["tokens"])
    assert server.json("POST", "/v1/chat/completions/input_tokens", {})[0] == 400  # no messages
    # an empty list, as llama-server takes it: the template's generation prompt
    status, res = server.json("POST", "/v1/chat/completions/input_tokens", {"messages": []})
    assert status == 200 and 0 < res["input_tokens"] < len(toks["tokens"])


def test_timings_per_token_and_return_progress_on_openai_streams(server):
    import json

    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "test"}]}),
                       ("/v1/completions", {"prompt": PROMPT})):
        status, _, data = server.request("POST", path, dict(body, max_tokens=4, stream=True, timings_per_token=True,
                                                            return_progress=True,
                                                            stream_options={"include_usage": True}))
        assert status == 200, data
        events = [json.loads(line[6:]) for line in data.decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
        assert len(progress) >= 2 and progress[-1]["processed"] == progress[-1]["total"] > 0
        assert progress[0]["processed"] == progress[0]["cache"] and "prompt_progress" in events[0]
        with_choices = [e for e in events if e["choices"] and "prompt_progress" not in e]
        roles = [e for e in with_choices if "role" in (e["choices"][0].get("delta") or {})]
        assert all("timings" not in e for e in roles)
        assert all("timings" in e for e in with_choices if e not in roles)
        usage = events[-1]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == usage["timings"]["predicted_n"]
    for bad in ({"timings_per_token": "yes"}, {"return_progress": 1}):
        status, res = server.json("POST", "/v1/chat/completions", dict(
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}, **bad))
        assert status == 400 and res["error"]["param"] == list(bad)[0]


def test_host_takes_several_addresses(models_dir, tmp_path):
    import socket
    import urllib.request

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    model = make_tiny_model(models_dir / "llama-shapes-hosts.gguf", seed=54, vocab="chars")
    srv = Server(model, "--host", "127.0.0.1,::1", "-c", "256", log_path=tmp_path / "hosts.log")
    try:
        for host in ("127.0.0.1", "[::1]"):
            with urllib.request.urlopen(f"http://{host}:{srv.port}/health", timeout=60) as r:
                assert r.status == 200
    finally:
        srv.kill()


def test_id_slot_on_openai_routes(server):
    status, before = server.json("GET", "/slots")
    task = {s["id"]: s["id_task"] for s in before}
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": PROMPT})):
        status, res = server.json("POST", path, dict(body, max_tokens=2, id_slot=1))
        assert status == 200, res
        status, after = server.json("GET", "/slots")
        now = {s["id"]: s["id_task"] for s in after}
        assert now[1] > task[1] and now[0] == task[0]  # it ran on slot 1, slot 0 saw nothing
        task = now
    status, res = server.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "id_slot": 2})
    assert status == 400 and res["error"]["param"] == "id_slot"


def test_chat_chunks_and_logprobs_in_llama_servers_shape(server):
    client = server.client()
    messages = [{"role": "user", "content": "hi"}]
    chunks = list(client.chat.completions.create(model="x", max_tokens=3, messages=messages, stream=True))
    assert all(c.choices[0].delta.content != "" for c in chunks if c.choices)  # no empty content delta
    first = chunks[0].model_dump()["choices"][0]["delta"]
    assert first["role"] == "assistant" and "content" in chunks[0].choices[0].delta.model_fields_set
    assert chunks[0].system_fingerprint.startswith("b")
    res = client.chat.completions.create(model="x", max_tokens=3, messages=messages, logprobs=True,
                                         top_logprobs=3, temperature=0)
    content = res.choices[0].logprobs.content
    assert "".join(t.token for t in content) == res.choices[0].message.content
    for t in content:
        assert t.bytes == list(t.token.encode()) and all(x.bytes == list(x.token.encode()) for x in t.top_logprobs)


def test_verbose_answers_carry_the_prompt_as_it_ran(server):
    messages = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
    status, prompt = server.json("POST", "/apply-template", {"messages": messages})
    status, toks = server.json("POST", "/tokenize", {"content": prompt["prompt"], "add_special": True})
    status, ran = server.json("POST", "/detokenize", {"tokens": toks["tokens"]})  # the prompt as it runs
    for verbose in (True, False):
        status, res = server.json("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 2,
                                                                   "verbose": verbose})
        assert status == 200
        if verbose:
            assert res["__verbose"]["prompt"] == ran["content"] and "Book" in ran["content"]
            assert res["__verbose"]["content"] == res["choices"][0]["message"]["content"]
        else:
            assert "__verbose" not in res
    status, res = server.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "verbose": True})
    assert res["__verbose"] == {"prompt": PROMPT, "content": res["choices"][0]["text"]}


def test_generation_settings_list_the_logit_bias(server):
    status, res = server.json("POST", "/completion", {"prompt": PROMPT, "n_predict": 2, "ignore_eos": True})
    bias = res["generation_settings"]["logit_bias"]
    assert bias and all(e["bias"] is None for e in bias)  # -inf: the end-of-generation token never
    status, res = server.json("POST", "/completion", {"prompt": PROMPT, "n_predict": 2, "logit_bias": [[5, -2.5]]})
    assert res["generation_settings"]["logit_bias"] == [{"token": 5, "bias": -2.5}]
    status, res = server.json("POST", "/completion", {"prompt": PROMPT, "n_predict": 2})
    assert res["generation_settings"]["logit_bias"] == []


def test_the_servers_seed_is_every_requests_default_and_n_predict_works_on_openai_routes(server):
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 1.5, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    texts = {server.json("POST", "/completion", body)[1]["content"] for _ in range(2)}
    assert len(texts) == 1  # -s 42: the same seed each time, as llama-server samples
    status, res = server.json("POST", "/completion", dict(body, seed=7))
    assert res["generation_settings"]["seed"] == 7
    status, res = server.json("POST", "/completion", body)
    assert res["generation_settings"]["seed"] == 42
    status, oai = server.json("POST", "/v1/completions", {"prompt": PROMPT, "n_predict": 3})
    assert status == 200 and oai["usage"]["completion_tokens"] == 3
    status, bad = server.json("POST", "/v1/completions", {"prompt": PROMPT, "n_predict": "x"})
    assert status == 400 and bad["error"]["param"] == "n_predict"
