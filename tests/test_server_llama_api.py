"""llama-server's own API on ``llama-metaws serve``, as tools/server/README.md documents it: what a
tool written for llama-server sends, raw HTTP (no client library), and its answers' shapes.

One server, started with llama-server's flags: ``--chat-template-file``, ``-ctk``/``-ctv``,
``-kvu`` with ``-np 2``, ``--temp``, ``-n``, ``--jinja``.
"""

import json

import pytest

from llama_metaws import cli
from llama_metaws.cli import flags
from llama_metaws_dev.testing import make_tiny_model
from serving import Server, llama_error

TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")
PROMPT = "the quick brown fox"
N_DEFAULT = 8  # the server's -n


@pytest.fixture(scope="module")
def server(models_dir, tmp_path_factory):
    model = make_tiny_model(models_dir / "llama-api-chars.gguf", seed=52, vocab="chars")
    tmp = tmp_path_factory.mktemp("srv")
    (tmp / "template.jinja").write_text(TEMPLATE)
    srv = Server(model, "-a", "tiny-llama", "--chat-template-file", str(tmp / "template.jinja"), "--jinja",
                 "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "-kvu", "-np", "2", "-c", "512", "-b", "128",
                 "-ub", "128", "--temp", "0", "-n", str(N_DEFAULT), log_path=tmp / "llama-api.log")
    yield from srv.running()


@pytest.fixture(scope="module")
def reference(server):
    status, res = server.json("POST", "/completion", {"prompt": PROMPT, "return_tokens": True})
    assert status == 200, res
    return res


def test_completion_answers_in_llama_servers_shape_with_the_servers_defaults(server, reference):
    res = reference
    assert {"index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
            "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
            "tokens_cached", "timings"} <= set(res)
    assert res["stop"] is True and res["model"] == "tiny-llama" and res["id_slot"] == 0
    assert res["tokens_predicted"] == N_DEFAULT and res["stop_type"] == "limit"  # -n
    assert len(res["tokens"]) == N_DEFAULT and res["content"]
    assert res["generation_settings"]["temperature"] == 0 and res["generation_settings"]["n_predict"] == N_DEFAULT
    assert {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second"} <= set(res["timings"])
    # the same greedy text as OpenAI's route (--temp 0 there too; max_tokens given)
    status, oai = server.json("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": N_DEFAULT})
    assert status == 200 and oai["choices"][0]["text"] == res["content"]
    # /completions is llama-server's route too, and max_tokens its other name for n_predict
    status, res2 = server.json("POST", "/completions", {"prompt": PROMPT, "max_tokens": 3})
    assert status == 200 and res2["tokens_predicted"] == 3 and "choices" not in res2
    # without return_tokens, no tokens
    assert server.json("POST", "/completion", {"prompt": PROMPT})[1]["tokens"] == []


def test_a_completion_stream_is_data_events_ending_with_stop_and_no_done(server, reference):
    events = server.events("/completion", {"prompt": PROMPT, "stream": True})
    assert "[DONE]" not in events
    *parts, last = events
    assert all(e["stop"] is False for e in parts) and last["stop"] is True and last["content"] == ""
    assert "".join(e["content"] for e in parts) == reference["content"]
    assert [t for e in parts for t in e["tokens"]] == reference["tokens"]
    assert last["timings"]["predicted_n"] == N_DEFAULT and last["stop_type"] == "limit"
    assert "timings" not in parts[0] and "prompt_progress" not in parts[0]


def test_return_progress_and_timings_per_token(server):
    events = server.events("/completion", {"prompt": PROMPT, "stream": True, "return_progress": True,
                                           "timings_per_token": True, "n_predict": 4})
    reports = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    first, last = reports[0], reports[-1]  # on its slot, then after its one batch (-b 128)
    assert len(reports) == 2 and first["processed"] == first["cache"] == last["cache"] < last["processed"]
    assert last["total"] == last["processed"] == events[0]["tokens_evaluated"] and last["time_ms"] >= 0
    content = [e for e in events[2:] if not e["stop"]]
    assert content and all("timings" in e and e["timings"]["predicted_n"] == e["tokens_predicted"] for e in content)


