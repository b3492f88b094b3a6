"""``draft_max="auto"`` from the first request: the cost prior measured at load
(``llama_metaws.engine.prior``), the curve saved for the next load and measured again when it
drifts, and costs that are the engine thread's own time, so contention from other threads does
not make drafting look cheaper.

Every decode runs for real on a tiny model; a fake machine makes it cost what a CPU or a GPU
would, on the engine thread's own clock (``time.thread_time``, which ``engine_clock`` reads) and on
the wall, where other threads' work can be added to every step.
"""

import json
import time

import pytest

import llama_metaws  # noqa: F401  (the patched build first)
import llama_cpp

from llama_metaws import Llama
from llama_metaws.engine import prior as prior_mod
from llama_metaws.engine.drafting import AdaptiveLength
from llama_metaws.engine.policy import DraftPolicy, FixedCosts, StepCosts, engine_clock
from llama_metaws_dev.testing import make_tiny_mtp_model

KW = dict(n_ctx=512, n_batch=64, n_ubatch=64, verbose=False)
PROMPT = "the quick brown fox jumps over the lazy dog " * 4
CAP = AdaptiveLength.CAP

# seconds: a target decode of n tokens, the draft context's catch-up over n tokens, one draft
# decode over m slots. A CPU: each token costs, compute-bound. A GPU: verifying k + 1 tokens
# costs about one decode.
CPU = dict(target=lambda n: 0.010 * n, catch_up=lambda n: 0.001 * n, draft=lambda m: 0.004 * m)
GPU = dict(target=lambda n: 0.010 + 0.0002 * n, catch_up=lambda n: 0.0005, draft=lambda m: 0.0008)


class FakeMachine:
    """Decodes cost what ``model`` says, times ``speed``, on the engine thread's own clock
    (``own``) and on the wall; ``contention`` seconds of other threads' work are added to the
    wall of every target decode (one a step), not to the engine's own time."""

    def __init__(self, model, contention=0.0):
        self.model, self.contention, self.speed = model, contention, 1.0
        self.own_now = self.wall_now = 0.0
        self.decodes = 0
        self.installed = False

    def own(self):
        return self.own_now

    def wall(self):
        return self.wall_now

    def install(self, monkeypatch):
        if self.installed:
            return
        self.installed = True
        real = llama_cpp.llama_decode

        def decode(ctx, batch):
            rc = real(ctx, batch)
            n = batch.n_tokens
            outputs = sum(1 for i in range(n) if batch.logits[i])
            if not batch.embd:  # the target's batch: tokens only (the draft context's carry hidden rows)
                cost, extra = self.model["target"](n), self.contention
            elif outputs:  # a draft decode (the head's rows asked for)
                cost, extra = self.model["draft"](n), 0.0
            else:  # the draft context's catch-up
                cost, extra = self.model["catch_up"](n), 0.0
            self.own_now += cost * self.speed
            self.wall_now += cost * self.speed + extra
            self.decodes += 1
            return rc

        monkeypatch.setattr(llama_cpp, "llama_decode", decode)
        monkeypatch.setattr(time, "thread_time", self.own)  # engine_clock reads it


@pytest.fixture(scope="module")
def full_path(models_dir):
    return str(make_tiny_mtp_model(models_dir / "prior-full.gguf", seed=31, agreement=1.0))


@pytest.fixture
def costs_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(prior_mod.COSTS_ENV, str(tmp_path / "costs"))
    return tmp_path / "costs"


def _auto(path, machine, monkeypatch):
    machine.install(monkeypatch)
    return Llama(path, draft="mtp", draft_max="auto", **KW)


def _lengths(llm, prompt=PROMPT, n=40):
    llm.create_completion(prompt, max_tokens=n, temperature=0.0)
    return llm.timings()["draft_lengths"]


def test_the_engine_clock_is_the_threads_own_time(monkeypatch):
    monkeypatch.setattr(time, "thread_time", lambda: 42.5)
    assert engine_clock() == 42.5
    assert StepCosts().clock is engine_clock


