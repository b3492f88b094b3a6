"""The engine: one step for every slot, MTP drafted across them (``llama_metaws.engine``).

First over low-level contexts, as the engine takes them: greedy output is the target's, the
drafts are the MTP head's chain, acceptance follows the head, bad arguments are ValueErrors and
a failed decode names its context and phase. Then through ``Llama`` from several threads, as
users run it: N concurrent requests (drafting, prompts of different lengths, one past
``n_batch``, different ``max_tokens``) equal their solo outputs, greedy and seeded, on one
device, under tensor split with the alias and with host KV; a stream closed mid-way frees its
slot; a slot's second turn reuses its prefix while the others run; a step's graphs are counted;
acceptance at ``-np N`` with several ubatches is the solo one; a fault fails the requests of its
step and nothing else.
"""

from __future__ import annotations

import collections
import ctypes
import threading
from typing import Dict, List, Sequence, Tuple

import numpy as np
import pytest

import llama_metaws  # noqa: F401  (points llama_cpp at the patched build: import it first)
import llama_cpp
import llama_cpp.llama_cpp_ext as llx

from llama_metaws import Llama
from llama_metaws.engine import contexts as loading
from llama_metaws.engine.batch import Batch
from llama_metaws.engine.core import Engine
from llama_metaws.engine.request import Request
from llama_metaws.engine.samplers import SamplingParams
from llama_metaws.engine.schedule import Segment, n_graphs
from llama_metaws.native.binding import _internals
from llama_metaws.native.params import set_fields
from llama_metaws.native.runtime import require_build
from llama_metaws_dev.testing import N_EMBD, N_VOCAB, make_tiny_mtp_model, split_devices

N_CTX = 256
N_BATCH = 16  # n_batch = n_ubatch: the long prompt spans several batches
N_THREADS = 1
SEED = 0

SHORT_PROMPT = [5, 17, 42, 99]
LONG_PROMPT = [(7 * i + 3) % N_VOCAB for i in range(40)]  # > n_batch = n_ubatch = 16
ONE_TOKEN_PROMPT = [11]
REQUESTS = [(SHORT_PROMPT, 24), (LONG_PROMPT, 20), (ONE_TOKEN_PROMPT, 9), (SHORT_PROMPT, 13)]
GREEDY = SamplingParams(temp=0.0)

_PATHS: Dict[object, str] = {}


def _model_path(tmp_path_factory, agreement) -> str:
    if agreement not in _PATHS:
        name = "random" if agreement is None else f"agree-{agreement}"
        d = tmp_path_factory.mktemp(f"engine-{name}")
        _PATHS[agreement] = str(make_tiny_mtp_model(d / f"{name}.gguf", seed=SEED, agreement=agreement))
    return _PATHS[agreement]


class Setup:
    """One model (loaded with its MTP block), a reference context and target/draft contexts."""

    def __init__(self, path) -> None:
        self.model = loading.load_model(path, load_mtp=True)
        self.ref = self.context(n_batch=64)
        self.tgt = self.context(n_batch=N_BATCH, n_rs_seq=3)
        self.dft = self.context(n_batch=N_BATCH, mtp=True)
        self._expected: Dict[Tuple[Tuple[int, ...], int], List[int]] = {}

    def context(self, **kw):
        ctx = loading.new_context(self.model, n_ctx=N_CTX, **kw)
        llama_cpp.llama_set_n_threads(ctx.ctx, N_THREADS, N_THREADS)
        return ctx

    def expected(self, prompt: Sequence[int], n: int) -> List[int]:
        """Plain greedy decoding of the target alone (a context of its own, cleared each time)."""
        key = (tuple(prompt), n)
        if key not in self._expected:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ref.ctx), True)
            self._expected[key] = loading.greedy_tokens(self.ref, prompt, n)
        return self._expected[key]

    def close(self) -> None:
        for ctx in (self.dft, self.tgt, self.ref):
            ctx.close()
        self.model.close()


