"""No request can end the server: malformed, oversized and adversarial requests, seeded and
bounded, through a real ``llama-metaws serve`` process in the seed's configuration (MTP drafting
under tensor split over CPU,CPU, the shared workspace) on the tiny TEST-vocabulary model, whose
hex-digit tokens cannot spell JSON: every grammar path meets a dead end there, as it did when
one request killed the process.

After each request the server must still be alive, answer ``GET /health`` and a normal request,
every answer must be JSON (an error object for a 4xx or 5xx), and at the end its log must hold no
traceback (every error was handled, none escaped to uvicorn). ``LLAMA_METAWS_FUZZ_SEED`` and
``LLAMA_METAWS_FUZZ_CASES`` change the seed and the number of cases.
"""

import json
import os
import random
import time

import pytest

from llama_metaws_dev.testing import make_tiny_mtp_model
from serving import Server

SEED = int(os.environ.get("LLAMA_METAWS_FUZZ_SEED", "26"))
N_CASES = int(os.environ.get("LLAMA_METAWS_FUZZ_CASES", "120"))
BUDGET_S = 420  # the cases stop here, whatever is left (2 shared cores)
MAX_BODY = 1 << 20

ROUTES = ["/v1/completions", "/v1/chat/completions", "/completion", "/tokenize", "/detokenize", "/apply-template"]
GRAMMAR_BITS = ["root ::= ", "root", " ::= ", "(", ")", '"', "[", "]", "*", "+", "?", "{", "}", "|", "\\", "<", ">",
                "a", "x", "0-9", "^", "-", "\n", " ", "#", ",", "3", "99999", "<[5]>", "<[99999999]>", "ws", ".", "\x00"]
NASTY_GRAMMARS = [
    "root ::= (", "root ::= ", 'root ::= "{" [a-z]* "}"', 'root ::= "a"\nroot ::= root "b"', "x ::= y",
    "root ::= " + "(" * 30000 + '"a"' + ")" * 30000,
    "root ::= a0\n" + "".join(f"a{i} ::= a{i + 1}\n" for i in range(6000)) + 'a6000 ::= "x"\n',
    'root ::= "a"{99999}', 'root ::= ("a"{0,2000}){0,2000}', 'root ::= [\\x00-\\xff]*', 'root ::= "\\u12"',
    "root ::= <[99999999]>", "root ::= <think>", 'root ::= "é"', "root ::= [^\\n]+ \"{\"", "root ::= [0-9a-f]{3}",
]
SCHEMAS = [
    {}, {"type": "object"}, {"type": "array", "items": {"type": "string"}, "minItems": 5},
    {"$ref": "#"}, {"$ref": "#/definitions/x"}, {"type": "string", "pattern": "(((((a"},
    {"type": "integer", "minimum": 10, "maximum": 2}, {"enum": list(range(2000))}, {"type": ["null", "object"]},
    {"properties": {"a": {"$ref": "#"}}, "required": ["a"]}, {"type": "nonsense"}, {"anyOf": []}, "not a schema", 5,
]


