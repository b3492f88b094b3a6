"""``llama-metaws serve`` as users run it: the official ``openai`` client against a subprocess.

Every server here listens on 127.0.0.1 on a free port and is killed by its PID when its test or
module ends. One server (MTP drafting under tensor split over CPU,CPU, with --metrics) is shared
by most tests; a plain llama model serves the prompt-reuse, API-key and queue-limit tests; the
signal tests start their own. Every client call has a timeout and every loop a bound.
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error

import openai  # the test extra installs the official client
import pytest

from llama_metaws_dev.testing import EOS_TOKEN, make_tiny_model, make_tiny_mtp_model

from serving import CLIENT_TIMEOUT_S, Server, error_of

PROMPT = "the quick brown fox jumps"
CHAT = [{"role": "user", "content": "hello there"}]
MAX_TOKENS = 16
# a prompt longer than -c 256 (the TEST tokenizer gives one token per short word or less)
TOO_LONG = "the quick brown fox " * 100


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mtp_model(models_dir):
    return make_tiny_mtp_model(models_dir / "server-agree.gguf", seed=51, agreement=0.8)


@pytest.fixture(scope="module")
def plain_model(models_dir):
    return make_tiny_model(models_dir / "server-llama.gguf", seed=52)


@pytest.fixture(scope="module")
def mtp_server(mtp_model, tmp_path_factory):
    """The seed's configuration: MTP drafting, tensor split over two CPU devices, the workspace."""
    server = Server(mtp_model, "--device", "CPU,CPU", "-sm", "tensor", "-ts", "0.55,0.45",
                    "--spec-type", "draft-mtp", "--spec-draft-n-max", "3", "--phase-aware-workspace",
                    "-np", "1", "-c", "256", "-b", "64", "-ub", "64", "--metrics", "-a", "tiny-mtp",
                    log_path=tmp_path_factory.mktemp("srv") / "mtp.log")
    try:
        yield server
    finally:
        server.kill()
    assert "Traceback" not in server.log(), server.log()  # every error was an answer, none a crash


@pytest.fixture(scope="module")
def plain_server(plain_model, tmp_path_factory):
    """No drafting, an API key, no waiting room (--queue-size 0), a context long enough to keep the
    model busy while a second request comes."""
    server = Server(plain_model, "-np", "1", "-c", "4096", "-b", "512", "-ub", "512", "--api-key", "sesame",
                    "--queue-size", "0", "--metrics",
                    log_path=tmp_path_factory.mktemp("srv") / "plain.log")
    try:
        yield server
    finally:
        server.kill()