@pytest.fixture(scope="module", params=[None, 1.0, 0.0], ids=["random", "agree-1.0", "agree-0.0"])
def setup(request, tmp_path_factory):
    s = Setup(_model_path(tmp_path_factory, request.param))
    s.agreement = request.param
    yield s
    s.close()


def _run(engine, prompt, n, **kw):
    """A greedy request of exactly ``n`` tokens (no stop at EOG), the whole prompt evaluated."""
    r = engine.submit(Request(prompt, GREEDY, max_tokens=n, stop_at_eog=False, cache_prompt=False, **kw))
    seen = []
    for out in r.outputs(timeout=120):
        seen.extend(out.tokens)
    assert seen == r.generated
    return r


# --------------------------------------------------------------------------------------------
# over low-level contexts: output, acceptance, drafts


@pytest.mark.parametrize("draft_max", [1, 3])
def test_greedy_output_is_the_targets_and_acceptance_follows_the_head(setup, draft_max) -> None:
    with Engine(setup.tgt, setup.dft, draft_max=draft_max) as engine:
        drafted = accepted = 0
        for prompt, n in REQUESTS:
            r = _run(engine, prompt, n)
            assert r.generated == setup.expected(prompt, n), f"prompt of {len(prompt)} tokens"
            s, steps = r.stats, sum(r.stats.lengths.values())
            assert 1 <= s.steps <= steps <= n
            assert s.accepted <= s.drafted <= draft_max * s.steps
            # every step yields its accepted drafts plus the target's own token
            assert s.accepted + steps == n
            drafted, accepted = drafted + s.drafted, accepted + s.accepted
        assert (engine.total.drafted, engine.total.accepted) == (drafted, accepted)
        acceptance = engine.total.acceptance
        if setup.agreement == 1.0:
            assert acceptance >= 0.9
        elif setup.agreement == 0.0:
            assert acceptance <= 0.1


def test_p_min_one_drafts_nothing(setup) -> None:
    with Engine(setup.tgt, setup.dft, draft_max=3, p_min=1.0) as engine:
        for prompt, n in REQUESTS[:2]:
            r = _run(engine, prompt, n)
            assert r.generated == setup.expected(prompt, n)
            assert r.stats.drafted == 0 and r.stats.accepted == 0 and r.stats.acceptance == 0.0
            assert sum(r.stats.lengths.values()) == n  # a plain step per token


def test_p_min_below_the_heads_confidence_changes_nothing(tmp_path_factory) -> None:
    # the agreement model's head puts ~0.994 on its choice: p_min=0.9 passes every draft
    s = Setup(_model_path(tmp_path_factory, 1.0))
    try:
        with Engine(s.tgt, s.dft, draft_max=3) as plain:
            r0 = _run(plain, SHORT_PROMPT, 20)
        with Engine(s.tgt, s.dft, draft_max=3, p_min=0.9) as gated:
            r1 = _run(gated, SHORT_PROMPT, 20)
        assert r1.generated == r0.generated == s.expected(SHORT_PROMPT, 20)
        assert r1.stats == r0.stats and r0.stats.acceptance == 1.0
    finally:
        s.close()


def test_zero_tokens_exact_lengths_and_a_full_context(setup) -> None:
    with Engine(setup.tgt, setup.dft, draft_max=3) as engine:
        r = engine.submit(Request(SHORT_PROMPT, GREEDY, max_tokens=0))
        assert r.wait(timeout=10) == [] and r.finish == "length"
        for n in (1, 2, 5):  # n smaller than a full step: drafts are cut to fit
            assert _run(engine, SHORT_PROMPT, n).generated == setup.expected(SHORT_PROMPT, n)
        # the whole context: the last new token is never decoded, so n_ctx - len(prompt) + 1
        n = N_CTX - len(SHORT_PROMPT)
        r = _run(engine, SHORT_PROMPT, N_CTX)
        assert len(r.generated) == n + 1 and r.generated[:n] == setup.expected(SHORT_PROMPT, n)
        assert r.finish == "length"