def test_the_prior_is_measured_at_load_and_the_first_request_starts_from_it(full_path, costs_folder, monkeypatch):
    machine = FakeMachine(CPU)
    with _auto(full_path, machine, monkeypatch) as llm:
        p = llm.engine_stats()["cost_prior"]
        assert llm._engine.head.clock is llm._engine.costs.clock is engine_clock
        first = _lengths(llm)
    assert p["source"] == "measured" and p["rounds"] >= 1 and p["path"].startswith(str(costs_folder))
    # every target batch of 1 to cap + 1 tokens, its catch-up, a draft decode over one slot
    assert p["target_ms"] == pytest.approx({n: 10.0 * n for n in range(1, CAP + 2)})
    assert p["catch_up_ms"] == pytest.approx({n: 1.0 * n for n in range(1, CAP + 2)})
    assert p["draft_ms"] == pytest.approx({1: 4.0})
    assert p["seconds"] > 0 and p["load_s"] > 0 and p["share_of_load"] == pytest.approx(p["wall_s"] / p["load_s"], rel=0.05)  # the two rounded to ms
    # a CPU: drafting never pays, and the first request knows it from its first step
    assert first == {0: 40}, first
    # without the prior (the engine learning its costs as it runs) the first request drafts
    with _auto(full_path, machine, monkeypatch) as llm:
        llm._engine.set_costs(StepCosts())
        assert llm.engine_stats()["cost_prior"] is None
        learnt = _lengths(llm)
    assert sum(v for k, v in learnt.items() if k) >= 1, learnt


