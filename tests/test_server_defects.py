"""The server's smaller defects, each found by a user and each a test: a non-ASCII API key, bodies
of any size, prompts tokenized on the model's thread, a cancelled request that kept its place in
the queue, min_tokens with logit_bias, /health after a lost RPC server.

The subprocess server here takes only flags that the server had before these were fixed, so each
test shows its defect on that code too.
"""

import http.client
import json
import threading
import time

import openai
import pytest

from llama_metaws_dev.testing import EOS_TOKEN, make_tiny_model, start_rpc_server, stop_process, free_port
from serving import CLIENT_TIMEOUT_S, Server, error_of, llama_error

KEY = "sésame-clé"  # not ASCII
PROMPT = "the quick brown fox jumps"


@pytest.fixture(scope="module")
def plain_model(models_dir):
    return make_tiny_model(models_dir / "defects-llama.gguf", seed=53)


@pytest.fixture(scope="module")
def server(plain_model, tmp_path_factory):
    srv = Server(plain_model, "-np", "1", "-c", "4096", "-b", "512", "-ub", "512", "--queue-size", "1", "--metrics",
                 api_key=KEY, log_path=tmp_path_factory.mktemp("srv") / "defects.log")
    yield from srv.running()


def _auth(**extra):
    return {"Authorization": b"Bearer " + KEY.encode("utf-8"), **extra}


def _long_stream(server):
    """A stream that keeps the model busy (no end of generation) until it is closed (raw HTTP:
    the openai client sends header values as ASCII only)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=CLIENT_TIMEOUT_S)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "stream": True,
                       "logit_bias": {str(EOS_TOKEN): -100}}).encode()
    conn.putrequest("POST", "/v1/completions")
    for k, v in _auth(**{"Content-Type": "application/json", "Content-Length": str(len(body))}).items():
        conn.putheader(k, v)
    conn.endheaders()
    conn.send(body)
    r = conn.getresponse()
    assert r.status == 200
    assert r.readline().startswith(b"data: ")  # the model is generating now
    return conn


def test_a_non_ascii_api_key_is_checked_not_a_500(server):
    body = {"prompt": PROMPT, "max_tokens": 2}
    status, res = server.json("POST", "/v1/completions", body, headers=_auth())
    assert status == 200 and res["usage"]["completion_tokens"] == 2
    status, res = server.json("POST", "/v1/completions", body, headers={"X-Api-Key": KEY.encode("utf-8")})
    assert status == 200, res
    for headers in ({"Authorization": "Bearer wrong"}, {}, {"Authorization": b"Bearer s\xe9same"}):
        status, res = server.json("POST", "/v1/completions", body, headers=headers)
        assert status == 401 and res["error"]["code"] == "invalid_api_key", res
    status, res = server.json("POST", "/completion", {"prompt": PROMPT}, headers={"Authorization": "Bearer wrong"})
    assert status == 401 and llama_error(res, 401)["type"] == "authentication_error"
    assert server.json("GET", "/health")[0] == 200  # no key needed


def test_a_body_beyond_the_limit_is_a_413_without_reading_it(server):
    limit = 16 << 20  # the default --max-body-size
    # no body is sent: a server that waited for it would never answer (the client's timeout fails)
    status, headers, data = server.request("POST", "/v1/completions", None, headers=_auth(**{
        "Content-Type": "application/json", "Content-Length": str(limit + 1)}), timeout=60)
    assert status == 413 and json.loads(data)["error"]["code"] == "body_too_large"
    # a body without a length (chunked) is cut off at the limit too
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.putrequest("POST", "/v1/completions")
        for k, v in _auth(**{"Content-Type": "application/json", "Transfer-Encoding": "chunked"}).items():
            conn.putheader(k, v)
        conn.endheaders()
        chunk = b'{"prompt": "' + b"x" * (1 << 20)
        try:
            for _ in range(20):
                conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                chunk = b"x" * (1 << 20)
            conn.send(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed before the end: what is checked below
        r = conn.getresponse()
        assert r.status == 413 and json.loads(r.read())["error"]["code"] == "body_too_large"
    finally:
        conn.close()
    assert server.alive() and server.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1},
                                          headers=_auth())[0] == 200


def _deferred(server) -> float:
    status, _, data = server.request("GET", "/metrics", headers=_auth())
    assert status == 200
    line = next(x for x in data.decode().splitlines() if x.startswith("llamacpp:requests_deferred "))
    return float(line.split()[1])


def _until(condition, what: str, limit_s: float = 60.0) -> None:
    """Poll ``condition`` until it holds; the limit only catches a hang."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_too_long_prompt_is_refused_before_it_queues(server):
    """It is tokenized when it comes, not on the model's thread once its turn comes: with the
    model busy and the queue full (--queue-size 1), a too-long prompt is a 400, not a 503."""
    running = _long_stream(server)
    waiting = {}
    t = threading.Thread(target=lambda: waiting.setdefault("conn", _long_stream(server)), daemon=True)
    t.start()
    try:
        _until(lambda: _deferred(server) >= 1, "the second request did not queue")
        status, res = server.json("POST", "/v1/completions", {"prompt": "the quick brown fox " * 3000,
                                                              "max_tokens": 2}, headers=_auth())
        assert status == 400 and res["error"]["code"] == "context_length_exceeded", res
        assert _deferred(server) == 1  # still busy: the answer did not wait for the model
    finally:
        running.close()
        t.join(timeout=CLIENT_TIMEOUT_S)
        if "conn" in waiting:
            waiting["conn"].close()