def test_a_prompt_reports_its_progress_once_on_its_slot_and_after_each_batch(setup) -> None:
    reports, threads = [], set()

    def listen(report):
        reports.append(report)
        threads.add(threading.current_thread().name)

    with Engine(setup.tgt, setup.dft, draft_max=3) as engine:
        r = _run(engine, LONG_PROMPT, 4, on_progress=listen)
        # 40 tokens, the last held back for the first draft: batches of 16, 16 and 7
        assert [(p.total, p.cache, p.processed, p.prompt_n) for p in reports] == \
            [(40, 0, 0, 0), (40, 0, 16, 16), (40, 0, 32, 32), (40, 0, 40, 39)]
        assert reports[0].prompt_ms == 0.0 and all(p.prompt_ms > 0 for p in reports[1:])
        assert [p.time_ms for p in reports] == sorted(p.time_ms for p in reports)
        assert threads == {"llama-metaws-engine"} and r.generated == setup.expected(LONG_PROMPT, 4)
        # the prompt held but its last token: one report from the cache, one once it is drafted from
        reports.clear()
        r = engine.submit(Request(LONG_PROMPT, GREEDY, max_tokens=4, stop_at_eog=False, on_progress=listen))
        assert r.wait(timeout=120) == setup.expected(LONG_PROMPT, 4)
        assert [(p.cache, p.processed) for p in reports] == [(39, 39), (39, 40)]

        def fails(report):
            raise RuntimeError("a listener's bug")

        r = _run(engine, SHORT_PROMPT, 5, on_progress=fails)  # the request goes on, unheard
        assert r.generated == setup.expected(SHORT_PROMPT, 5) and r.on_progress is None


def _decode(ctx, tokens: Sequence[int], pos0: int, *, rows=None) -> None:
    b = Batch(len(tokens), N_EMBD if rows is not None else 0)
    b.add(tokens, pos0, 0, True, None if rows is None else np.asarray(rows, dtype=np.float32))
    assert llama_cpp.llama_decode(ctx.ctx, b.batch) == 0


def _argmax(ctx, i: int) -> int:
    return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx.ctx, i), shape=(N_VOCAB,))))


def _hidden(ctx, i: int) -> np.ndarray:
    return np.ctypeslib.as_array(llx.llama_get_embeddings_nextn_ith(ctx.ctx, i), shape=(N_EMBD,)).copy()


def _reference_drafts(s: Setup, sequence, n_prompt, steps):
    """What the MTP head drafts at each recorded step, one token at a time on fresh contexts: the
    history pairs token x_p with the target's hidden row h_{p-1} (zeros for p = 0); a chain
    starts from (x_p0, h_{p0-1}) and goes on from each draft token and the head's own row."""
    tgt = s.context(n_batch=64, n_rs_seq=1)
    dft = s.context(n_batch=64, mtp=True)
    want = {p: len(d) for p, d in steps}
    mem = llama_cpp.llama_get_memory(dft.ctx)
    try:
        llx.llama_set_embeddings_nextn(tgt.ctx, True, False)
        llx.llama_set_embeddings_nextn(dft.ctx, True, True)
        h_prev = np.zeros(N_EMBD, np.float32)
        out = []
        for p in range(len(sequence)):
            x = sequence[p]
            _decode(dft, [x], p, rows=h_prev[None, :])
            if p >= n_prompt - 1 and want.get(p):
                chain = [_argmax(dft, 0)]
                row = _hidden(dft, 0)
                while len(chain) < want[p]:
                    _decode(dft, [chain[-1]], p + len(chain), rows=row[None, :])
                    chain.append(_argmax(dft, 0))
                    row = _hidden(dft, 0)
                assert llama_cpp.llama_memory_seq_rm(mem, 0, p + 1, -1)
                out.append((p, chain))
            _decode(tgt, [x], p)
            h_prev = _hidden(tgt, 0)
        return out
    finally:
        dft.close()
        tgt.close()