def _complete(client, prompt=PROMPT, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    return client.completions.create(model="tiny-mtp", prompt=prompt, temperature=0, **kw)


def _chat(client, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model="tiny-mtp", messages=CHAT, temperature=0, **kw)


@pytest.fixture(scope="module")
def reference(mtp_server):
    """The greedy answers, asked once each before any other test touched the server."""
    client = mtp_server.client()
    return {"completion": _complete(client).choices[0].text,
            "chat": _chat(client).choices[0].message.content}


# --- the seed's configuration answers, streaming and not -----------------------------------


def test_completions_streamed_and_not_give_the_same_greedy_text(mtp_server, reference):
    client = mtp_server.client()
    res = _complete(client)
    assert res.choices[0].text == reference["completion"] and res.choices[0].text
    assert res.model == "tiny-mtp" and res.usage.completion_tokens == MAX_TOKENS
    chunks = list(_complete(client, stream=True))
    assert len(chunks) >= 2
    assert "".join(c.choices[0].text for c in chunks) == reference["completion"]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_streamed_and_not_give_the_same_greedy_text(mtp_server, reference):
    client = mtp_server.client()
    res = _chat(client)
    assert res.choices[0].message.content == reference["chat"] and reference["chat"]
    assert res.choices[0].message.role == "assistant"
    chunks = list(_chat(client, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reference["chat"]
    assert chunks[-1].choices[0].finish_reason is not None
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-mtp"]


def test_any_model_name_is_served_by_the_one_model_and_v1_models_lists_the_alias(mtp_server, reference):
    """As llama-server and the binding's server do: clients that send their own model name work."""
    client = mtp_server.client()
    for name in ("gpt-4o-mini", "gpt-3.5-turbo"):
        res = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        assert res.choices[0].text == reference["completion"] and res.model == "tiny-mtp"
    res = client.chat.completions.create(model="gpt-4o-mini", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert res.choices[0].message.content == reference["chat"] and res.model == "tiny-mtp"
    assert [m.id for m in client.models.list().data] == ["tiny-mtp"]


# --- dropped streams and concurrency -------------------------------------------------------


def test_streams_abandoned_after_two_chunks_free_the_model(mtp_server, reference):
    client = mtp_server.client()
    before = mtp_server.metrics()["llamacpp:tokens_predicted_total"]
    for _ in range(3):
        stream = _complete(client, stream=True, max_tokens=200)
        seen = []
        for chunk in stream:  # bounded: two chunks, then the client goes away
            seen.append(chunk.choices[0].text)
            if len(seen) == 2:
                break
        stream.close()
        assert len(seen) == 2
    predicted = 0
    for _ in range(5):
        res = _complete(client)
        assert res.choices[0].text == reference["completion"]
        predicted += res.model_extra["timings"]["predicted_n"]
    # the model stopped each abandoned one soon after the client left (a finished one predicts
    # 200 tokens); the counters also count stopped requests
    abandoned = mtp_server.metrics()["llamacpp:tokens_predicted_total"] - before - predicted
    print(f"tokens predicted for the 3 abandoned streams: {abandoned}")
    assert 3 * 2 <= abandoned < 3 * 200
    assert "Traceback" not in mtp_server.log(), mtp_server.log()


def test_a_chat_stream_dropped_mid_way_frees_the_model(mtp_server, reference):
    client = mtp_server.client()
    stream = _chat(client, stream=True)
    next(iter(stream))
    stream.close()
    assert _chat(client).choices[0].message.content == reference["chat"]


def test_two_concurrent_streams_both_finish_and_the_server_answers_after(mtp_server, reference):
    client = mtp_server.client()
    texts, errors = {}, []
    start = threading.Barrier(2)

    def run(k):
        try:
            start.wait(timeout=30)
            if k == 0:
                texts[k] = "".join(c.choices[0].text for c in _complete(client, stream=True))
            else:
                texts[k] = "".join(c.choices[0].delta.content or "" for c in _chat(client, stream=True))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((k, e))

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * CLIENT_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a stream did not finish"
    assert not errors, errors
    # neither answer has tokens of the other: each is its single-request text
    assert texts == {0: reference["completion"], 1: reference["chat"]}
    assert _complete(client).choices[0].text == reference["completion"]


# --- draft statistics: timings and /metrics ------------------------------------------------


TIMING_KEYS = {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second", "draft_n",
               "draft_n_accepted", "cache_n"}


def test_timings_and_metrics_move_with_drafting(mtp_server):
    client = mtp_server.client()
    before = mtp_server.metrics()
    res = _complete(client, max_tokens=32)
    timings = res.model_extra["timings"]
    assert TIMING_KEYS <= set(timings)
    assert timings["prompt_n"] >= 1 and timings["predicted_n"] >= 32 and timings["predicted_ms"] > 0
    assert timings["predicted_per_second"] > 0
    assert timings["draft_n"] > 0 and 0 < timings["draft_n_accepted"] <= timings["draft_n"]
    after = mtp_server.metrics()

    def moved(name):
        return after[name] - before[name]

    assert moved("llamacpp:prompt_tokens_total") == timings["prompt_n"]
    assert moved("llamacpp:tokens_predicted_total") == timings["predicted_n"]
    assert moved("llamacpp:spec_decode_num_draft_tokens_total") == timings["draft_n"]
    assert moved("llamacpp:spec_decode_num_accepted_tokens_total") == timings["draft_n_accepted"]
    assert moved("llamacpp:spec_decode_num_drafts_total") >= 1
    assert moved("llamametaws:shadow_drafts_total") == 0  # a fixed length verifies every draft
    # the workspace's gauges: a shared meta entry under tensor split, the draft through an alias
    alias = {k: v for k, v in after.items() if k.startswith("llamametaws:workspace_alias_in_use")}
    assert alias and max(alias.values()) == 1
    assert any(v > 0 for k, v in after.items() if k.startswith("llamametaws:workspace_bytes{"))
    assert any(k.startswith("llamametaws:workspace_generation{") for k in after)
    assert any(k.startswith("llamametaws:workspace_grows_total{") for k in after)
    assert any(k.startswith("llamametaws:workspace_shrinks_total{") for k in after)

    # a stream carries the timings on its last chunk
    chunks = list(_chat(client, stream=True))
    last = chunks[-1].model_extra.get("timings")
    assert last and last["draft_n"] > 0 and last["predicted_n"] >= 1
    assert all("timings" not in c.model_extra for c in chunks[:-1])


def test_a_reused_prompt_is_counted_in_cache_n(plain_server):
    client = plain_server.client(api_key="sesame")
    client.completions.create(model="server-llama.gguf", prompt="0 1 2", max_tokens=2, temperature=0)
    first = client.completions.create(model="server-llama.gguf", prompt=PROMPT * 4, max_tokens=4,
                                      temperature=0)
    second = client.completions.create(model="server-llama.gguf", prompt=PROMPT * 4 + " over",
                                       max_tokens=4, temperature=0)
    t1, t2 = first.model_extra["timings"], second.model_extra["timings"]
    assert t1["draft_n"] == 0 and t1["draft_n_accepted"] == 0  # no drafting on this server
    assert t1["prompt_n"] + t1["cache_n"] == first.usage.prompt_tokens
    assert t2["cache_n"] > 0 and t2["prompt_n"] + t2["cache_n"] == second.usage.prompt_tokens
    assert t2["prompt_n"] < second.usage.prompt_tokens


def test_a_chat_turn_reuses_the_history_on_the_hybrid_target(mtp_server, reference):
    """qwen35 with draft-mtp: the next turn restores the state after the history (checkpoints)."""
    client = mtp_server.client()
    history = [{"role": "user", "content": PROMPT * 6}]
    first = client.chat.completions.create(model="tiny-mtp", messages=history, max_tokens=8, temperature=0)
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "and then"}]
    second = client.chat.completions.create(model="tiny-mtp", messages=history, max_tokens=8, temperature=0)
    t = second.model_extra["timings"]
    assert t["cache_n"] >= first.usage.prompt_tokens // 2, t
    assert t["cache_n"] + t["prompt_n"] == second.usage.prompt_tokens
    assert _chat(client).choices[0].message.content == reference["chat"]  # reuse changes no answer


# --- bad requests: a 4xx in OpenAI's shape, and the next request works -----------------------


_error_of = error_of


BAD = {
    "negative max_tokens (completions)": (400, "max_tokens", lambda c: _complete(c, max_tokens=-1)),
    "negative max_tokens (chat)": (400, "max_tokens", lambda c: _chat(c, max_tokens=-5)),
    "zero max_tokens": (400, "max_tokens", lambda c: _complete(c, max_tokens=0)),
    "negative max_completion_tokens": (400, "max_completion_tokens", lambda c: _chat(
        c, max_tokens=None, max_completion_tokens=-1)),
    "empty prompt": (400, "prompt", lambda c: _complete(c, prompt="")),
    "two prompts": (400, "prompt", lambda c: _complete(c, prompt=["a b", "c d"])),
    "messages not a list": (400, "messages", lambda c: c.chat.completions.create(
        model="tiny-mtp", messages=[], extra_body={"messages": "hello"})),
    "n=0 (completions)": (400, "n", lambda c: _complete(c, n=0)),
    "n=17 (chat)": (400, "n", lambda c: _chat(c, n=17)),
    "best_of=3": (400, "best_of", lambda c: _complete(c, best_of=3)),
    "too long, streamed": (400, "prompt", lambda c: list(_complete(c, prompt=TOO_LONG, stream=True))),
    "too long, chat streamed": (400, "messages", lambda c: list(c.chat.completions.create(
        model="tiny-mtp", messages=[{"role": "user", "content": TOO_LONG}], stream=True))),
    "too long": (400, "prompt", lambda c: _complete(c, prompt=TOO_LONG)),
    "an unsupported parameter": (400, "frobnicate", lambda c: _complete(c, extra_body={"frobnicate": 1})),
    "an unsupported chat parameter": (400, "web_search_options", lambda c: _chat(
        c, extra_body={"web_search_options": {}})),
    "a wrong type": (400, "temperature", lambda c: _complete(c, extra_body={"temperature": "hot"})),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_request_gets_its_4xx_and_the_next_request_works(mtp_server, reference, case):
    status, param, call = BAD[case]
    client = mtp_server.client()
    with pytest.raises(openai.APIStatusError) as exc:
        call(client)
    assert exc.value.status_code == status, exc.value.response.text
    err = _error_of(exc)
    assert err["param"] == param and err["message"], err
    assert param in err["message"] or err["code"] in ("context_length_exceeded",), err
    if case == "an unsupported parameter":
        assert "frobnicate" in err["message"]
    if "too long" in case:
        assert err["code"] == "context_length_exceeded"
    assert _complete(client).choices[0].text == reference["completion"]
    assert mtp_server.proc.poll() is None


def test_malformed_json_is_a_json_400_on_a_connection_that_stays_open(mtp_server, reference):
    conn = http.client.HTTPConnection("127.0.0.1", mtp_server.port, timeout=CLIENT_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", body=b'{"prompt": "x",', headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        body = json.loads(r.read())
        assert r.status == 400 and r.getheader("content-type").startswith("application/json")
        assert body["error"]["code"] == "invalid_json" and body["error"]["type"] == "invalid_request_error"
        sock = conn.sock
        good = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
        conn.request("POST", "/v1/completions", body=good, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["choices"][0]["text"] == reference["completion"]
        assert conn.sock is sock, "the keep-alive connection was reset"
        conn.request("GET", "/nowhere")
        r = conn.getresponse()
        assert r.status == 404 and json.loads(r.read())["error"]["code"] == "not_found"
        conn.request("GET", "/v1/completions")
        r = conn.getresponse()
        assert r.status == 405 and json.loads(r.read())["error"]["code"] == "method_not_allowed"
    finally:
        conn.close()


def test_metrics_behind_the_api_key(plain_server):
    with pytest.raises(urllib.error.HTTPError) as exc:
        plain_server.get("/metrics")
    assert exc.value.code == 401
    status, text = plain_server.get("/metrics", headers={"Authorization": "Bearer sesame"})
    assert status == 200 and "llamacpp:prompt_tokens_total" in text


def test_the_api_key_is_required(plain_server):
    with pytest.raises(openai.AuthenticationError) as exc:
        plain_server.client(api_key="wrong").completions.create(model="server-llama.gguf", prompt=PROMPT,
                                                                max_tokens=2)
    assert _error_of(exc)["code"] == "invalid_api_key"
    assert plain_server.get("/health")[0] == 200  # /health needs no key
    res = plain_server.client(api_key="sesame").completions.create(model="server-llama.gguf", prompt=PROMPT,
                                                                   max_tokens=2)
    assert res.choices[0].text is not None and res.usage.completion_tokens >= 1


def test_a_full_queue_is_a_clear_503_and_the_model_is_free_after(plain_server):
    client = plain_server.client(api_key="sesame")
    long = dict(model="server-llama.gguf", prompt=PROMPT, max_tokens=3000, temperature=0,
                logit_bias={str(EOS_TOKEN): -100})  # never ends early: the model stays busy
    stream = client.completions.create(stream=True, **long)
    it = iter(stream)
    next(it)
    try:
        with pytest.raises(openai.APIStatusError) as exc:
            client.completions.create(model="server-llama.gguf", prompt=PROMPT, max_tokens=2)
        assert exc.value.status_code == 503
        assert _error_of(exc)["code"] == "server_busy"
        assert exc.value.response.headers.get("retry-after")
    finally:
        stream.close()
    # the dropped stream frees the model after its next token; allow for the client's close
    deadline, res = time.monotonic() + 60, None
    for _ in range(240):
        try:
            res = client.completions.create(model="server-llama.gguf", prompt=PROMPT, max_tokens=2)
            break
        except openai.APIStatusError as e:
            assert e.status_code == 503 and time.monotonic() < deadline, e
            time.sleep(0.25)
    assert res is not None and res.usage.completion_tokens >= 1


# --- start-up and signals ------------------------------------------------------------------


def test_fa_off_under_tensor_split_is_refused_at_start_up(mtp_model):
    res = subprocess.run([sys.executable, "-m", "llama_metaws", "serve", "-m", str(mtp_model), "--device",
                          "CPU,CPU", "-sm", "tensor", "-fa", "off", "--port", str(_free_port())],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 2 and "-fa off" in res.stderr and "-fa on" in res.stderr, res.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_server_with_a_stream_in_flight(plain_model, tmp_path, sig):
    server = Server(plain_model, "-c", "4096", "-b", "512", "-ub", "512", "-fa", "on",
                    log_path=tmp_path / "signal.log")
    try:
        with pytest.raises(urllib.error.HTTPError) as exc:  # no --metrics here
            server.get("/metrics")
        # llama-server's endpoint, llama-server's error shape
        assert exc.value.code == 501 and json.loads(exc.value.read())["error"] == {
            "code": 501, "type": "not_supported_error",
            "message": "this server does not serve metrics: start it with --metrics"}
        stream = server.client().completions.create(model="server-llama.gguf", prompt=PROMPT, max_tokens=3000,
                                                    temperature=0, logit_bias={str(EOS_TOKEN): -100},
                                                    stream=True)
        it = iter(stream)
        next(it)
        next(it)
        os.kill(server.proc.pid, sig)
        rc = server.proc.wait(timeout=60)  # a hang detector: TimeoutExpired fails the test
        assert rc == 0, server.log()
        # the stream in flight ended (an error event, or the connection closed), it did not hang
        with pytest.raises((openai.APIError, openai.APIConnectionError, StopIteration)):
            for _ in range(3001):
                next(it)
        stream.close()
        assert "stopped" in server.log()
    finally:
        server.kill()


def test_serve_flags_follow_llama_server():
    from llama_metaws import cli
    from llama_metaws.cli import flags

    p = cli.make_parser()
    args = p.parse_args(["serve", "-m", "x.gguf", "--spec-type", "draft-mtp", "--spec-draft-n-max", "2",
                         "--draft-p-min", "0.5", "-np", "2", "-c", "512", "-b", "128", "-ub", "64",
                         "-fa", "on", "--host", "127.0.0.1", "--port", "9999", "--api-key", "k",
                         "--metrics", "-sm", "tensor", "--device", "CPU,CPU", "-ts", "3/1"])
    kw = flags.llama_kwargs(args)
    assert (kw["draft"], kw["draft_max"], kw["draft_p_min"]) == ("mtp", 2, 0.5)
    assert (kw["n_seq_max"], kw["n_ctx"], kw["n_batch"], kw["n_ubatch"]) == (2, 512, 128, 64)
    assert kw["flash_attn"] is True and kw["split_mode"] == "tensor" and kw["devices"] == ["CPU", "CPU"]
    assert kw["tensor_split"] == [3.0, 1.0]
    assert (args.host, args.port, args.api_key, args.metrics) == ("127.0.0.1", 9999, "k", True)
    auto = flags.llama_kwargs(p.parse_args(["serve", "-m", "x", "-sm", "tensor", "--device", "CPU,CPU"]))
    assert auto["flash_attn"] == "auto"  # llama.cpp turns it on under tensor split, which needs it
    assert p.parse_args(["serve", "-m", "x"]).port == 8080
    # -tb as llama-server's: -t's value unless given; neither given, the binding's defaults
    one = flags.llama_kwargs(p.parse_args(["serve", "-m", "x", "-t", "1"]))
    assert (one["n_threads"], one["n_threads_batch"]) == (1, 1)
    both = flags.llama_kwargs(p.parse_args(["serve", "-m", "x", "-t", "1", "--threads-batch", "2"]))
    assert (both["n_threads"], both["n_threads_batch"]) == (1, 2)
    assert "n_threads_batch" not in flags.llama_kwargs(p.parse_args(["serve", "-m", "x"]))
