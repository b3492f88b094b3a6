"""One ``llama_metaws.Llama`` with MTP drafting used from several threads at once, one slot.

Every request runs on the engine's thread (two threads' decodes of the same target, draft and
shared workspace would abort in ggml); with ``n_seq_max=1`` a second thread's request waits for
the slot. A stream may be started, advanced, closed or dropped on any thread: the slot is free
once the request ended, whoever ends it, and every output is the single-threaded one.
(``tests/test_engine.py`` runs several slots at once.)
"""

import threading

import pytest

from llama_metaws import Llama
from llama_metaws_dev.testing import make_tiny_mtp_model

KW = dict(n_ctx=256, n_batch=64, n_ubatch=64, verbose=False)
PROMPTS = ["the quick brown fox jumps", "a", "the quick brown fox jumps " * 6]  # 6 > n_ubatch: 2 ubatches
N_PER_THREAD = 6
MAX_TOKENS = 24
SPLITS = {"none": dict(split_mode="none"), "tensor": dict(split_mode="tensor", devices=["CPU", "CPU"])}


@pytest.fixture(scope="module")
def agree_path(models_dir):
    return str(make_tiny_mtp_model(models_dir / "threads-agree.gguf", seed=31, agreement=0.7))


@pytest.fixture(scope="module", params=sorted(SPLITS))
def llm(request, agree_path):
    with Llama(agree_path, draft="mtp", **KW, **SPLITS[request.param]) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(llm):
    """Each prompt's greedy completion, one request at a time."""
    return {p: _text(llm, p) for p in PROMPTS}


def _text(llm, prompt, **kw):
    return llm.create_completion(prompt, max_tokens=MAX_TOKENS, temperature=0.0, **kw)["choices"][0]["text"]


def _assert_workspace_consistent(llm):
    """After a request: each shared entry holds exactly the larger requirement, none is empty."""
    entries = llm.workspace_stats()
    shared = [e for e in entries if e.shared]
    assert shared, entries
    for e in shared:
        assert e.allocated == max(e.owner_need, e.borrower_need) > 0, e


def _run_threads(n_threads, work):
    errors, start = [], threading.Barrier(n_threads)

    def run(k):
        try:
            start.wait(timeout=60)
            work(k)
        except BaseException as e:  # noqa: BLE001 - reported below with the thread's index
            errors.append((k, e))

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread did not finish: a deadlock?"
    assert not errors, errors


def test_two_threads_get_the_single_threaded_outputs(llm, reference):
    outputs = {0: [], 1: []}

    def work(k):
        for i in range(N_PER_THREAD):
            prompt = PROMPTS[(i + k) % len(PROMPTS)]  # the two threads on different prompts
            outputs[k].append((prompt, _text(llm, prompt)))

    drafted = llm.draft_stats.total.drafted
    _run_threads(2, work)
    for k in (0, 1):
        assert len(outputs[k]) == N_PER_THREAD
        for prompt, text in outputs[k]:
            assert text == reference[prompt], (k, prompt)
    assert llm.draft_stats.total.drafted > drafted  # the requests did draft
    assert _text(llm, PROMPTS[2]) == reference[PROMPTS[2]]  # a final request, alone
    _assert_workspace_consistent(llm)


def test_streaming_and_plain_requests_from_two_threads(llm, reference):
    """A stream holds the instance between its chunks; the other thread's requests wait."""
    streamed, plain = [], []

    def work(k):
        for i in range(3):
            prompt = PROMPTS[(i + k) % len(PROMPTS)]
            if k == 0:
                chunks = llm.create_completion(prompt, max_tokens=MAX_TOKENS, temperature=0.0, stream=True)
                streamed.append((prompt, "".join(c["choices"][0]["text"] for c in chunks)))
            else:
                plain.append((prompt, _text(llm, prompt)))

    _run_threads(2, work)
    for prompt, text in streamed + plain:
        assert text == reference[prompt], prompt
    assert len(streamed) == len(plain) == 3
    _assert_workspace_consistent(llm)