@pytest.mark.parametrize("draft_max", [1, 3])
def test_drafts_are_the_heads_chain(tmp_path_factory, draft_max) -> None:
    # the random model's eh_proj reads the hidden half: a wrong row pairing, a wrong position
    # or a wrong chained row changes the drafts (most are rejected, so chains are long)
    s = Setup(_model_path(tmp_path_factory, None))
    try:
        with Engine(s.tgt, s.dft, draft_max=draft_max) as engine:
            propose = engine.head.propose
            steps = []

            def recording(starts, *args):
                out = propose(starts, *args)
                steps.extend((pos, out[seq]) for seq, _last, pos, _row, _n in starts)
                return out

            engine.head.propose = recording
            for prompt, n in REQUESTS[:2]:
                steps.clear()
                r = _run(engine, prompt, n)
                assert sum(len(d) for _, d in steps) >= r.stats.drafted > 0
                expected = _reference_drafts(s, list(prompt) + r.generated[:-1], len(prompt), steps)
                assert [st for st in steps if st[1]] == expected
    finally:
        s.close()


def test_bad_arguments_are_value_errors(setup) -> None:
    tgt, dft = setup.tgt, setup.dft
    for kw in ({"draft_max": 0}, {"draft_max": -1}, {"draft_max": 1.5}, {"p_min": -0.1},
               {"p_min": 1.5}, {"p_min": float("nan")}, {"n_slots": 0}, {"n_slots": 2}):
        with pytest.raises(ValueError):
            Engine(tgt, dft, **kw)
    with pytest.raises(ValueError, match="MTP"):
        Engine(tgt, setup.ref)  # a default context as the draft
    with pytest.raises(ValueError):
        Engine(dft, dft)
    small = setup.context(n_batch=N_BATCH, n_ubatch=2, n_rs_seq=3)
    try:  # a draft the snapshots undo is verified in one ubatch (a longer one: a checkpoint)
        with pytest.raises(ValueError, match=r"n_rs_seq 3\).*n_ubatch 2"):
            Engine(small, dft)
    finally:
        small.close()
    with pytest.raises(ValueError, match="n_batch"):
        Engine(setup.ref, dft, draft_max=N_BATCH)  # the verify batch outgrows the draft's
    with Engine(tgt, dft) as engine:
        with pytest.raises(ValueError, match="empty"):
            Request([], GREEDY)
        with pytest.raises(ValueError):
            Request(SHORT_PROMPT, GREEDY, max_tokens=-1)
        with pytest.raises(ValueError, match="vocabulary"):
            engine.submit(Request([N_VOCAB], GREEDY))
        with pytest.raises(ValueError, match="n_ctx"):
            engine.submit(Request([t % N_VOCAB for t in range(N_CTX)], GREEDY))
        # the contexts still work after the refusals
        assert _run(engine, SHORT_PROMPT, 6).generated == setup.expected(SHORT_PROMPT, 6)


def test_decode_errors_name_the_context_and_phase(setup, monkeypatch) -> None:
    real = llama_cpp.llama_decode

    def fail(ctx_to_fail, rc, outputs_only=False):
        def decode(ctx, batch):
            if ctypes.cast(ctx, ctypes.c_void_p).value == ctypes.cast(ctx_to_fail, ctypes.c_void_p).value \
                    and (not outputs_only or batch.logits[0]):
                return rc
            return real(ctx, batch)
        return decode

    with Engine(setup.tgt, setup.dft, draft_max=2) as engine:
        monkeypatch.setattr(llama_cpp, "llama_decode", fail(setup.tgt.ctx, 1))
        with pytest.raises(RuntimeError, match=r"target context returned 1 during prompt"):
            _run(engine, SHORT_PROMPT, 4)
        monkeypatch.setattr(llama_cpp, "llama_decode", fail(setup.dft.ctx, -3))
        with pytest.raises(RuntimeError, match=r"draft context returned -3 during prompt"):
            _run(engine, SHORT_PROMPT, 4)
        with pytest.raises(RuntimeError, match=r"draft context returned -3 during drafting"):
            _run(engine, ONE_TOKEN_PROMPT, 4)  # no prompt to evaluate: the first step drafts
        monkeypatch.setattr(llama_cpp, "llama_decode", fail(setup.dft.ctx, -3, outputs_only=True))
        with pytest.raises(RuntimeError, match=r"draft context returned -3 during drafting"):
            _run(engine, SHORT_PROMPT, 4)  # the head's own decodes ask for its rows
        monkeypatch.setattr(llama_cpp, "llama_decode", real)
        assert _run(engine, LONG_PROMPT, 7).generated == setup.expected(LONG_PROMPT, 7)