def test_prompts_as_tokens_and_mixed_and_id_slot(server, reference):
    status, tok = server.json("POST", "/tokenize", {"content": PROMPT})
    assert status == 200
    ids = tok["tokens"]
    for slot, prompt in ((0, ids), (1, ids[:2] + [server.json("POST", "/detokenize", {"tokens": ids[2:]})[1]["content"]])):
        status, res = server.json("POST", "/completion", {"prompt": prompt, "id_slot": slot})
        assert status == 200 and res["tokens_evaluated"] >= len(ids) - 1
        assert res["id_slot"] == slot  # it ran on the slot asked for
    status, res = server.json("POST", "/completion", {"prompt": ids, "id_slot": -1})
    assert status == 200 and res["content"] == reference["content"]
    status, res = server.json("POST", "/completion", {"prompt": PROMPT, "id_slot": 3})
    assert status == 400 and "slots 0 to 1" in llama_error(res, 400)["message"]
    status, res = server.json("POST", "/completion", {"prompt": ["one", "two"]})  # two prompts, two answers
    assert status == 200 and [r["index"] for r in res] == [0, 1] and all(r["stop"] for r in res)


def test_stop_words_n_predict_zero_json_schema_and_logit_bias(server, reference):
    word = next(c for c in reference["content"][2:] if c.strip())
    status, res = server.json("POST", "/completion", {"prompt": PROMPT, "stop": [word]})
    assert status == 200 and res["stop_type"] == "word" and res["stopping_word"] == word
    assert res["content"] == reference["content"][:reference["content"].index(word)]
    status, res = server.json("POST", "/completion", {"prompt": PROMPT, "n_predict": 0})
    assert status == 200 and res["content"] == "" and res["tokens_predicted"] == 0
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    status, res = server.json("POST", "/completion", {"prompt": PROMPT, "json_schema": schema, "n_predict": 32})
    assert status == 200 and res["stop_type"] == "eos" and isinstance(json.loads(res["content"])["ok"], bool)
    # logit_bias in llama-server's array form; false: never
    status, res = server.json("POST", "/completion", {"prompt": PROMPT, "logit_bias": [[reference["tokens"][0], False]],
                                                      "return_tokens": True})
    assert status == 200 and res["tokens"][0] != reference["tokens"][0]