def test_a_saved_curve_replaces_the_measurement_and_is_measured_again_once_it_drifts(full_path, costs_folder,
                                                                                   monkeypatch):
    machine = FakeMachine(CPU)
    seen = []
    for speed in (1.0, 1.0, 1.1, 2.0, 2.0):
        machine.speed = speed
        with _auto(full_path, machine, monkeypatch) as llm:
            p = llm.engine_stats()["cost_prior"]
        seen.append((p["source"], p["target_ms"][1], p["seconds"] / speed, p["check"]))
    (s0, t0, d0, _), (s1, t1, d1, c1), (s2, t2, _, c2), (s3, t3, d3, _), (s4, t4, _, _) = seen
    assert s0 == "measured" and s1 == "cache" and t1 == t0
    assert c1["target"] == {1: pytest.approx(1.0), 2: pytest.approx(1.0)} and c1["draft"] == {1: pytest.approx(1.0)}
    assert d1 < d0 / 4, (d0, d1)  # the check: a few small decodes, not the whole curve
    assert s2 == "cache" and c2["target"][1] == pytest.approx(1.1)  # within DRIFT: kept
    assert s3 == "re-measured" and t3 == pytest.approx(2 * t0) and d3 == pytest.approx(d0 + d1)  # checked, then measured
    assert s4 == "cache" and t4 == t3  # and saved
    saved = list(costs_folder.glob("*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["target"]["1"] == pytest.approx(0.020)
    # another option of the context (threads) is another curve
    with Llama(full_path, draft="mtp", draft_max="auto", n_threads=2, **KW) as llm:
        assert llm.engine_stats()["cost_prior"]["source"] == "measured"
    assert len(list(costs_folder.glob("*.json"))) == 2


def test_without_a_cache_folder_every_load_measures(full_path, monkeypatch):
    monkeypatch.setenv(prior_mod.COSTS_ENV, "off")
    machine = FakeMachine(CPU)
    for _ in range(2):
        with _auto(full_path, machine, monkeypatch) as llm:
            p = llm.engine_stats()["cost_prior"]
        assert p["source"] == "measured" and p["path"] is None


def test_more_rounds_only_within_the_budget(full_path, costs_folder, monkeypatch):
    machine = FakeMachine(CPU)
    with _auto(full_path, machine, monkeypatch) as llm:
        e = llm._engine
        assert e.calibrate(None, load_s=None).rounds == 1  # no load time known: no budget past one round
        before = machine.decodes
        assert e.calibrate(None, load_s=1e9).rounds == prior_mod.REPS
        per_round = (machine.decodes - before - 3) // prior_mod.REPS  # less the untimed warm-up
        # each target size and its catch-up (the one-token one PLAIN_REPS times), one draft decode
        assert per_round == 2 * (CAP + prior_mod.PLAIN_REPS) + 1
        assert e.prior.path is None  # no key: nothing saved


def test_contention_on_every_step_does_not_make_drafting_look_cheaper(full_path, costs_folder, monkeypatch):
    # other threads' work (the HTTP thread, a tokenizer, the clients) stretches the wall time of
    # every step by the same 30 ms: on the wall a plain step then costs 4x its compute and a
    # 7-token batch 1.4x, and drafting looks as if it paid. The engine's own time does not see it.
    machine = FakeMachine(CPU, contention=0.030)
    with _auto(full_path, machine, monkeypatch) as llm:
        own = [_lengths(llm, PROMPT + s) for s in ("", "!")]
        # the same machine timed on the wall (what the engine did before): drafting chosen
        llm._engine.set_costs(StepCosts(clock=machine.wall))
        llm._engine.calibrate()
        wall = _lengths(llm, PROMPT + "?")
    assert own[0] == {0: 40}, own
    assert set(own[1]) <= {0, 1} and own[1].get(1, 0) <= 1, own  # the 50th step explores: one token
    assert wall.get(0, 0) < 20, wall


def test_a_gpu_like_clock_picks_the_longest_accepted_length(full_path, costs_folder, monkeypatch):
    # the policy alone: verifying k + 1 tokens costs about one decode, so every depth the head
    # keeps is drafted, and none past it
    policy = DraftPolicy(FixedCosts(**GPU))
    for agree in range(CAP + 1):
        p = [1.0] * agree + [0.02] * (CAP - agree)
        assert policy.choose([(p, CAP)]) == [agree], (agree, policy.choose([(p, CAP)]))
    # through Llama, from the first request, with the costs measured at load: a head that always
    # agrees drafts the cap once its probes are accepted (1, 2, 4 tokens, then the cap)
    machine = FakeMachine(GPU, contention=0.030)
    with _auto(full_path, machine, monkeypatch) as llm:
        lengths = _lengths(llm, n=60)
        t = llm.timings()
    assert max(lengths, key=lengths.get) == CAP and lengths[CAP] >= 6, lengths
    # no plain step but where the request's end leaves no room for a draft
    assert lengths.get(0, 0) <= 1 and t["draft_n_accepted"] == t["draft_n"], lengths


def test_a_fresh_process_starts_from_the_acceptance_the_model_pairs_last_request_left(full_path, costs_folder,
                                                                                      monkeypatch):
    # the first load of a head that always agrees: its first request probes (1, then 2, 4 tokens)
    # before it drafts the cap; the acceptance it leaves is saved as the request ends
    machine = FakeMachine(GPU)
    with _auto(full_path, machine, monkeypatch) as llm:
        assert llm.engine_stats()["acceptance_prior"] is None
        first = _lengths(llm, n=30)
    saved = list(costs_folder.glob("acceptance-*.json"))
    assert len(saved) == 1, saved
    state = json.loads(saved[0].read_text())["state"]
    assert state["limit"] == CAP and state["seen"] == CAP and min(state["p"]) > 0.9, state
    assert first.get(2, 0) == 1 and first.get(4, 0) == 1, first  # the probes' doubling
    # a later load of the same pair (any threads: acceptance is the pair's, not the machine's)
    # drafts the cap from its first step, as a second request in one process would
    with Llama(full_path, draft="mtp", draft_max="auto", n_threads=2, **KW) as llm:
        assert llm.engine_stats()["acceptance_prior"] == str(saved[0])
        again = _lengths(llm, n=30)
    # no doubling: the cap from the first draft (a shorter one only where the request's end
    # leaves no room for the cap)
    assert not {2, 3, 4, 5} & set(again) and again[CAP] >= 4 and again.get(1, 0) <= 1, again
    # another draft option (p_min) is another pair's: a fresh start, probing again
    with Llama(full_path, draft="mtp", draft_max="auto", draft_p_min=0.01, **KW) as llm:
        assert llm.engine_stats()["acceptance_prior"] is None
        other = _lengths(llm, n=30)
    assert other.get(2, 0) == 1 and other.get(4, 0) == 1, other
    assert len(list(costs_folder.glob("acceptance-*.json"))) == 2


def test_a_saved_acceptance_that_is_not_ours_is_a_fresh_start(full_path, costs_folder, monkeypatch):
    machine = FakeMachine(GPU)
    with _auto(full_path, machine, monkeypatch) as llm:
        _lengths(llm, n=12)
    (path,) = costs_folder.glob("acceptance-*.json")
    doc = json.loads(path.read_text())
    for bad in ("not json", json.dumps(dict(doc, state=dict(doc["state"], p="x"))),
                json.dumps(dict(doc, state=[1, 2])), json.dumps(dict(doc, version=0))):
        path.write_text(bad)
        with _auto(full_path, machine, monkeypatch) as llm:
            assert llm.engine_stats()["acceptance_prior"] is None, bad
            assert llm._engine.length_prior is None
    # figures out of range are clamped, not trusted
    got = AdaptiveLength.from_state(dict(p=[1.5, -1, 0.5], misses=-2, limit=99, seen=99))
    assert got.p == [1.0, 0.0, 0.5] + [1.0] * (CAP - 3) and (got.misses, got.limit, got.seen) == (0, CAP, CAP)
    assert AdaptiveLength.from_state(got.state()).state() == got.state()


def test_without_a_cache_folder_no_acceptance_is_saved(full_path, tmp_path, monkeypatch):
    monkeypatch.setenv(prior_mod.COSTS_ENV, "off")
    machine = FakeMachine(GPU)
    for _ in range(2):
        with _auto(full_path, machine, monkeypatch) as llm:
            assert llm.engine_stats()["acceptance_prior"] is None
            assert _lengths(llm, n=12).get(2, 0) == 1  # each first request probes, doubling


# a CPU whose 2-token batch costs what its tile does (3 decodes), up to 7 tokens: a draft of 1 or
# 2 never pays, one of 4 or more does where the head agrees
TILE = dict(target=lambda n: 0.010 if n == 1 else 0.030, catch_up=lambda n: 0.001 * n, draft=lambda m: 0.001 * m)


@pytest.fixture(scope="module")
def never_path(models_dir):
    return str(make_tiny_mtp_model(models_dir / "prior-never.gguf", seed=31, agreement=0.0))


def test_a_scout_of_a_plain_step_is_a_shadow_draft_judged_by_the_tokens_that_follow(full_path, never_path,
                                                                                   costs_folder, monkeypatch):
    machine = FakeMachine(TILE)
    # a head that always agrees: the probes (1, then 2 tokens) are drafted on the side of plain
    # steps, never verified (no target batch of 2 or 3 tokens), and the limit they grow reaches
    # the drafts that pay (3 tokens and more)
    with _auto(full_path, machine, monkeypatch) as llm:
        first = _lengths(llm)
        t = llm.timings()
    assert t["shadow_drafts"] == 2 and not {1, 2} & set(first), (t["shadow_drafts"], first)
    assert first.get(4, 0) + first.get(CAP, 0) >= 4 and t["draft_n_accepted"] == t["draft_n"] > 0, first
    # a head that never agrees: one shadow draft, missed; no draft is verified, no step is longer
    # than a plain one, and the text is no drafting's
    with Llama(never_path, **KW) as plain:
        want = plain.create_completion(PROMPT, max_tokens=40, temperature=0.0)["choices"][0]["text"]
    with _auto(never_path, machine, monkeypatch) as llm:
        got = llm.create_completion(PROMPT, max_tokens=40, temperature=0.0)["choices"][0]["text"]
        t = llm.timings()
        total = llm.draft_stats.total
    assert got == want and t["draft_lengths"] == {0: 40} and t["draft_n"] == 0, t
    assert t["shadow_drafts"] == 1 == total.shadows and total.drafted == 0
    # the miss was judged: the saved acceptance has it (the estimate drifted up since)
    saved = [json.loads(p.read_text())["state"] for p in costs_folder.glob("acceptance-*.json")]
    assert any((s["misses"], s["seen"], s["limit"]) == (1, 1, 1) and s["p"][0] < 0.9 for s in saved), saved


def test_with_synthetic_acceptance_a_scout_is_verified(never_path, costs_folder, monkeypatch):
    # verification accepts at random there, not by match: a shadow draft could not be judged
    machine = FakeMachine(TILE)
    machine.install(monkeypatch)
    with pytest.warns(RuntimeWarning):
        llm = Llama(never_path, draft="mtp", draft_max="auto", draft_synth_rates=[1.0] * CAP, **KW)
    with llm:
        lengths = _lengths(llm)
        t = llm.timings()
    assert t["shadow_drafts"] == 0 and lengths.get(1, 0) == 1 and t["draft_n"] > 0, (t["shadow_drafts"], lengths)


def test_a_shadow_draft_is_judged_token_by_token_as_the_target_samples_them():
    length = AdaptiveLength()
    length.shadow = [5, 6, 7]
    assert not length.judge(0, 0, [5]) and length.shadow_kept == 1  # pending: one of three seen
    assert not length.judge(0, 0, [6]) and length.p[0] == 1.0
    assert length.judge(0, 0, [7, 9]) and length.shadow == [] and length.limit == 6 and length.seen == 3
    length.shadow = [1, 2]
    assert length.judge(0, 0, [1, 3]) and length.shadow == [] and (length.seen, length.limit) == (3, 2)
    assert length.p[1] == pytest.approx(0.5) and length.misses == 1
    # a verified draft's verdict and a shadow's in one step: both applied
    length.shadow = [4]
    assert length.judge(2, 2, [8, 8, 8]) and length.shadow == [] and length.p[0] == pytest.approx(0.5)
    # a policy flags a scout of a plain slot only
    policy = DraftPolicy(FixedCosts(TILE["target"], TILE["catch_up"], TILE["draft"]))
    assert policy.choose([([1.0] * CAP, CAP)], limits=[1]) == [1] and policy.shadows == [True]
    assert policy.choose([([1.0] * CAP, CAP)], limits=[4]) == [4] and policy.shadows == [False]
    assert policy.choose([([1.0] * CAP, CAP)], limits=[6]) == [6] and policy.shadows == [False]