# --------------------------------------------------------------------------------------------
# through Llama, from several threads

KW = dict(n_batch=64, n_ubatch=64, verbose=False)
N_CTX_SLOT = 256
TEXTS = ["the quick brown fox", "1 2 3 4 5 6 7 8", "hello world " * 30, "a"]  # the third: > n_batch tokens
MAX_TOKENS = [20, 33, 12, 27]


@pytest.fixture(scope="module")
def agree_path(tmp_path_factory):
    return _model_path(tmp_path_factory, 0.8)


def _complete(llm, text, max_tokens, **kw):
    kw.setdefault("temperature", 0.0)
    return llm.create_completion(text, max_tokens=max_tokens, **kw)["choices"][0]["text"]


def _concurrently(fn, n, engine=None):
    """``fn(i)`` on ``n`` threads; with ``engine``, it admits the requests only once all ``n``
    are queued (an exclusive call holds it meanwhile), so that they run in the same steps."""
    out, errors = [None] * n, []
    start = threading.Barrier(n)
    release, held = threading.Event(), threading.Event()
    holder = None
    if engine is not None:
        holder = threading.Thread(target=engine.exclusive, args=(lambda: (held.set(), release.wait(60)),),
                                  daemon=True)
        holder.start()
        assert held.wait(60)

    def run(i):
        try:
            start.wait(timeout=60)
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((i, e))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    if holder is not None:
        for _ in range(6000):  # bounded: 60 s
            if len(engine.waiting) >= n or errors:
                break
            threading.Event().wait(0.01)
        release.set()
        holder.join(timeout=60)
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a request did not finish"
    assert not errors, errors
    return out


_SOLO: Dict[tuple, str] = {}


def _solo(path, text, max_tokens, extra=(), **kw):
    key = (path, text, max_tokens, extra, tuple(sorted(kw.items())))
    if key not in _SOLO:
        with Llama(path, draft="mtp", n_ctx=N_CTX_SLOT, **KW, **dict(extra)) as llm:
            _SOLO[key] = _complete(llm, text, max_tokens, **kw)
    return _SOLO[key]


CONFIGS = {
    "one device": (),
    "tensor split (alias)": (("devices", tuple(split_devices(2))), ("split_mode", "tensor")),
    # KV in host memory is computed in place by CPU devices alone (a GPU's is refused with a
    # ValueError: engine/devices.py, check_tensor_split), so this is the CPU test bed on any machine
    "host KV": (("devices", ("CPU", "CPU")), ("split_mode", "tensor"), ("offload_kqv", False)),
}


def _llama(path, n, extra=(), **kw):
    args = dict(extra)
    if "devices" in args:
        args["devices"] = list(args["devices"])
    return Llama(path, draft="mtp", n_seq_max=n, n_ctx=n * N_CTX_SLOT, **KW, **args, **kw)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_concurrent_greedy_requests_equal_their_solo_outputs(agree_path, n):
    with _llama(agree_path, n) as llm:
        assert llm.tokenize(TEXTS[2].encode()).__len__() > KW["n_batch"]
        got = _concurrently(lambda i: _complete(llm, TEXTS[i % 4], MAX_TOKENS[i % 4]), n, llm._engine)
        assert llm._engine.total.drafted > 0
        assert llm._engine.peak_busy == n  # the requests ran in the same steps
    assert got == [_solo(agree_path, TEXTS[i % 4], MAX_TOKENS[i % 4]) for i in range(n)]


