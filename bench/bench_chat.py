"""Chats side by side: the same requests to llama-server and to ``llama-metaws serve``, diffed.

Both servers run from the same patched tree (llama-server from ``llama-metaws build --tools``) on
the same tiny MTP model, whose ``chat-qwen`` vocabulary holds Qwen's special tokens, with the
vendored Qwen3.5-4B template (``--chat-template-file``, read from the patched tree), MTP drafting
on both. Each request goes to both, plain and streamed, greedy; the answers are compared field
by field: the status, ``finish_reason``, ``content``, ``reasoning_content``, each tool call's
name and arguments (its id only for being there: ids are random), and for a stream its deltas
in order (the ids again only for being there). A tiny model's random text would not begin a
call by itself: the requests carry a ``logit_bias`` toward ``<tool_call>`` and the model's EOS
(see tests/test_server_chat.py).

    python bench/bench_chat.py [--json out.json] [--llama-server PATH]

Prints one line per request and field that differs, and a summary; exits 1 when any differs.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _serve  # noqa: E402
from llama_metaws_dev.testing.chat_tools import TIME, WEATHER  # noqa: E402

ASK = [{"role": "user", "content": "Weather in Paris?"}]


def requests(tokens: dict, eos: int) -> dict:
    """name -> request body (without ``stream``)."""
    steer = {str(tokens["<tool_call>"]): 50, str(eos): 100, str(tokens["<|im_end|>"]): -100,
             str(tokens["<|endoftext|>"]): -100}
    off = {"enable_thinking": False}
    base = {"messages": ASK, "temperature": 0, "max_tokens": 96}
    return {
        "thinking-grammar": dict(base, grammar="root ::= " + json.dumps("thinking it over\n</think>\n\nParis is sunny.")),
        "plain-thinking": dict(base, max_tokens=24),
        "no-thinking": dict(base, max_tokens=24, chat_template_kwargs=off),
        "reasoning-format-none": dict(base, reasoning_format="none",
                                      grammar="root ::= " + json.dumps("hm\n</think>\n\nok")),
        "required-tool": dict(base, tools=[WEATHER], tool_choice="required", chat_template_kwargs=off, logit_bias=steer),
        "auto-tool": dict(base, tools=[WEATHER, TIME], chat_template_kwargs=off, logit_bias=steer),
        "json-schema": dict(base, chat_template_kwargs=off, response_format={
            "type": "json_schema", "json_schema": {"name": "w", "schema": {
                "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}),
        "reasoning-budget": dict(base, max_tokens=24, reasoning_budget_tokens=3),
        "grammar-beside-tools": dict(base, tools=[WEATHER], grammar='root ::= "x"'),
    }


def _without_ids(value):
    value = copy.deepcopy(value)
    for call in value.get("tool_calls") or []:
        call["id"] = bool(call.get("id"))
    return value


def answer(port: int, body: dict, stream: bool) -> dict:
    """The parts of one answer that are compared."""
    if not stream:
        status, doc = _serve.request(port, "POST", "/v1/chat/completions", dict(body, stream=False))
        if status != 200:
            return {"status": status}
        choice = doc["choices"][0]
        msg = choice["message"]
        calls = [{"id": bool(c.get("id")), "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in msg.get("tool_calls") or []]
        return {"status": 200, "finish_reason": choice["finish_reason"], "content": msg.get("content"),
                "reasoning_content": msg.get("reasoning_content"), "tool_calls": calls}
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(dict(body, stream=True)).encode(),
                     headers={"Content-Type": "application/json"})
        res = conn.getresponse()
        if res.status != 200:
            return {"status": res.status}
        deltas, finish = [], None
        for line in res.read().decode().splitlines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                for tc in delta.get("tool_calls") or []:
                    if "id" in tc:
                        tc["id"] = bool(tc["id"])
                if delta:
                    deltas.append(delta)
                finish = choice.get("finish_reason") or finish
        return {"status": 200, "finish_reason": finish, "deltas": deltas}
    finally:
        conn.close()


def diff(a: dict, b: dict) -> list:
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write every answer and difference here")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--llama-server", metavar="PATH",
                   help="a llama-server built from the same patched tree (default: this build's, from --tools)")
    a = p.parse_args(argv)

    from llama_metaws_dev import tools_build
    from llama_metaws.native.runtime import require_build
    from llama_metaws_dev.testing import EOS_TOKEN, N_VOCAB, make_tiny_mtp_model
    from llama_metaws.demo.vocab import chat_vocab

    tools = {"llama-server": Path(a.llama_server)} if a.llama_server else tools_build.find_tools()
    if tools is None:
        print("no llama-server for this build: run `llama-metaws build --tools` first", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="bench_chat-"))
    model = make_tiny_mtp_model(work / "chat-qwen-mtp.gguf", vocab="chat-qwen", seed=7)
    template = require_build().src_dir / "models" / "templates" / "Qwen3.5-4B.jinja"
    tokens = {t: i for i, t in enumerate(chat_vocab("qwen", N_VOCAB)[0])}
    flags = ["-m", str(model), "-c", "4096", "-np", "1", "--jinja", "--chat-template-file", str(template),
             "--spec-type", "draft-mtp", "-t", "2"]
    answers = {}
    # llama-server caps a slot's context at the model's training context (the tiny model's 256,
    # shorter than a prompt with tools): the override lifts it to the -c both servers get
    lift = ["--override-kv", "qwen35.context_length=int:4096"]
    for name, cmd in (("llama-server", [str(tools["llama-server"]), "--host", "127.0.0.1", "-ngl", "0", *lift]),
                      ("serve", [sys.executable, "-m", "llama_metaws", "serve"])):
        port = _serve.free_port()
        with _serve.Server(name, [*cmd, *flags, "--port", str(port)], port, None, work / f"{name}.log",
                           start_timeout=a.timeout):
            for req, body in requests(tokens, EOS_TOKEN).items():
                for stream in (False, True):
                    answers.setdefault(f"{req}{' (stream)' if stream else ''}", {})[name] = answer(port, body, stream)
    n_diff = 0
    report = {}
    for req, by in answers.items():
        d = diff(by["llama-server"], by["serve"])
        report[req] = {"answers": by, "differences": [list(x) for x in d]}
        for field, ours_not, theirs in d:
            n_diff += 1
            print(f"{req}: {field}: llama-server {json.dumps(ours_not)[:300]} | serve {json.dumps(theirs)[:300]}")
    print(f"{len(answers)} answers compared, {n_diff} fields differ (server logs in {work})")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if n_diff else 0


if __name__ == "__main__":
    raise SystemExit(main())
