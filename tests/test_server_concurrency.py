"""``llama-metaws serve -np 4`` with the official ``openai`` client: four requests in the same
engine steps, a fifth queued, a dropped stream and a malformed request in the middle of it all;
every output equals the request's solo one.

One server: the seed's configuration (MTP drafting, tensor split over CPU,CPU, the workspace)
with four slots, killed by its PID when the module ends.
"""

import json
import threading

import openai
import pytest

from llama_metaws_dev.testing import make_tiny_mtp_model
from serving import Server

PROMPTS = ["the quick brown fox", "1 2 3 4 5 6", "hello world " * 20, "a b", "once upon a time there"]
MAX_TOKENS = [48, 40, 32, 44, 36]


@pytest.fixture(scope="module")
def server(models_dir, tmp_path_factory):
    model = make_tiny_mtp_model(models_dir / "concurrency-agree.gguf", seed=61, agreement=0.8)
    srv = Server(model, "--device", "CPU,CPU", "-sm", "tensor", "--spec-type", "draft-mtp",
                 "--spec-draft-n-max", "3", "--phase-aware-workspace", "-np", "4", "-c", "1024",
                 "-b", "64", "-ub", "64", "--metrics", "-a", "tiny", log_path=tmp_path_factory.mktemp("srv") / "np4.log")
    yield from srv.running()


@pytest.fixture(scope="module")
def solo(server):
    """Each prompt alone on the server, one after the other."""
    client = server.client()
    return [_text(client, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]


def _text(client, prompt, max_tokens):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0).choices[0].text


def _stream(client, prompt, max_tokens, stop_after=None):
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True)
    out = []
    for i, c in enumerate(chunks):
        out.append(c.choices[0].text)
        if stop_after is not None and i + 1 >= stop_after:
            chunks.response.close()  # the client goes away mid-stream
            break
    return "".join(out)


def _all_at_once(fns):
    out, errors, start = [None] * len(fns), [], threading.Barrier(len(fns))

    def run(i):
        try:
            start.wait(timeout=60)
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((i, e))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a request did not finish"
    assert not errors, errors
    return out


def test_four_streams_at_once_equal_their_solo_outputs_and_a_fifth_waits(server, solo):
    client = server.client()
    got = _all_at_once([lambda i=i: _stream(client, PROMPTS[i], MAX_TOKENS[i]) for i in range(5)])
    assert got == solo  # no 503 for the fifth: it waited for a slot
    m = server.metrics()
    assert m["llamametaws:slots"] == 4
    assert m["llamametaws:slots_busy_max"] == 4  # four requests ran in the same steps, never five
    assert m["llamacpp:requests_processing"] == 0 and m["llamacpp:requests_deferred"] == 0
    assert m["llamacpp:spec_decode_num_draft_tokens_total"] > 0


def test_a_dropped_stream_leaves_the_others_unchanged(server, solo):
    client = server.client()
    fns = [lambda i=i: _stream(client, PROMPTS[i], MAX_TOKENS[i]) for i in range(3)]
    fns.append(lambda: _stream(client, PROMPTS[3], MAX_TOKENS[3], stop_after=2))
    got = _all_at_once(fns)
    assert got[:3] == solo[:3]
    assert solo[3].startswith(got[3])
    # the dropped request's slot serves the next request
    assert _text(client, PROMPTS[4], MAX_TOKENS[4]) == solo[4]
    assert all(not s["is_processing"] for s in server.json("GET", "/slots")[1])


def test_a_malformed_request_in_the_middle_of_it_all(server, solo):
    client = server.client()

    def malformed():
        status, _headers, _body = server.request("POST", "/v1/completions", b"{\"prompt\": \"x\", \"max_tokens\": ")
        return status

    def bad_value():
        try:
            client.completions.create(model="tiny", prompt="x", max_tokens=-3)
        except openai.BadRequestError as e:
            return e.status_code
        return 200

    fns = [lambda i=i: _stream(client, PROMPTS[i], MAX_TOKENS[i]) for i in range(3)] + [malformed, bad_value]
    got = _all_at_once(fns)
    assert got[:3] == solo[:3]
    assert got[3] == 400 and got[4] == 400
    assert server.alive() and _text(client, PROMPTS[3], MAX_TOKENS[3]) == solo[3]


def test_cache_prompt_false_evaluates_the_whole_prompt(server, solo):
    # llama-server's cache_prompt, on its /completion and on the OpenAI routes (the official
    # client's extra_body): a slot that holds the prompt reuses it unless told not to
    prompt, n = PROMPTS[2], MAX_TOKENS[2]
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "id_slot": 1}
    # the first evaluates it whole whatever slot 1 held before (an earlier test may have left it there)
    first = server.json("POST", "/completion", dict(body, cache_prompt=False))[1]
    again = server.json("POST", "/completion", body)[1]
    fresh = server.json("POST", "/completion", dict(body, cache_prompt=False))[1]
    assert first["content"] == again["content"] == fresh["content"] == solo[2]
    assert again["timings"]["cache_n"] > 0 and again["timings"]["prompt_n"] < first["timings"]["prompt_n"]
    assert fresh["timings"]["cache_n"] == 0 and fresh["timings"]["prompt_n"] == first["timings"]["prompt_n"]
    client = server.client()
    for cache, cached in ((True, True), (False, False)):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                      extra_body={"cache_prompt": cache})
        assert r.choices[0].text == solo[2]
        assert (r.usage.prompt_tokens_details.cached_tokens > 0) is cached
    status, _h, _b = server.request("POST", "/v1/completions",
                                    json.dumps({"prompt": "x", "cache_prompt": "no"}).encode())
    assert status == 400
