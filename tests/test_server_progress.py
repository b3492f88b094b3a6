"""llama-server's prompt progress and its lists of prompts on ``llama-metaws serve``, as a client
reads them: ``return_progress`` gives one ``prompt_progress`` report once the prompt is on a slot
and one after each batch of it (``-b``), on ``/completion``, OpenAI's chat and completions
streams (through the official ``openai`` client) and the Responses API's ``response.in_progress``
events, with the prompt's ``timings`` under ``timings_per_token``; a ``/completion`` whose
``prompt`` is a list of prompts is answered as a list (streamed: each event names its prompt's
``index``), a malformed list (or one longer than may run or wait at once) is a 400.

One server: a characters vocabulary (a token per character), ``-b 64``, two slots.
"""

import json

import pytest

from llama_metaws_dev.testing import make_tiny_model
from serving import Server, llama_error

N_BATCH = 64
TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")
LONG = "This is a test. " * 9  # 144 characters: three batches of 64 with its BOS
SHORT = "the quick brown fox"


@pytest.fixture(scope="module")
def server(models_dir, tmp_path_factory):
    model = make_tiny_model(models_dir / "progress-chars.gguf", seed=54, vocab="chars", chat_template=TEMPLATE)
    srv = Server(model, "-np", "2", "-c", "1024", "-b", str(N_BATCH), "-ub", str(N_BATCH), "--temp", "0",
                 log_path=tmp_path_factory.mktemp("progress") / "progress.log")
    yield from srv.running()


def _batches(cache: int, total: int) -> list:
    """The ``processed`` figures llama-server reports: where the prompt starts, then each batch's end."""
    return [cache] + list(range(cache + N_BATCH, total, N_BATCH)) + [total]


def _check_timings(reports, timings):
    """The prompt's timings on each report: nothing before the first batch, never going backwards."""
    assert all(t["predicted_n"] == 0 and t["predicted_ms"] == 0.0 for t in timings)
    assert timings[0]["prompt_n"] == 0 and timings[0]["prompt_ms"] == 0.0 and timings[0]["prompt_per_second"] == 0.0
    assert [t["prompt_n"] for t in timings] == [p["processed"] - p["cache"] for p in reports]
    ms = [t["prompt_ms"] for t in timings]
    assert ms == sorted(ms) and ms[-1] > 0
    assert [p["time_ms"] for p in reports] == sorted(p["time_ms"] for p in reports)


def test_completion_reports_the_prompt_once_on_its_slot_and_after_each_batch(server):
    n = len(server.json("POST", "/tokenize", {"content": LONG, "add_special": True})[1]["tokens"])
    assert n > 2 * N_BATCH
    body = {"prompt": LONG, "n_predict": 3, "stream": True, "return_progress": True, "timings_per_token": True,
            "cache_prompt": False}
    events = server.events("/completion", body)
    progress = [e for e in events if "prompt_progress" in e]
    reports = [e["prompt_progress"] for e in progress]
    assert [p["processed"] for p in reports] == _batches(0, n) == [0, 64, 128, n]
    assert all(p["total"] == n and p["cache"] == 0 for p in reports)
    assert events[:len(progress)] == progress and all(e["content"] == "" and not e["stop"] for e in progress)
    _check_timings(reports, [e["timings"] for e in progress])
    assert [e["tokens_evaluated"] for e in progress] == [n] * 4 and events[-1]["stop"] is True
    # again, reusing what the slot holds: all but the last token is cached, one batch evaluates it
    reports = [e["prompt_progress"] for e in server.events("/completion", dict(body, cache_prompt=True))
               if "prompt_progress" in e]
    assert [(p["cache"], p["processed"]) for p in reports] == [(n - 1, n - 1), (n - 1, n)]
    # without return_progress, none
    assert not [e for e in server.events("/completion", dict(body, return_progress=False)) if "prompt_progress" in e]


def test_openai_streams_carry_a_progress_chunk_per_batch_through_the_openai_client(server):
    client = server.client()
    telemetry = {"return_progress": True, "timings_per_token": True, "cache_prompt": False}
    chat = list(client.chat.completions.create(
        model="x", max_tokens=3, stream=True, stream_options={"include_usage": True}, extra_body=telemetry,
        messages=[{"role": "user", "content": LONG}]))
    text = list(client.completions.create(model="x", prompt=LONG, max_tokens=3, stream=True,
                                          stream_options={"include_usage": True}, extra_body=telemetry))
    for chunks in (chat, text):
        progress = [c for c in chunks if "prompt_progress" in (c.model_extra or {})]
        reports = [c.model_extra["prompt_progress"] for c in progress]
        n = chunks[-1].usage.prompt_tokens
        assert [p["processed"] for p in reports] == _batches(0, n) and len(reports) >= 3
        assert chunks[:len(progress)] == progress  # before any token
        _check_timings(reports, [c.model_extra["timings"] for c in progress])
        assert len({c.id for c in chunks}) == 1  # one stream, one id
    for c in (c for c in chat if "prompt_progress" in (c.model_extra or {})):
        assert c.choices[0].delta.role == "assistant" and c.choices[0].delta.content is None
    for c in (c for c in text if "prompt_progress" in (c.model_extra or {})):
        assert c.choices[0].text == "" and c.choices[0].finish_reason is None