@pytest.mark.parametrize("config", ["tensor split (alias)", "host KV"])
def test_concurrent_requests_under_tensor_split_equal_their_solo_outputs(agree_path, config):
    extra = CONFIGS[config]
    with _llama(agree_path, 3, extra) as llm:
        got = _concurrently(lambda i: _complete(llm, TEXTS[i], MAX_TOKENS[i]), 3, llm._engine)
        assert llm._engine.peak_busy == 3
        if config == "tensor split (alias)":
            assert any(e.alias for e in llm.workspace_stats())
    assert got == [_solo(agree_path, TEXTS[i], MAX_TOKENS[i], extra) for i in range(3)]


def test_seeded_sampling_concurrently_equals_solo(tmp_path_factory):
    path = _model_path(tmp_path_factory, None)  # random weights: near-uniform logits, sampling shows
    kw = dict(temperature=0.9, top_k=20, seed=1234)
    with _llama(path, 3) as llm:
        got = _concurrently(lambda i: _complete(llm, TEXTS[i], MAX_TOKENS[i], **kw), 3, llm._engine)
        assert llm._engine.peak_busy == 3
    want = [_solo(path, TEXTS[i], MAX_TOKENS[i], **kw) for i in range(3)]
    assert got == want
    assert want != [_solo(path, TEXTS[i], MAX_TOKENS[i]) for i in range(3)]  # it did sample


def test_a_stream_closed_mid_way_frees_its_slot_for_the_next_request(agree_path):
    with _llama(agree_path, 2) as llm:
        other = {}
        t = threading.Thread(target=lambda: other.setdefault("text", _complete(llm, TEXTS[2], 40)), daemon=True)
        stream = llm.create_completion(TEXTS[0], max_tokens=60, temperature=0.0, stream=True)
        t.start()
        head = [next(stream)["choices"][0]["text"] for _ in range(3)]
        stream.close()  # the slot frees at the engine's next step
        t.join(timeout=300)
        assert not t.is_alive()
        assert other["text"] == _solo(agree_path, TEXTS[2], 40)  # unchanged by the closed stream
        assert _solo(agree_path, TEXTS[0], 60).startswith("".join(head))
        # the freed slot serves the next request, while another one runs
        got = _concurrently(lambda i: _complete(llm, TEXTS[1 + 2 * i], MAX_TOKENS[1 + 2 * i]), 2)
        assert got == [_solo(agree_path, TEXTS[1], MAX_TOKENS[1]), _solo(agree_path, TEXTS[3], MAX_TOKENS[3])]
        assert llm._engine.busy() == 0


def test_in_a_unified_kv_an_idle_slots_prompt_gives_its_cells_to_a_running_one(agree_path):
    """-np auto's unified KV: slot 0 keeps its 200-token history while idle; slot 1's 200-token
    prompt finds no free cells (llama_decode returns 1), so, as llama-server, the idle slot's
    sequence is cleared and the batch decoded again."""
    prompt = [(7 * i + 3) % N_VOCAB for i in range(200)]
    with Llama(agree_path, draft="mtp", n_ctx=N_CTX, n_batch=64, n_ubatch=64, n_seq_max=2, kv_unified=True,
               verbose=False) as llm:
        first = llm.create_completion(prompt, max_tokens=8, temperature=0.0, id_slot=0)["choices"][0]["text"]
        assert llm.slots()[0]["n_past"] > 200
        second = llm.create_completion(prompt[::-1], max_tokens=8, temperature=0.0, id_slot=1)["choices"][0]["text"]
        assert llm.slots()[0]["n_past"] == 0 and llm.slots()[1]["n_past"] > 200
        # the cleared slot evaluates its prompt anew, with the same answer
        assert llm.create_completion(prompt, max_tokens=8, temperature=0.0, id_slot=0)["choices"][0]["text"] == first
        assert llm.timings()["cache_n"] == 0
    with Llama(agree_path, draft="mtp", n_ctx=N_CTX, n_batch=64, n_ubatch=64, verbose=False) as solo:
        assert solo.create_completion(prompt[::-1], max_tokens=8, temperature=0.0)["choices"][0]["text"] == second