def test_a_request_cancelled_while_it_waits_gives_its_place_back(server):
    """--queue-size 1: one runs, one waits. The waiting client goes away; the next one may wait."""
    busy = _long_stream(server)
    try:
        def waiter():
            try:
                server.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, headers=_auth(),
                               timeout=1.5)
            except OSError:  # the timeout: the client goes away while its request waits
                pass

        t = threading.Thread(target=waiter)
        t.start()
        t.join(timeout=60)
        _until(lambda: _deferred(server) == 0, "the gone client still holds its place in the queue")
        result = {}

        def next_client():
            result["answer"] = server.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2},
                                           headers=_auth())

        t = threading.Thread(target=next_client)
        t.start()
        # it waits in the place given back (the model is busy) instead of a 503 at once
        _until(lambda: _deferred(server) == 1 or "answer" in result, "the next client neither queued nor was answered")
        assert result.get("answer", (None,))[0] != 503, result
    finally:
        busy.close()
    t.join(timeout=CLIENT_TIMEOUT_S)
    assert result["answer"][0] == 200, result


def test_min_tokens_and_logit_bias_together_both_apply(server):
    """The binding's LogitsProcessorList.extend returns None: given both, both were dropped."""
    def text(**extra):
        status, res = server.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                              **extra}, headers=_auth())
        assert status == 200, res
        return res["choices"][0]["text"], res["choices"][0]["finish_reason"], res["usage"]["completion_tokens"]

    plain = text()
    assert text(logit_bias={"5": 100})[0] == "5" * 6 != plain[0]
    assert text(logit_bias={"5": 100}, min_tokens=2)[0] == "5" * 6
    # min_tokens keeps the end away; a bias that makes it certain ends the answer right after
    assert text(logit_bias={str(EOS_TOKEN): 100}, min_tokens=3)[1:] == ("stop", 3)


# --- in process: what the HTTP side does, seen from inside -----------------------------------