def test_responses_stream_reports_progress_as_in_progress_events_and_timings_on_deltas(server):
    events = list(server.client().responses.create(
        model="x", input=LONG, max_output_tokens=3, stream=True,
        extra_body={"return_progress": True, "timings_per_token": True, "cache_prompt": False}))
    kinds = [e.type for e in events]
    progress = [e for e in events if "prompt_progress" in (e.model_extra or {})]
    assert kinds[0] == "response.created" and all(e.type == "response.in_progress" for e in progress)
    assert kinds[1:1 + len(progress)] == ["response.in_progress"] * len(progress)  # the first carries one
    reports = [e.model_extra["prompt_progress"] for e in progress]
    done = events[-1]
    assert done.type == "response.completed"
    n = done.response.usage.input_tokens
    assert [p["processed"] for p in reports] == _batches(0, n)
    _check_timings(reports, [e.model_extra["timings"] for e in progress])
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and all("predicted_per_second" in e.model_extra["timings"] for e in deltas)
    assert done.model_extra["timings"]["prompt_n"] == n and done.model_extra["timings"]["predicted_n"] >= 1


def test_a_list_of_prompts_is_answered_as_a_list_in_order(server):
    ids = server.json("POST", "/tokenize", {"content": SHORT, "add_special": True})[1]["tokens"]
    alone = server.json("POST", "/completion", {"prompt": SHORT, "n_predict": 6})[1]
    other = server.json("POST", "/completion", {"prompt": "hello world", "n_predict": 6})[1]
    prompts = [SHORT, ids, "hello world", {"prompt_string": SHORT}, ids[:3] + [SHORT[2:]]]
    status, res = server.json("POST", "/completion", {"prompt": prompts, "n_predict": 6})
    assert status == 200 and isinstance(res, list) and [r["index"] for r in res] == [0, 1, 2, 3, 4]
    assert [r["content"] for r in res] == [alone["content"]] * 2 + [other["content"]] + [alone["content"]] * 2
    assert [r["tokens_evaluated"] for r in res[:4]] == [len(ids)] * 2 + [other["tokens_evaluated"], len(ids)]
    assert all(r["stop"] is True and r["tokens_predicted"] == 6 for r in res)
    # a list of one prompt is one answer, as llama-server gives it
    status, res = server.json("POST", "/completion", {"prompt": [SHORT], "n_predict": 6})
    assert status == 200 and res["content"] == alone["content"]
    # streamed: the prompts' events as they come, each naming its prompt, each prompt ending once
    events = server.events("/completion", {"prompt": [SHORT, "hello world"], "n_predict": 6, "stream": True})
    for index, want in ((0, alone), (1, other)):
        mine = [e for e in events if e["index"] == index]
        assert "".join(e["content"] for e in mine) == want["content"]
        assert [e["stop"] for e in mine].count(True) == 1 and mine[-1]["stop"] is True


@pytest.mark.parametrize("prompt, where", [
    ([], "empty list"), ([[1, 2], 2.5], "prompt[1]"), ([["a", "b"]], "prompt[0]"), ([{"text": "x"}], "prompt[0]"),
    (["ok", [10 ** 9]], "prompt[1]"), (["ok", [1, "x" * 600]], "exceeds the available context size"),
    (["ok"] * 19, "19 prompts in one request: this server runs or queues at most 18")])  # -np 2, --queue-size 16
def test_a_malformed_list_of_prompts_is_a_400_naming_the_prompt(server, prompt, where):
    status, res = server.json("POST", "/completion", {"prompt": prompt, "n_predict": 2})
    assert status == 400 and where in llama_error(res, 400)["message"], res
    assert server.json("POST", "/completion", {"prompt": SHORT, "n_predict": 1})[0] == 200


def test_the_stream_of_a_list_ends_after_every_prompt_ended(server):
    status, _, data = server.request("POST", "/completion", {"prompt": [LONG, SHORT, LONG], "n_predict": 4,
                                                              "stream": True, "return_progress": True})
    assert status == 200
    events = [json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: ")]
    assert sorted(e["index"] for e in events if e["stop"]) == [0, 1, 2]
    for index in range(3):
        reports = [e["prompt_progress"] for e in events if e["index"] == index and "prompt_progress" in e]
        assert reports and reports[-1]["processed"] == reports[-1]["total"]