def test_a_slots_second_turn_reuses_its_prefix_while_other_slots_run(agree_path):
    first = "the quick brown fox jumps over the lazy dog " * 3
    with _llama(agree_path, 2) as llm:
        answer = _complete(llm, first, 16)
        second = first + answer + " and then"
        results = {}

        def long_one():
            results["long"] = _complete(llm, TEXTS[2], 48)

        t = threading.Thread(target=long_one, daemon=True)
        t.start()
        results["turn"] = _complete(llm, second, 16)
        turn = llm.timings()  # this thread's last completion
        t.join(timeout=300)
        assert turn["cache_n"] > len(llm.tokenize(first.encode())) // 2, turn  # the prefix was kept
        assert turn["prompt_n"] < turn["prompt_tokens"]
    assert results["turn"] == _solo(agree_path, second, 16)
    assert results["long"] == _solo(agree_path, TEXTS[2], 48)


def test_acceptance_with_several_ubatches_per_step_is_the_solo_acceptance(agree_path):
    """Upstream issue 27572: acceptance fell to 0 at -np N once a step's batch split into several
    ubatches (the target's hidden rows came back in the wrong order)."""
    small = dict(KW, n_ubatch=8)  # 4 slots x (1 + 3) tokens: two ubatches per step at least
    solo = []
    for i in range(4):
        with Llama(agree_path, draft="mtp", n_ctx=N_CTX_SLOT, **small) as llm:
            _complete(llm, TEXTS[i], 30)
            solo.append(llm.draft_stats.last.acceptance)
    with Llama(agree_path, draft="mtp", n_seq_max=4, n_ctx=4 * N_CTX_SLOT, **small) as llm:
        def one(i):
            _complete(llm, TEXTS[i], 30)
            return llm.timings()
        timings = _concurrently(one, 4, llm._engine)
        assert llm._engine.graphs_target > llm._engine.steps  # some steps ran several graphs
    got = [t["draft_n_accepted"] / t["draft_n"] for t in timings]
    assert all(g > 0.3 for g in got), got
    assert abs(np.mean(got) - np.mean(solo)) < 0.1, (got, solo)


# --------------------------------------------------------------------------------------------
# graphs per step


def _graph_counter(lib):
    seen = collections.Counter()

    def observe(t, ask, _):
        if ask and lib.ggml_get_name(t) == b"model.input_embed":  # once per graph
            seen["graphs"] += 1
        return False

    return seen, llama_cpp.ggml_backend_sched_eval_callback(observe)


@pytest.mark.parametrize("unified", [False, True])
def test_the_graphs_of_a_step_are_counted_for_mixed_prompt_and_decode_slots(agree_path, unified):
    lib = ctypes.CDLL(str(require_build().lib_dir / "libggml-base.so"))
    lib.ggml_get_name.argtypes, lib.ggml_get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    model = loading.load_model(agree_path, load_mtp=True)
    seen, cb = _graph_counter(lib)
    params = llama_cpp.llama_context_default_params()
    set_fields(params, dict(n_ctx=3 * N_CTX_SLOT, n_batch=64, n_ubatch=8, n_seq_max=3, n_rs_seq=3,
                            kv_unified=unified, cb_eval=cb))
    ctx = _internals.LlamaContext(model=model, params=params, verbose=False)
    try:
        with Engine(ctx, None, n_slots=3) as engine:
            cases = [[(0, 4), (1, 20)], [(0, 1), (1, 1), (2, 1)], [(0, 4), (2, 4)], [(1, 30)],
                     [(0, 2), (1, 6), (2, 3)]]
            for case in cases:
                for s in engine.slots:
                    engine.clear_sequence(s)
                segs, b = [], engine.tbatch
                b.clear()
                for seq, n in case:
                    tokens = [(5 + seq * 3 + i) % N_VOCAB for i in range(n)]
                    segs.append(Segment(engine.slots[seq], "decode", tokens, 0, True))
                    b.add(tokens, 0, seq, True)
                seen["graphs"] = 0
                assert llama_cpp.llama_decode(ctx.ctx, b.batch) == 0
                assert engine.graphs(segs) == seen["graphs"], (case, unified)
    finally:
        ctx.close()
        model.close()


