"""Requests submitted and cancelled from many threads while others run, on one ``Llama``.

The engine's thread reads the queue of waiting requests and of exclusive calls while other
threads append to them (``create_completion`` from any thread, ``llm.slots()`` and the stats
from the server's threads); a deque iterated while another thread appends raises, and before
the engine read them under its lock that one error failed every request of the step. Here
twelve threads submit greedy completions and streams they close after a chunk or two (a cancel
of a running request), six more ask for the workspace's figures all the while (each a call run
on the engine's thread between two steps), and the interpreter switches threads as often as it
can, so that a submit lands inside the engine's reading of the queue: no request may fail, and
every finished one equals its solo run. Three rounds: on the code before the fix one round
failed in 4 of 6 runs (``RuntimeError: deque mutated during iteration``), three rounds in every
run tried.
"""

from __future__ import annotations

import sys
import threading

import pytest

from llama_metaws import Llama
from llama_metaws_dev.testing import make_tiny_mtp_model

KW = dict(n_ctx=4 * 128, n_batch=32, n_ubatch=32, verbose=False)
PROMPTS = ["the quick brown fox", "a", "jumps over the lazy dog " * 3, "once upon a time"]
MAX_TOKENS = 6
N_THREADS = 12
N_WATCHERS = 6
PER_THREAD = 12
ROUNDS = 3
SWITCH_INTERVAL_S = 1e-6  # the interpreter's default is 5 ms: a submit rarely lands mid-iteration


@pytest.fixture(scope="module")
def path(models_dir):
    return str(make_tiny_mtp_model(models_dir / "submits.gguf", seed=5, agreement=0.7))


def _text(llm, prompt):
    return llm.create_completion(prompt, max_tokens=MAX_TOKENS, temperature=0.0)["choices"][0]["text"]


def _round(llm, solo):
    """One round of submitters and watchers at once; asserts every request ran and equals solo."""
    errors, got, cancelled = [], [], []
    done = threading.Event()
    start = threading.Barrier(N_THREADS + N_WATCHERS)

    def submitter(k):
        try:
            start.wait(timeout=60)
            for i in range(PER_THREAD):
                prompt = PROMPTS[(k + i) % len(PROMPTS)]
                if (k + i) % 3 == 0:  # a stream dropped after its first chunks: cancelled while it runs
                    stream = llm.create_completion(prompt, max_tokens=40, temperature=0.0, stream=True)
                    for _ in range(1 + i % 2):
                        next(stream)
                    stream.close()
                    cancelled.append(prompt)
                else:
                    got.append((prompt, _text(llm, prompt)))
        except BaseException as e:  # noqa: BLE001 - reported below with the thread's index
            errors.append((k, repr(e)))

    def watcher():
        start.wait(timeout=60)
        while not done.is_set():  # calls queued for the engine's thread between two steps
            try:
                llm.workspace_stats()
            except BaseException as e:  # noqa: BLE001
                errors.append(("workspace_stats", repr(e)))
                return

    old = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        threads = [threading.Thread(target=submitter, args=(k,), daemon=True) for k in range(N_THREADS)]
        watchers = [threading.Thread(target=watcher, daemon=True) for _ in range(N_WATCHERS)]
        for t in threads + watchers:
            t.start()
        for t in threads:
            t.join(timeout=600)
        done.set()
        for t in watchers:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in threads + watchers), "a thread did not finish: a deadlock?"
    assert not errors, errors
    assert len(got) + len(cancelled) == N_THREADS * PER_THREAD and cancelled
    wrong = [(p, text) for p, text in got if text != solo[p]]
    assert not wrong, (wrong, solo)


def test_submits_and_cancels_from_many_threads_never_fail_a_running_request(path):
    with Llama(path, draft="mtp", n_seq_max=4, **KW) as llm:
        solo = {p: _text(llm, p) for p in PROMPTS}  # one at a time: each alone on the engine
        for _ in range(ROUNDS):
            _round(llm, solo)
        assert llm._engine.peak_busy == 4  # the requests ran side by side
        assert llm._engine.busy() == 0 and not llm._engine.waiting


def test_a_request_cancelled_while_it_runs_finishes_as_llama_server_reports_it(path):
    """llama-server reports "stop" only for an end-of-generation token or a stop word; a task
    cancelled before either keeps its default, "length". Here the engine's request of a running
    stream is cancelled as a server's shutdown cancels it."""
    with Llama(path, draft="mtp", n_seq_max=2, **KW) as llm:
        stream = llm.create_completion(PROMPTS[0], max_tokens=200, temperature=0.0, stream=True)
        first = next(stream)
        assert first["choices"][0]["finish_reason"] is None
        running = [s.request for s in llm._engine.slots if s.request is not None]
        assert len(running) == 1
        running[0].cancel("shutdown")
        rest = list(stream)
        assert rest and rest[-1]["choices"][0]["finish_reason"] == "length", rest[-1]
        n = sum(len(c["choices"][0]["text"]) > 0 for c in [first] + rest)
        assert n < 200  # it ended early, by the cancel