def _value(rng, depth=0):
    """A random JSON value (with JSON's forbidden literals as strings, made raw later)."""
    kind = rng.randrange(10 if depth < 3 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.randint(-2**70, 2**70)
    if kind == 3:
        return rng.uniform(-1e9, 1e9)
    if kind == 4:
        return "".join(rng.choice("aé\u0000\ud7ff\ud800\udfff{}<>\"\\ \n") for _ in range(rng.randrange(40)))
    if kind == 5:
        return rng.choice([0, -1, 1, 2**31, -2**31, 2**63, 1e308, ""])
    if kind == 6:
        return rng.choice(["Infinity", "NaN", "-Infinity"])
    if kind == 7:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {str(_value(rng, depth + 1))[:8]: _value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _grammar(rng):
    if rng.random() < 0.4:
        return rng.choice(NASTY_GRAMMARS)
    return "".join(rng.choice(GRAMMAR_BITS) for _ in range(rng.randrange(1, 30)))


def _base(route, rng):
    if route == "/v1/completions":
        return {"prompt": "the quick brown fox", "max_tokens": rng.choice([1, 4, 12])}
    if route == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": rng.choice([1, 4, 12])}
    if route == "/completion":
        return {"prompt": "the quick brown fox", "n_predict": rng.choice([1, 4, 12])}
    if route == "/tokenize":
        return {"content": "the quick", "with_pieces": rng.random() < 0.5}
    if route == "/detokenize":
        return {"tokens": [1, 2, 3]}
    return {"messages": [{"role": "user", "content": "hi"}]}


FIELDS = ["prompt", "messages", "max_tokens", "n_predict", "temperature", "top_k", "top_p", "min_p", "seed", "stop",
          "stream", "logit_bias", "logit_bias_type", "min_tokens", "grammar", "json_schema", "response_format", "tools",
          "tool_choice", "stream_options", "n", "best_of", "echo", "suffix", "logprobs", "top_logprobs", "n_probs",
          "mirostat", "mirostat_mode", "mirostat_tau", "repeat_penalty", "presence_penalty", "id_slot",
          "return_progress", "timings_per_token", "response_fields", "ignore_eos", "content", "tokens",
          "add_special", "with_pieces", "max_completion_tokens", "model", "typical_p", "n_keep", "samplers"]


def _case(rng):
    """One adversarial request: (path, body bytes, what it is)."""
    route = rng.choice(ROUTES)
    kind = rng.randrange(12)
    body = _base(route, rng)
    if kind == 0:
        return route, bytes(rng.randrange(256) for _ in range(rng.randrange(2000))), "random bytes"
    if kind == 1:
        text = json.dumps(body)
        return route, text[: rng.randrange(len(text))].encode(), "truncated JSON"
    if kind == 2:
        depth = rng.choice([50, 5000, 200000])
        return route, ("[" * depth + "]" * depth).encode() if rng.random() < 0.5 else \
            ('{"a":' * depth + "1" + "}" * depth).encode(), f"JSON nested {depth} deep"
    if kind == 3:
        return route, b'{"prompt": "' + b"x" * (MAX_BODY + 10) + b'"}', "oversized body"
    if kind == 4:
        for _ in range(rng.randrange(1, 4)):
            body[rng.choice(FIELDS)] = _value(rng)
        text = json.dumps(body, allow_nan=True)
        for word in ("\"Infinity\"", "\"NaN\"", "\"-Infinity\""):  # JSON's forbidden literals, raw
            text = text.replace(word, word.strip('"'))
        return route, text.encode(), "random field values"
    if kind == 5:
        body["grammar"] = _grammar(rng)
        body["stream"] = rng.random() < 0.3
        return route, json.dumps(body).encode(), "grammar"
    if kind == 6:
        schema = rng.choice(SCHEMAS)
        if route == "/completion":
            body["json_schema"] = schema
        else:
            route, body = "/v1/chat/completions", _base("/v1/chat/completions", rng)
            body["response_format"] = rng.choice([{"type": "json_object"}, {"type": "json_object", "schema": schema},
                                                  {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
                                                  {"type": "json_schema"}, {"type": "xml"}, "json"])
        body["stream"] = rng.random() < 0.3
        return route, json.dumps(body).encode(), "JSON output"
    if kind == 7:
        route, body = "/v1/chat/completions", _base("/v1/chat/completions", rng)
        params = rng.choice(SCHEMAS)
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        body["tool_choice"] = rng.choice([{"type": "function", "function": {"name": "f"}},
                                          {"type": "function", "function": {"name": "g"}}, "auto", "required", "none",
                                          {"type": "function"}, 7])
        body["stream"] = rng.random() < 0.3
        return route, json.dumps(body).encode(), "tool call"
    if kind == 8:
        body["logit_bias"] = rng.choice([{"5": 1e30}, {"-1": 5}, {"99999": 5}, {"x": 1}, [[5, False]], [["ab", -3]],
                                         {str(i): -100 for i in range(128)}, [[10**30, 1]], {"5": "NaN"}])
        body["min_tokens"] = rng.choice([0, 3, 10**6])
        text = json.dumps(body).replace('"NaN"', "NaN")
        return route, text.encode(), "logit bias"
    if kind == 9:
        prompt = rng.choice(["the quick brown fox " * 2000, "", [], [1, 2, 999999], [-5], [True, 2], [1.5], [[1, 2]],
                             [[1], [2]], [1, "mixed", 3], {"prompt_string": "x", "multimodal_data": ["AAAA"]},
                             "\ud800 lone surrogate", "\u0000" * 100, ["a", "b"]])
        key = {"/tokenize": "content", "/detokenize": "tokens"}.get(route, "prompt")
        if route in ("/v1/chat/completions", "/apply-template"):
            body["messages"] = rng.choice([[{"role": "user", "content": prompt}], [{"role": "nobody"}], [7], "hi",
                                           [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                                           [{"role": "assistant", "content": [{"type": "text"}]}]])
        else:
            body[key] = prompt
        return route, json.dumps(body).encode(), "prompt"
    if kind == 10:
        body.update(temperature=rng.choice([-1, 0, 1e9, 1e-30]), top_k=rng.choice([-5, 0, 10**9]),
                    top_p=rng.choice([0, 1, 2]), seed=rng.choice([-1, 2**64, -2**64]),
                    stop=rng.choice([[""], ["a"] * 500, "x", [1, 2]]), stream=rng.random() < 0.5)
        text = json.dumps(body)
        if rng.random() < 0.5:
            text = text.replace('"temperature": ', '"temperature": NaN, "x_": ', 1)
        return route, text.encode(), "extreme numbers"
    return route, json.dumps(body).encode() + bytes([rng.randrange(256)]), "trailing byte"


def _check_answer(status, headers, data, what):
    assert 200 <= status < 600, what
    if headers.get("content-type", "").startswith("text/event-stream"):
        for block in data.decode().split("\n\n"):
            for line in block.splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    json.loads(line[len("data: "):])  # every event parses, errors included
        return
    body = json.loads(data)  # JSON, whatever the status
    if status >= 400:
        assert isinstance(body, dict) and isinstance(body.get("error"), dict), (what, body)


@pytest.fixture(scope="module")
def server(models_dir, tmp_path_factory):
    model = make_tiny_mtp_model(models_dir / "fuzz-mtp.gguf", seed=51, agreement=0.8)
    srv = Server(model, "--device", "CPU,CPU", "-sm", "tensor", "--spec-type", "draft-mtp", "--phase-aware-workspace",
                 "-c", "256", "-b", "64", "-ub", "64", "--max-body-size", str(MAX_BODY), "-a", "tiny-mtp",
                 log_path=tmp_path_factory.mktemp("srv") / "fuzz.log")
    try:
        yield srv
    finally:
        srv.kill()


def test_no_request_ends_the_server(server):
    rng = random.Random(SEED)
    deadline = time.monotonic() + BUDGET_S
    normal = {"prompt": "the quick brown fox", "max_tokens": 2, "temperature": 0}
    seen = {}
    for i in range(N_CASES):
        if time.monotonic() > deadline:
            break
        path, body, what = _case(rng)
        seen[what] = seen.get(what, 0) + 1
        label = f"case {i} (seed {SEED}): {what} -> {path}: {body[:200]!r}"
        try:
            status, headers, data = server.request("POST", path, body, timeout=120)
        except OSError as e:  # the connection may be closed after a 413 while the body is still sent
            assert what == "oversized body", f"{label}: {e}"
        else:
            _check_answer(status, headers, data, label)
        assert server.alive(), f"{label}\n{server.log()[-4000:]}"
        status, _, data = server.request("GET", "/health", timeout=30)
        assert status == 200 and json.loads(data) == {"status": "ok"}, label
        status, _, data = server.request("POST", "/v1/completions", normal, timeout=120)
        assert status == 200 and json.loads(data)["choices"][0]["text"], (label, data[:300])
    print(f"fuzz seed {SEED}: {sum(seen.values())} cases: {seen}")
    assert sum(seen.values()) >= min(N_CASES, 40)  # the budget allowed a real sample
    assert {"grammar", "JSON output", "tool call"} <= set(seen)
    log = server.log()
    assert "Traceback" not in log and "terminate called" not in log, log[-6000:]