def test_the_graph_predictor_keeps_each_sequences_tail_together():
    class S:
        def __init__(self, seq_id):
            self.seq_id = seq_id

    def segs(*counts):
        return [Segment(S(i), "decode", [0] * n, 0, True) for i, n in enumerate(counts) if n]

    # equal counts of consecutive sequences: one graph
    assert n_graphs(segs(4, 4, 4), 64, sequential=True, keep_tail=4, split_equal=True) == 1
    # a longer prompt beside a decode: one graph for the shared part, then the rest
    assert n_graphs(segs(4, 20), 64, sequential=True, keep_tail=4, split_equal=True) == 2
    # no equal split: every n_ubatch tokens
    assert n_graphs(segs(4, 20), 8, sequential=True, keep_tail=0, split_equal=False) == 3


# --------------------------------------------------------------------------------------------
# faults: the requests of a failed step, and nothing else


def test_an_allocation_failure_fails_the_requests_of_its_step_and_the_retries_match(agree_path):
    from llama_metaws.engine.workspace import inject_alloc_failure

    with _llama(agree_path, 2) as llm:
        want = [_solo(agree_path, TEXTS[1], 30), _solo(agree_path, TEXTS[2], 12)]
        first = {}
        t = threading.Thread(target=lambda: first.setdefault("r", _try(llm, TEXTS[1], 30)), daemon=True)
        stream = llm.create_completion(TEXTS[0], max_tokens=40, temperature=0.0, stream=True)
        for _ in range(4):
            next(stream)  # a request generating: the workspace decode-sized
        inject_alloc_failure(1)  # the next allocation (a prompt's grow) fails
        try:
            t.start()
            second = _try(llm, TEXTS[2], 12)
            t.join(timeout=300)
        finally:
            inject_alloc_failure(0)
        rest = _drain(stream)
        outcomes = [first["r"], second, rest]
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        assert failed, outcomes  # the grow failed ...
        assert all(isinstance(e, RuntimeError) and "returned -2" in str(e) for e in failed), failed
        # ... for the requests of that step, each told why; the others went on unchanged
        for o, w in ((first["r"], want[0]), (second, want[1])):
            assert isinstance(o, BaseException) or o == w
        # nothing hangs, and the retries give the fault-free outputs
        assert _concurrently(lambda i: _complete(llm, [TEXTS[1], TEXTS[2]][i], [30, 12][i]), 2) == want
        assert llm._engine.busy() == 0


def _try(llm, text, n):
    try:
        return _complete(llm, text, n)
    except BaseException as e:  # noqa: BLE001 - the outcome is checked
        return e


def _drain(stream):
    try:
        return "".join(c["choices"][0]["text"] for c in stream)
    except BaseException as e:  # noqa: BLE001
        return e


def test_a_bad_grammar_fails_its_request_alone(agree_path):
    from llama_cpp import LlamaGrammar

    with _llama(agree_path, 2) as llm:
        bad = LlamaGrammar.from_string("root ::= (", verbose=False)
        results = _concurrently(lambda i: _try(llm, TEXTS[i], 20) if i else
                                _try_grammar(llm, bad), 2)
        assert isinstance(results[0], ValueError) and "grammar" in str(results[0])
        assert results[1] == _solo(agree_path, TEXTS[1], 20)


def _try_grammar(llm, grammar):
    try:
        return llm.create_completion("a", max_tokens=4, grammar=grammar)
    except BaseException as e:  # noqa: BLE001
        return e