def test_tokenize_detokenize_and_apply_template(server):
    status, res = server.json("POST", "/tokenize", {"content": "a{b", "with_pieces": True})
    assert status == 200 and "".join(t["piece"] for t in res["tokens"]).strip() == "a{b"
    assert all(set(t) == {"id", "piece"} for t in res["tokens"])
    ids = [t["id"] for t in res["tokens"]]
    assert server.json("POST", "/detokenize", {"tokens": ids})[1]["content"].strip() == "a{b"
    status, res = server.json("POST", "/detokenize", {"tokens": [5, 100000]})
    assert status == 400 and "outside the vocabulary" in llama_error(res, 400)["message"]
    status, res = server.json("POST", "/apply-template", {"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert status == 200 and res == {"prompt": "<<system>>be brief\n<<user>>hi\n<<assistant>>"}


def test_props_and_slots_tell_the_truth(server, reference):
    status, props = server.json("GET", "/props")
    assert status == 200
    assert props["total_slots"] == 2  # -np 2: two requests run at once
    assert props["model_alias"] == "tiny-llama" and props["chat_template"] == TEMPLATE
    assert props["default_generation_settings"]["n_ctx"] == 512
    assert props["default_generation_settings"]["params"]["temperature"] == 0
    assert props["default_generation_settings"]["params"]["n_predict"] == N_DEFAULT
    assert props["endpoint_slots"] is True and props["modalities"]["vision"] is False
    status, slots = server.json("GET", "/slots")
    assert status == 200 and [s["id"] for s in slots] == [0, 1]
    assert not any(s["is_processing"] or s["speculative"] for s in slots)
    before = max(s["id_task"] for s in slots)
    server.json("POST", "/completion", {"prompt": PROMPT, "n_predict": 3})
    slot = max(server.json("GET", "/slots")[1], key=lambda s: s["id_task"])  # the slot it ran on
    assert slot["id_task"] > before and slot["params"]["n_predict"] == 3
    # idle again: the finished task's budget does not stay on the slot (llama-server's)
    assert slot["next_token"][0]["n_decoded"] == 0 and slot["next_token"][0]["n_remain"] == -1
    assert slot["n_past"] >= slot["n_prompt_tokens"]  # what the slot holds for the next request
    assert slot["params"]["n_predict"] == 3
    assert server.json("GET", "/slots?fail_on_no_slot=1")[0] == 200


def test_cors_preflight_and_origin(server):
    status, headers, body = server.request("OPTIONS", "/v1/chat/completions",
                                           headers={"Origin": "http://localhost:5173",
                                                    "Access-Control-Request-Method": "POST"})
    assert status == 200 and body == b""
    assert headers["access-control-allow-origin"] == "http://localhost:5173"
    assert "POST" in headers["access-control-allow-methods"] and headers["access-control-allow-headers"] == "*"
    status, headers, _ = server.request("GET", "/health", headers={"Origin": "http://example.org"})
    assert status == 200 and headers["access-control-allow-origin"] == "http://example.org"
    assert headers["access-control-allow-credentials"] == "true"


def test_errors_of_llama_servers_routes_are_in_its_shape(server):
    status, res = server.json("POST", "/completion", {"prompt": PROMPT, "n_predict": "many"})
    assert llama_error(res, 400)["type"] == "invalid_request_error" and status == 400
    status, res = server.json("POST", "/completion", {"prompt": "x " * 600})
    err = llama_error(res, 400)
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == 512 and err["n_prompt_tokens"] > 512
    status, res = server.json("POST", "/completion", {"prompt": PROMPT, "grammar": "root ::= ["})
    assert status == 400 and "unexpected end of input" in llama_error(res, 400)["message"]
    status, res = server.json("POST", "/completion", {"prompt": PROMPT, "dry_multiplier": 0.8})
    assert status == 400 and "dry_multiplier" in llama_error(res, 400)["message"]
    status, res = server.json("POST", "/completion", {"prompt": PROMPT, "cache_prompt": True, "samplers": ["top_k"],
                                                      "some_new_field": 1})
    assert status == 200  # llama-server's ignored fields, and fields it does not know


def test_kv_unified_lets_one_sequence_use_the_whole_context(server):
    """-np 2 splits the context in two unless -kvu: a 400-token prompt fits 512, not 256."""
    status, res = server.json("POST", "/completion", {"prompt": list(range(10, 110)) * 4, "n_predict": 2})
    assert status == 200 and res["tokens_evaluated"] == 400 and res["tokens_predicted"] == 2


def test_llama_servers_flags_map_to_the_model_and_the_others_are_refused_by_name(capsys):
    p = cli.make_parser()
    args = p.parse_args(["serve", "-m", "x.gguf", "-ctk", "q8_0", "-ctv", "f16", "-kvu", "--temp", "0.3", "-n", "12",
                         "--jinja", "--chat-template", "chatml", "--no-slots", "--max-body-size", "2M"])
    kw = flags.llama_kwargs(args)
    assert kw["type_k"] == 8 and kw["type_v"] == 1 and kw["kv_unified"] is True
    assert (args.temp, args.n_predict, args.chat_template, args.slots, args.max_body_size) == (0.3, 12, "chatml", False,
                                                                                              2 << 20)
    plain = flags.llama_kwargs(p.parse_args(["serve", "-m", "x.gguf"]))
    assert "type_k" not in plain and "context_shift" not in plain
    assert plain["kv_unified"] is True and plain["n_seq_max"] == 4  # -np auto: 4 slots, one KV
    per_slot = flags.llama_kwargs(p.parse_args(["serve", "-m", "x.gguf", "-np", "2"]))
    assert "kv_unified" not in per_slot and per_slot["n_seq_max"] == 2
    shift = flags.llama_kwargs(p.parse_args(["serve", "-m", "x.gguf", "--context-shift", "--spec-synth-rates",
                                             "0.8, 0.5", "--spec-synth-len", "2"]))
    assert shift["context_shift"] is True and shift["draft_synth_rates"] == [0.8, 0.5]
    assert shift["draft_synth_len"] == 2.0 and plain["draft_synth_rates"] is None
    # the chat layer's flags, as llama-server's
    chat = flags.chat_options(p.parse_args(["serve", "-m", "x.gguf", "--no-jinja", "--reasoning-format", "none",
                                            "-rea", "off", "--chat-template-kwargs", '{"x": 1}',
                                            "--reasoning-budget", "5", "--reasoning-budget-message", "enough"]))
    assert (chat.use_jinja, chat.reasoning_format, chat.reasoning) == (False, "none", 0)
    assert (chat.reasoning_budget, chat.reasoning_budget_message) == (5, "enough")
    assert chat.chat_template_kwargs == {"x": "1", "enable_thinking": "false"}
    default = flags.chat_options(p.parse_args(["serve", "-m", "x.gguf"]))
    assert (default.use_jinja, default.reasoning_format, default.reasoning, default.chat_template_kwargs) == \
        (True, "deepseek", -1, {})
    import gguf

    assert {n: int(gguf.GGMLQuantizationType[n.upper()]) for n in flags.KV_CACHE_TYPES} == flags.KV_CACHE_TYPES
    for argv, words in ((["--lora", "a.gguf"], "adapters"),
                        (["-ctk", "q3_k"], "not a KV cache type"), (["--props"], "GET /props")):
        with pytest.raises(SystemExit):
            p.parse_args(["serve", "-m", "x.gguf", *argv])
        err = capsys.readouterr().err
        assert argv[0] in err and words in err, err