@pytest.fixture(scope="module")
def app_client(plain_model):
    """The app on a real model in this process (Starlette's test client): the worker's thread is
    named, so who tokenizes can be seen."""
    from starlette.testclient import TestClient

    from llama_metaws.api.chat_layer import ChatTemplates
    from llama_metaws.server.app import create_app
    from llama_metaws.server.validation import ModelAccess
    from llama_metaws.server.worker import ModelWorker, ServedLlama

    llm = ServedLlama(str(plain_model), n_ctx=512, verbose=False)
    templates = ChatTemplates.for_llama(llm)
    llm.use_chat_templates(templates)
    worker = ModelWorker(llm, queue_size=4)
    app = create_app(worker, ModelAccess(llm, templates, alias="m"), slots=False, max_body_size=1000)
    with TestClient(app) as client:
        client.worker, client.llm = worker, llm
        yield client
    worker.close(timeout=10)
    llm.close()


def test_prompts_are_tokenized_off_the_models_thread(app_client, monkeypatch):
    from llama_metaws.native.binding import llama_cpp

    threads = []
    real = llama_cpp.Llama.tokenize

    def spy(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(llama_cpp.Llama, "tokenize", spy)
    for path, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}),
                       ("/completion", {"prompt": PROMPT, "n_predict": 2})):
        r = app_client.post(path, json=body)
        assert r.status_code == 200, r.text
    # the threads that must not tokenize, by the names they run under: the runners and the engine's
    model_threads = {t.name for t in app_client.worker._threads} | {app_client.llm._engine._thread.name}
    assert len(model_threads) == app_client.worker.n_parallel + 1, model_threads
    assert threads and not model_threads & set(threads), (threads, model_threads)


def test_no_slots_and_the_body_limit_in_llama_servers_shape(app_client):
    r = app_client.get("/slots")
    assert r.status_code == 501 and llama_error(r.json(), 501)["type"] == "not_supported_error"
    r = app_client.post("/completion", content=b'{"prompt": "' + b"y" * 2000 + b'"}')
    assert r.status_code == 413 and llama_error(r.json(), 413)["message"].startswith("the request body is larger")


def test_a_500_names_no_python_detail_and_the_log_has_it(app_client, monkeypatch, caplog):
    from starlette.testclient import TestClient

    from llama_metaws.server import llama_api

    secret = "a detail of this server's code: /srv/secret/path.py"

    def broken(*args, **kwargs):
        raise RuntimeError(secret)

    monkeypatch.setattr(llama_api, "props", broken)
    client = TestClient(app_client.app, raise_server_exceptions=False)
    with caplog.at_level("ERROR", logger="llama_metaws.server"):
        r = client.get("/props")
    assert r.status_code == 500, r.text
    error = llama_error(r.json(), 500)
    assert error["type"] == "server_error" and "see its log" in error["message"]
    assert secret not in r.text and "RuntimeError" not in r.text and "Traceback" not in r.text
    assert any(secret in (rec.exc_text or "") or (rec.exc_info and secret in str(rec.exc_info[1]))
               for rec in caplog.records), caplog.records
    assert app_client.get("/health").status_code == 200  # and the server goes on


# --- a lost RPC server ------------------------------------------------------------------------


def test_health_answers_503_once_an_rpc_server_is_lost(plain_model, tmp_path):
    rpc = start_rpc_server(free_port())
    srv = None
    try:
        srv = Server(plain_model, "--rpc", rpc.endpoint, "-c", "256", log_path=tmp_path / "rpc.log")
        client = srv.client()
        assert client.completions.create(model="m", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
        stop_process(rpc)
        with pytest.raises(openai.APIStatusError) as exc:
            client.completions.create(model="m", prompt=PROMPT + " again", max_tokens=2)
        assert exc.value.status_code == 503 and "RPC server" in error_of(exc)["message"]
        status, res = srv.json("GET", "/health")
        assert status == 503 and llama_error(res, 503)["type"] == "unavailable_error", res
        with pytest.raises(openai.APIStatusError) as exc:  # every request now, at once
            client.completions.create(model="m", prompt=PROMPT, max_tokens=2)
        assert exc.value.status_code == 503 and error_of(exc)["code"] == "model_unavailable"
        assert srv.alive()
    finally:
        if srv is not None:
            srv.kill()
        stop_process(rpc)
