"""``llama-metaws serve`` in a subprocess, for the server tests: started on 127.0.0.1 on a free
port, waited for (bounded), talked to with the official ``openai`` client or raw HTTP (every call
with a timeout), and killed by its PID."""

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import openai

from llama_metaws_dev.testing import free_port

CLIENT_TIMEOUT_S = 120  # generous: 2 shared cores
START_TIMEOUT_S = 180


class Server:
    """``llama-metaws serve`` in a subprocess on 127.0.0.1, stopped by PID."""

    def __init__(self, model, *flags, log_path, api_key=None, env=None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.api_key = api_key
        self._log = open(log_path, "w")
        key = ["--api-key", api_key] if api_key is not None else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llama_metaws", "serve", "-m", str(model), "--host", "127.0.0.1",
             "--port", str(self.port), *key, *flags],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(os.environ, **(env or {})))  # env: more variables (llama-server's LLAMA_ARG_*)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if json.loads(r.read())["status"] == "ok":
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"the server did not come up:\n{self.log()}")
            time.sleep(0.2)

    def running(self):
        """A module fixture's body (``yield from srv.running()``): the server, then killed by PID,
        and its log checked for a Python traceback (a request that failed inside it)."""
        try:
            yield self
        finally:
            self.kill()
        assert "Traceback" not in self.log(), self.log()

    def client(self, **kw):
        kw.setdefault("api_key", "none")
        return openai.OpenAI(base_url=self.base + "/v1", timeout=CLIENT_TIMEOUT_S, max_retries=0, **kw)

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def get(self, path, headers=None):
        req = urllib.request.Request(self.base + path, headers=headers or {})
        with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as r:
            return r.status, r.read().decode()

    def request(self, method, path, body=None, headers=None, timeout=CLIENT_TIMEOUT_S):
        """Raw HTTP: (status, headers, body bytes). ``body``: bytes, or an object sent as JSON;
        header values may be bytes (sent as they are)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if body is not None and not isinstance(body, (bytes, bytearray)):
                body = json.dumps(body).encode()
            conn.putrequest(method, path)
            hdrs = dict(headers or {})
            if body is not None:
                hdrs.setdefault("Content-Type", "application/json")
                hdrs.setdefault("Content-Length", str(len(body)))
            for k, v in hdrs.items():
                conn.putheader(k, v)
            conn.endheaders()
            if body is not None:
                conn.send(body)
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def json(self, method, path, body=None, headers=None):
        """(status, parsed JSON body) of a raw request."""
        status, _, data = self.request(method, path, body, headers)
        return status, json.loads(data) if data else None

    def events(self, path, body, headers=None):
        """A streamed answer's ``data:`` events, parsed (the last may be "[DONE]")."""
        status, hdrs, data = self.request("POST", path, body, headers)
        assert status == 200 and hdrs["content-type"].startswith("text/event-stream"), (status, data[:500])
        out = []
        for block in data.decode().split("\n\n"):
            for line in block.splitlines():
                if line.startswith("data: "):
                    payload = line[len("data: "):]
                    out.append(payload if payload == "[DONE]" else json.loads(payload))
        return out

    def metrics(self):
        status, text = self.get("/metrics")
        assert status == 200
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def alive(self):
        return self.proc.poll() is None

    def kill(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log.close()


def error_of(exc):
    """OpenAI's error object of an ``openai.APIStatusError``, its shape checked (a prompt too long
    for the context adds llama-server's ``n_prompt_tokens`` and ``n_ctx``)."""
    body = exc.value.response.json()
    extra = {"n_prompt_tokens", "n_ctx"} if body["error"].get("type") == "exceed_context_size_error" else set()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"} | extra, body
    return body["error"]


def llama_error(body, status):
    """llama-server's error object, its shape checked: ``{"code": status, "message", "type"}``."""
    assert set(body) == {"error"}, body
    err = body["error"]
    assert err["code"] == status and isinstance(err["message"], str) and err["message"], err
    assert {"code", "message", "type"} <= set(err), err
    return err