def test_a_second_thread_waits_for_the_slot_and_a_stream_need_not_be_read(llm, reference):
    first, second = PROMPTS[2], PROMPTS[0]
    stream = llm.create_completion(first, max_tokens=MAX_TOKENS, temperature=0.0, stream=True)
    head = next(stream)["choices"][0]["text"]  # the generator is suspended; the request goes on
    result = {}
    other = threading.Thread(target=lambda: result.setdefault("text", _text(llm, second)), daemon=True)
    other.start()
    other.join(timeout=120)  # the slot frees when the first request ends, read or not
    assert not other.is_alive() and result["text"] == reference[second]
    rest = "".join(c["choices"][0]["text"] for c in stream)
    assert head + rest == reference[first]
    assert llm._engine.busy() == 0
    _assert_workspace_consistent(llm)


@pytest.mark.parametrize("how", ["close", "drop"])
def test_an_abandoned_stream_lets_the_other_thread_in(llm, reference, how):
    stream = llm.create_completion(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, stream=True)
    next(stream)
    if how == "close":
        stream.close()
    else:
        del stream  # the last reference: the generator is finalized, the lock released
    result = {}
    other = threading.Thread(target=lambda: result.setdefault("text", _text(llm, PROMPTS[1])), daemon=True)
    other.start()
    other.join(timeout=120)
    assert not other.is_alive(), "the abandoned stream still holds the instance"
    assert result["text"] == reference[PROMPTS[1]]
    assert _text(llm, PROMPTS[2]) == reference[PROMPTS[2]]
    _assert_workspace_consistent(llm)


# --- across threads: a server advances a stream on any free worker thread and a dropped stream
# is closed (or garbage-collected) on any thread; the request ends there all the same.


def _on_thread(fn):
    """Run ``fn`` on a fresh thread, wait for it, return its result (or raise its error)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "the step did not finish: the instance is held"
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.fixture
def unraisable():
    """Errors raised where nobody can catch them (a generator finalized by the collector)."""
    import sys

    seen, previous = [], sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append(u.exc_value)
    yield seen
    sys.unraisablehook = previous


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_stream_started_advanced_and_ended_on_three_threads_frees_the_instance(llm, reference, how,
                                                                                  unraisable):
    import gc

    holder = [llm.create_completion(PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0.0, stream=True)]
    head = _on_thread(lambda: next(holder[0])["choices"][0]["text"])      # takes the instance
    head += _on_thread(lambda: next(holder[0])["choices"][0]["text"])     # another thread goes on
    if how == "close":
        _on_thread(lambda: holder[0].close())
    else:
        def drop():  # the last reference goes on this thread: the collector finalizes it here
            holder.pop()
            gc.collect()
        _on_thread(drop)
    _wait_idle(llm)
    assert not unraisable, unraisable
    assert reference[PROMPTS[2]].startswith(head)
    # the next requests, on yet other threads and on this one, get the instance at once
    assert _on_thread(lambda: _text(llm, PROMPTS[1])) == reference[PROMPTS[1]]
    assert _text(llm, PROMPTS[0]) == reference[PROMPTS[0]]
    _assert_workspace_consistent(llm)


def test_a_stream_advanced_on_alternating_threads_is_the_single_threaded_one(llm, reference):
    stream = llm.create_completion(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, stream=True)
    text = []
    for _ in range(MAX_TOKENS + 1):  # bounded: one chunk per token at most, then the end
        chunk = _on_thread(lambda: next(stream, None))
        if chunk is None:
            break
        text.append(chunk["choices"][0]["text"])
    assert "".join(text) == reference[PROMPTS[0]]
    _wait_idle(llm)


def _wait_idle(llm, timeout=30.0):
    """The engine frees an ended request's slot at its next step."""
    import time

    deadline = time.monotonic() + timeout
    while llm._engine.busy() or llm._engine.waiting:
        assert time.monotonic() < deadline, "the ended stream still holds its slot"
        time.sleep(0.01)
