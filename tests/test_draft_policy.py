"""``draft_max="auto"``: each step's draft lengths from acceptance and measured costs
(``llama_metaws.engine.policy``).

The policy alone over cost models given as functions; then through ``Llama`` with an injected
cost model (drafting never pays: plain steps only; always pays: the cap), and with the engine's
own measurements under a fake clock that makes decodes cost what a CPU or a GPU would (the choice
follows them). The output is the target's whatever the lengths.
"""

import ctypes
import threading
import time

import pytest

import llama_metaws  # noqa: F401  (the patched build first)
import llama_cpp

from llama_metaws import Llama
from llama_metaws.engine.drafting import AdaptiveLength
from llama_metaws.engine.policy import DraftPolicy, FixedCosts, StepCosts, expected_tokens
from llama_metaws_dev.testing import make_tiny_mtp_model

KW = dict(n_ctx=512, n_batch=64, n_ubatch=64, verbose=False)
PROMPT = "the quick brown fox jumps over the lazy dog " * 4
CAP = AdaptiveLength.CAP

# seconds: a target decode of n tokens on a CPU (each token costs, compute-bound) or on a GPU
# (flat until the batch is large), the draft context's catch-up, one draft decode
CPU = dict(target=lambda n: 0.010 * n, catch_up=lambda n: 0.001 * n, draft=lambda m: 0.004 * m)
GPU = dict(target=lambda n: 0.010 + 0.0002 * n, catch_up=lambda n: 0.0005, draft=lambda m: 0.0008)


def test_expected_tokens_multiplies_the_acceptance_of_each_depth():
    assert expected_tokens([1.0] * 4, 0) == 1.0
    assert expected_tokens([1.0] * 4, 3) == 4.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_where_drafting_never_pays_every_step_is_plain():
    policy = DraftPolicy(FixedCosts(**CPU))
    assert policy.choose([([1.0] * CAP, CAP)]) == [0]  # even a head that always agrees
    assert policy.choose([([1.0] * CAP, CAP)] * 4) == [0, 0, 0, 0]


def test_where_drafting_pays_the_cap_or_the_depths_that_agree():
    policy = DraftPolicy(FixedCosts(**GPU))
    assert policy.choose([([1.0] * CAP, CAP)]) == [CAP]
    assert policy.choose([([1.0] * CAP, 3)]) == [3]  # never past the slot's cap (max_tokens, context)
    # acceptance that falls with depth: the depths worth their draft decode
    k = policy.choose([([0.9, 0.8, 0.3, 0.1, 0.05, 0.05], CAP)])[0]
    assert 1 <= k < CAP
    assert policy.choose([([0.0] * CAP, CAP)]) == [0]  # a head that never agrees: plain steps


def test_a_shared_batch_weighs_every_slots_tokens():
    # a GPU whose batch saturates at 16 tokens: beyond, every token costs like on a CPU
    def saturating(n):
        return 0.010 + 0.010 * max(0, n - 16) / 16 * 4

    policy = DraftPolicy(FixedCosts(target=saturating, draft=lambda m: 0.0005))
    one = policy.choose([([0.9] * CAP, CAP)])
    four = policy.choose([([0.9] * CAP, CAP)] * 4)
    assert one == [CAP]
    assert sum(four) < 4 * CAP  # four slots share the batch: drafting for one lengthens the step of all
    # while the batch is flat, even a head that rarely agrees drafts: its tokens cost nothing
    assert policy.choose([([0.95] * CAP, CAP), ([0.05] * CAP, CAP)]) == [CAP, CAP]
    # once it is full, the slots whose heads agree get the room, the others none
    mixed = policy.choose([([0.05] * CAP, CAP), ([0.95] * CAP, CAP)] * 2)
    assert mixed[1] > 0 and mixed[3] > 0 and mixed[0] == 0 and mixed[2] == 0, mixed
    # a long prompt chunk in the same batch: the step is long anyway, and a draft token adds
    # little to it
    assert sum(policy.choose([([0.9] * CAP, CAP)] * 4, base_tokens=256)) > sum(four)


def test_until_a_cost_is_measured_every_slot_drafts_its_cap():
    assert DraftPolicy(StepCosts()).choose([([0.1] * CAP, 4), ([1.0] * CAP, 2)]) == [4, 2]


def test_measured_costs_interpolate_and_extrapolate():
    costs = StepCosts(clock=lambda: 0.0)
    costs.target.add(1, 0.01)
    assert costs.target(4) == pytest.approx(0.04)  # one size seen: proportional
    costs.target.add(5, 0.02)
    assert costs.target(3) == pytest.approx(0.015) and costs.target(9) == pytest.approx(0.03)
    costs.target.add(1, 0.02)  # a moving average
    assert 0.01 < costs.target(1) < 0.02
    # beyond the largest size, the slope over all of them: two neighbours timed in either order
    # (a CPU's 7-token batch cheaper than its 6-token one) do not make longer batches look free
    cpu = StepCosts(clock=lambda: 0.0)
    for n, seconds in ((1, 0.010), (6, 0.060), (7, 0.055)):
        cpu.target.add(n, seconds)
    assert cpu.target(10) == pytest.approx(0.010 + 0.045 * 9 / 6) and cpu.target(10) > cpu.target(7)


# --------------------------------------------------------------------------------------------
# through Llama


@pytest.fixture(scope="module")
def full_path(models_dir):
    return str(make_tiny_mtp_model(models_dir / "policy-full.gguf", seed=31, agreement=1.0))


@pytest.fixture(scope="module")
def reference(full_path):
    with Llama(full_path, **KW) as plain:
        return plain.create_completion(PROMPT, max_tokens=40, temperature=0.0)["choices"][0]["text"]


def _auto(full_path, costs):
    llm = Llama(full_path, draft="mtp", draft_max="auto", **KW)
    llm._engine.set_costs(costs)
    return llm


def test_an_injected_cost_model_where_drafting_never_pays_gives_plain_steps_only(full_path, reference):
    with _auto(full_path, FixedCosts(**CPU)) as llm:
        out = llm.create_completion(PROMPT, max_tokens=40, temperature=0.0)["choices"][0]["text"]
        t = llm.timings()
        stats = llm.draft_stats
    assert out == reference
    assert t["draft_lengths"] == {0: 40} and t["plain_steps_share"] == 1.0 and t["draft_n"] == 0
    assert stats.last.lengths == {0: 40} and stats.last.plain_steps_share == 1.0
    assert stats.total.lengths == {0: 40} and llm.draft_lengths() == {0: 40}


def test_an_injected_cost_model_where_drafting_always_pays_gives_the_cap(full_path, reference):
    with _auto(full_path, FixedCosts(**GPU)) as llm:
        out = llm.create_completion(PROMPT, max_tokens=40, temperature=0.0)["choices"][0]["text"]
        t = llm.timings()
        stats = llm.draft_stats.last
    assert out == reference
    lengths = t["draft_lengths"]
    assert stats.lengths == lengths and stats.plain_steps_share == t["plain_steps_share"]
    # the head always agrees: every step drafts the cap, but those the request's end cuts short
    assert lengths.get(CAP, 0) >= 4 and set(lengths) <= {CAP, 5, 4, 3, 2, 1, 0}, lengths
    assert sum(k * v for k, v in lengths.items()) == t["draft_n"] == t["draft_n_accepted"]
    assert t["plain_steps_share"] < 0.2


class FakeClock:
    """A clock that advances only when a decode runs, by what the decode would cost."""

    def __init__(self, model):
        self.now, self.model = 0.0, model

    def __call__(self):
        return self.now


@pytest.mark.parametrize("machine,drafts", [("cpu", False), ("gpu", True)])
def test_with_measured_costs_the_choice_follows_them(full_path, reference, monkeypatch, machine, drafts):
    model = CPU if machine == "cpu" else GPU
    clock = FakeClock(model)
    real = llama_cpp.llama_decode
    llm = Llama(full_path, draft="mtp", draft_max="auto", **KW)
    llm._engine.set_costs(StepCosts(clock=clock))
    target = ctypes.cast(llm._ctx.ctx, ctypes.c_void_p).value

    def timed(ctx, batch):
        rc = real(ctx, batch)
        n = batch.n_tokens
        outputs = sum(1 for i in range(n) if batch.logits[i])
        if ctypes.cast(ctx, ctypes.c_void_p).value == target:
            clock.now += model["target"](n)
        elif outputs:  # a draft decode (the head's rows asked for)
            clock.now += model["draft"](n)
        else:  # the draft context's catch-up
            clock.now += model["catch_up"](n)
        return rc

    monkeypatch.setattr(llama_cpp, "llama_decode", timed)
    try:
        for i in range(3):  # the costs are learnt over the requests
            out = llm.create_completion(PROMPT + str(i), max_tokens=40, temperature=0.0)["choices"][0]["text"]
            assert out  # a different prompt each time: its output is not the reference
        last = llm.create_completion(PROMPT, max_tokens=40, temperature=0.0)["choices"][0]["text"]
        t = llm.timings()
    finally:
        llm.close()
    assert last == reference
    if drafts:
        assert t["plain_steps_share"] < 0.2 and t["draft_n"] > 0, t
    else:
        assert t["plain_steps_share"] > 0.8, t  # only a depth tried again now and then drafts


def _linear_costs(n_max):
    """Measured costs (no clock) with target batches of 1 to ``n_max`` tokens timed at 10 ms a token."""
    costs = StepCosts(clock=lambda: 0.0)
    for n in range(1, n_max + 1):
        costs.target.add(n, 0.01 * n)
    return costs


def test_measured_costs_are_measured_again_now_and_then():
    # drafting does not pay by the costs measured so far; an explore step still drafts one token
    # more than the best length (0 here), so that a longer batch is timed again (a change of
    # load is seen); while every step stays plain, each explore doubles the wait for the next
    costs = _linear_costs(7)
    policy = DraftPolicy(costs)
    p = [0.9, 0.9, 0.2, 0.1, 0.1, 0.1]
    E = DraftPolicy.EXPLORE
    chosen = [policy.choose([(p, CAP)])[0] for _ in range(16 * E)]
    assert [i for i, k in enumerate(chosen, start=1) if k] == [E, 3 * E, 7 * E, 15 * E], chosen
    assert set(chosen) == {0, 1}
    assert policy.every == DraftPolicy.EXPLORE_MAX == 16 * E
    # where drafting pays (a cheaper target batch of 2) the best length drafts, and an explore
    # comes every EXPLORE steps again, one token past it
    for _ in range(20):  # a moving average: a new cost weighs in over several timings
        costs.target.add(2, 0.011)
    chosen = [policy.choose([(p, CAP)])[0] for _ in range(2 * E + 1)]
    assert set(chosen) == {1, 2} and chosen.count(2) == 2, chosen
    assert policy.every == E
    # a cost model given as functions is not measured: never explored
    fixed = DraftPolicy(FixedCosts(**CPU))
    assert {fixed.choose([(p, CAP)])[0] for _ in range(2 * DraftPolicy.EXPLORE)} == {0}


def test_a_probe_first_and_after_a_miss_lengths_that_double_and_probes_that_thin_out():
    a = AdaptiveLength()
    assert a.limit == 1  # nothing verified yet: a probe
    a.update(1, 1)
    assert a.limit == 2  # a kept token: twice as long next
    a.update(2, 2)
    a.update(4, 3)
    assert a.limit == CAP  # 2 x 3, as far as the cap
    a.update(CAP, 0)  # the first token rejected: a miss
    assert a.limit == 1 and a.n <= 1

    def steps_to_retry(length):
        n = 0
        while length.next_step() == 0:
            n += 1
        return n

    a.update(1, 0)  # two misses in a row
    twice = steps_to_retry(a)
    a.update(1, 0)
    a.update(1, 0)  # four: the drift is a quarter of what it was after two
    four = steps_to_retry(a)
    assert 0 < twice and four >= 2 * twice, (twice, four)
    a.update(1, 1)  # the probe is accepted: longer again
    assert a.misses == 0 and a.limit == 2
    b = AdaptiveLength(prior=a)  # a new request starts from what was learnt
    assert (b.limit, b.misses, b.p, b.seen) == (a.limit, a.misses, a.p, a.seen)


def test_a_depth_never_verified_is_weighed_at_most_as_the_deepest_verified_one():
    a = AdaptiveLength()
    assert a.estimates == [1.0] * CAP  # nothing verified: every depth at its start
    a.update(1, 0)  # a miss at the first depth: the depths past it were never tried
    assert a.p[1:] == [1.0] * (CAP - 1) and a.estimates == [a.p[0]] * CAP
    a.update(1, 1)
    a.update(2, 1)  # depth 2 rejected once: depths 3 and on at most its estimate
    assert a.seen == 2 and a.estimates[:2] == a.p[:2] and a.estimates[2:] == [a.p[1]] * (CAP - 2)
    a.update(3, 3)  # depth 3 verified: its own estimate (past the second's)
    assert a.seen == 3 and a.estimates[2] == a.p[2] > a.p[1]


@pytest.fixture(scope="module")
def never_path(models_dir):
    return str(make_tiny_mtp_model(models_dir / "policy-never.gguf", seed=31, agreement=0.0))


def test_a_head_that_never_agrees_costs_one_token_probes_only(never_path):
    # drafts would pay if accepted (GPU-like costs), but the head never agrees: the first request
    # probes with one token, then again now and then; the next request starts from what the first
    # learnt, so it probes less often
    with Llama(never_path, **KW) as plain:
        want = [plain.create_completion(PROMPT + s, max_tokens=40, temperature=0.0)["choices"][0]["text"]
                for s in ("", "!")]
    with _auto(never_path, FixedCosts(**GPU)) as llm:
        first = llm.create_completion(PROMPT, max_tokens=40, temperature=0.0)["choices"][0]["text"]
        one = llm.timings()["draft_lengths"]
        second = llm.create_completion(PROMPT + "!", max_tokens=40, temperature=0.0)["choices"][0]["text"]
        two = llm.timings()["draft_lengths"]
    assert [first, second] == want
    assert max(one) == 1 and one[0] > one[1], one
    assert max(two) <= 1 and two.get(1, 0) < one[1], (one, two)


def test_a_batch_size_with_a_cost_of_its_own_is_timed_and_then_chosen():
    # a CPU whose kernel tile makes a 4-token batch nearly as cheap as one token; the engine has
    # timed 1 and 7 tokens only (a probe, then the cap), so 4 is interpolated and the cap looks best
    def target(n):
        return 0.012 if n == 4 else 0.010 + 0.008 * (n - 1)

    costs = StepCosts(clock=lambda: 0.0)
    costs.target.add(1, target(1))
    costs.target.add(7, target(7))
    policy = DraftPolicy(costs)
    p = [1.0] * CAP
    assert policy.choose([(p, CAP)]) == [CAP]
    chosen = []
    for _ in range(6 * DraftPolicy.FILL):
        k = policy.choose([(p, CAP)])[0]
        costs.target.add(1 + k, target(1 + k))  # what the engine would measure
        chosen.append(k)
    filled = [k for i, k in enumerate(chosen, start=2) if i % DraftPolicy.FILL == 0]
    assert filled[:3] == [1, 2, 3], filled  # the untimed sizes, shortest first
    assert chosen[-DraftPolicy.FILL + 1:] == [3] * (DraftPolicy.FILL - 1), chosen  # then the tile's length


def test_with_several_slots_one_slot_in_turn_explores_and_fills():
    # four slots whose drafts would be accepted, on a CPU where drafting does not pay: the best
    # step is plain. An explore or fill step drafts for one slot, in turn, not for all four (a
    # batch four times as long for one more timing); a fill never happens beside prompt tokens.
    costs = _linear_costs(4)
    policy = DraftPolicy(costs)
    p = [0.9, 0.9, 0.2, 0.1, 0.1, 0.1]
    slots = [(p, CAP)] * 4
    chosen = []
    for _ in range(3 * DraftPolicy.EXPLORE):
        k = policy.choose(slots)
        costs.target.add(4 + sum(k), 0.01 * (4 + sum(k)))  # what the engine would measure
        chosen.append(k)
    drafted = [(i, k) for i, k in enumerate(chosen, start=1) if any(k)]
    assert drafted, chosen
    for i, k in drafted:
        assert sorted(k)[:-1] == [0, 0, 0], (i, k)  # one slot at a time
    fills = [k for i, k in drafted if i % DraftPolicy.EXPLORE]
    assert [max(k) for k in fills] == [1, 2], fills  # sizes 5 and 6 timed, shortest first
    assert [k.index(max(k)) for k in fills] == [0, 1], fills  # the next slot's turn
    explores = [k for i, k in drafted if i in (DraftPolicy.EXPLORE, 3 * DraftPolicy.EXPLORE)]
    assert [max(k) for k in explores] == [1, 1] and explores[0] != explores[1], explores
    # beside a prompt chunk a fill step drafts nothing (its batch size is seen once), where a
    # step without one fills: plain steps are best either way, and an untimed size could pay
    # at the least it can cost (that of the size below it)
    costs = StepCosts(clock=lambda: 0.0)
    for n, seconds in [(1, 0.01), (2, 0.02), (3, 0.03), (4, 0.04), (41, 0.41), (43, 0.60)]:
        costs.target.add(n, seconds)
    for base, filled in ((37, False), (0, True)):
        policy = DraftPolicy(costs)
        steps = [policy.choose(slots, base_tokens=base) for _ in range(DraftPolicy.EXPLORE - 1)]
        assert any(map(any, steps)) is filled, (base, steps)


def test_a_batch_size_that_could_not_pay_at_its_least_cost_is_not_timed():
    # a CPU: each target token costs about a decode, and a draft decode 40% of one (a real
    # vocabulary's output head). Timed: 1 and 2 tokens. A draft of 2 makes an untimed 3-token
    # batch, which costs at least what one token does; at agreement 0.5 it could not pay even
    # so, and no fill step drafts it; where every draft token is accepted it could, and is timed.
    def policy_for():
        costs = StepCosts(clock=lambda: 0.0)
        costs.target.add(1, 0.010)
        costs.target.add(2, 0.019)
        costs.draft.add(1, 0.004)
        return DraftPolicy(costs)

    for p, timed in (([0.5] * CAP, False), ([1.0] * CAP, True)):
        policy = policy_for()
        ks = [policy.choose([(p, 2)])[0] for _ in range(DraftPolicy.EXPLORE - 1)]
        assert (2 in ks) is timed and 1 not in ks, (p, ks)


def test_the_least_a_batch_can_cost_is_the_cheapest_timed_size_below_it():
    # a 2-token batch slower than a 3-token one (as on a CPU whose kernel tiles favour 3): the
    # 3-token batch may still be as cheap as one token, so it is timed where that could pay
    costs = StepCosts(clock=lambda: 0.0)
    for n, seconds in ((1, 0.040), (2, 0.092), (4, 0.090)):
        costs.target.add(n, seconds)
    assert costs.target.floor(3) == costs.target.floor(2) == 0.040 and costs.target.floor(0) == 0.0
    assert costs.target.floor(5) == 0.040 and StepCosts().target.floor(3) == 0.0
    costs.draft.add(1, 0.010)
    policy = DraftPolicy(costs)
    ks = [policy.choose([([0.8] * CAP, 2)])[0] for _ in range(DraftPolicy.FILL)]
    assert ks[-1] == 2 and costs.target.has(3) is False, ks


def test_the_target_is_timed_on_steps_whose_tokens_are_all_output_rows(full_path, monkeypatch):
    # a machine where a target decode costs little per token and much per output row (the output
    # head over a real vocabulary): a prompt chunk of n tokens (one output row) costs far less
    # than a verification of n tokens (n rows). The policy weighs verifications, so the curve
    # holds their costs only: a prompt chunk's would make long drafts look cheap.
    def target(n, outputs):
        return 0.002 * n + 0.010 * outputs

    clock = FakeClock(None)
    real = llama_cpp.llama_decode
    llm = Llama(full_path, draft="mtp", draft_max="auto", **KW)
    costs = StepCosts(clock=clock)
    llm._engine.set_costs(costs)
    ctx = ctypes.cast(llm._ctx.ctx, ctypes.c_void_p).value
    prompt_sizes = set()

    def timed(c, batch):
        rc = real(c, batch)
        n = batch.n_tokens
        outputs = sum(1 for i in range(n) if batch.logits[i])
        if ctypes.cast(c, ctypes.c_void_p).value == ctx:
            clock.now += target(n, outputs)
            if outputs < n:
                prompt_sizes.add(n)
        return rc

    monkeypatch.setattr(llama_cpp, "llama_decode", timed)
    try:
        llm.create_completion(PROMPT, max_tokens=24, temperature=0.0)
    finally:
        llm.close()
    assert prompt_sizes and costs.target.sizes, (prompt_sizes, costs.target.sizes)
    for n in costs.target.sizes:
        assert costs.target(n) == pytest.approx(target(n, n)), (n, costs.target.values, prompt_sizes)


# --------------------------------------------------------------------------------------------
# the margin, the scouts, and the drift after drafts cut short


def _tile(n):
    """A CPU whose 2- and 3-token batches cost a decode a token, and whose 4-token batch fills a
    kernel's tile (the bench shape on one thread: 1, 1.9, 2.9, 2.4 decodes)."""
    return 0.010 * {1: 1.0, 2: 1.9, 3: 2.9, 4: 2.4}.get(n, 0.6 * n)


TILE = dict(target=_tile, catch_up=lambda n: 0.0002 * n, draft=lambda m: 0.0015 * m)


def test_a_draft_must_beat_a_plain_step_by_the_margin():
    # a draft of one token that yields 1.05x (then 1.2x) the plain step's rate
    for gain, drafts in ((1.05, False), (1.2, True)):
        policy = DraftPolicy(FixedCosts(target=lambda n, g=gain: 0.010 * (1 if n == 1 else 2 / g)))
        assert (policy.choose([([1.0] * CAP, 1)]) == [1]) is drafts, gain
    assert 1.05 < DraftPolicy.MARGIN < 1.2


def test_a_slot_whose_limit_alone_holds_it_back_scouts_at_its_limit():
    policy = DraftPolicy(FixedCosts(**TILE))
    p = [1.0] * CAP
    assert policy.choose([(p, CAP)]) == [3]  # no limit: the tile's draft pays, 1 and 2 do not
    assert policy.choose([(p, CAP)], limits=[1]) == [1]  # a fresh slot: a probe of one, a scout
    assert policy.choose([(p, CAP)], limits=[2]) == [2]
    assert policy.choose([(p, CAP)], limits=[4]) == [3]  # within the limit: the best length
    # a head that agrees at one half: no draft pays, limits or not, and nothing scouts
    assert policy.choose([([0.5] * CAP, CAP)], limits=[1]) == [0]
    # four fresh slots on a machine whose batch costs one decode up to 4 tokens and two beyond
    # (up to 40): all four drafting long pays, one short draft does not. One scouts a step, in turn
    policy = DraftPolicy(FixedCosts(target=lambda n: 0.010 if n <= 4 else 0.021, draft=lambda m: 0.0001))
    assert policy.choose([(p, CAP)] * 4, limits=[1] * 4) == [1, 0, 0, 0]
    steps = [policy.choose([(p, CAP)] * 4, limits=[1] * 4) for _ in range(4)]
    assert all(sorted(k) == [0, 0, 0, 1] for k in steps), steps
    assert [k.index(1) for k in steps] == [1, 2, 3, 0], steps  # the turn went on from the first scout


def _simulate(costs, agreement, steps, seed=7):
    """One slot's ``steps`` steps of AdaptiveLength and DraftPolicy against a head that agrees at
    random with ``agreement`` (each draft token in turn); the lengths drafted, step by step."""
    import random

    rng = random.Random(seed)
    policy, length = DraftPolicy(costs), AdaptiveLength()
    out = []
    for _ in range(steps):
        length.drift()
        k = policy.choose([(length.estimates, CAP)], limits=[length.limit])[0]
        if k:
            kept = 0
            while kept < k and rng.random() < agreement:
                kept += 1
            length.update(k, kept)
        out.append(k)
    return out


def test_scouts_reach_a_long_draft_where_the_head_agrees_and_thin_out_where_it_does_not():
    costs = FixedCosts(**TILE)
    agree = _simulate(costs, 1.0, 64)
    assert agree[:2] == [1, 2] and set(agree[2:]) == {3}, agree  # scouts of 1 and 2, then the tile
    never = _simulate(costs, 0.0, 64)
    assert 1 <= sum(1 for k in never if k) <= 2 and max(never) == 1, never  # probes of one, twice at most
    half = _simulate(costs, 0.5, 64)
    assert sum(1 for k in half if k) <= 4, half


def _measured(funcs):
    """A measured cost model (explored, unlike FixedCosts) seeded with ``funcs`` at every size, as
    the engine's prior seeds it at load."""
    costs = StepCosts(clock=lambda: 0.0)
    for curve, name in ((costs.target, "target"), (costs.catch_up, "catch_up"), (costs.draft, "draft")):
        curve.seed({n: funcs[name](n) for n in range(1, CAP + 2)})
    return costs


@pytest.mark.parametrize("primed", [True, False])
def test_a_prior_counts_as_the_first_explore_and_a_scout_brings_none_forward(primed):
    # the head never agrees, on a CPU where only a long draft could pay: a fresh slot scouts one
    # token at the first step; that is no sign that drafting pays, so the explores keep their
    # schedule, and a policy started from a prior (every size timed at load) waits twice as long
    # for its first: a request of 64 tokens drafts once, where an unprimed policy drafts twice
    policy, length = DraftPolicy(_measured(TILE), primed=primed), AdaptiveLength()
    E = DraftPolicy.EXPLORE
    drafted = []
    for step in range(1, 65):
        length.drift()
        k = policy.choose([(length.estimates, CAP)], limits=[length.limit])[0]
        if k:
            drafted.append((step, k))
            length.update(k, 0)
        if step == 1:
            assert k == 1 and policy.next_explore == (2 * E if primed else E), policy.next_explore
    assert drafted == ([(1, 1)] if primed else [(1, 1), (E, 1)]), drafted


def test_a_draft_cut_short_halves_the_drift():
    a = AdaptiveLength()
    a.update(1, 1)
    a.update(2, 2)
    assert a.misses == 0
    a.update(4, 2)  # two tokens kept of four: cut short, not a miss
    assert a.misses == 1 and a.limit == 4
    before = list(a.p)
    a.drift()
    assert a.p[2] - before[2] == pytest.approx(AdaptiveLength.RETRY / 2)
    a.update(4, 4)
    assert a.misses == 0


# --------------------------------------------------------------------------------------------
# a plain step's catch-up deferred (execute.py's lag)


@pytest.mark.parametrize("n_seq", [1, 2])
def test_a_plain_steps_catch_up_waits_for_the_next_draft_and_changes_no_draft(full_path, monkeypatch, n_seq):
    # draft lengths scripted per step (plain steps between drafts of 3, 2 and 1): the draft
    # context is fed the plain steps' tokens late, in one batch before the next draft, and drafts
    # exactly what it drafts fed at every step; the plain steps cost no draft decode
    from llama_metaws.engine import drafting as drafting_mod

    script = [0, 0, 0, 3, 0, 0, 2, 0, 0, 0, 0, 0, 1, 0]
    prompts = [PROMPT, PROMPT[::-1]][:n_seq]

    def run(defer):
        decodes, behind = [], []
        real, propose = drafting_mod.MTPHead._decode, drafting_mod.MTPHead.propose
        monkeypatch.setattr(drafting_mod.MTPHead, "_decode",
                            lambda self, b, phase: (decodes.append((phase, b.n)), real(self, b, phase))[1])

        def checked(self, starts, on_depth=None):  # the draft context holds every position before a draft's
            mem = llama_cpp.llama_get_memory(self.draft.ctx)
            behind.extend((pos, llama_cpp.llama_memory_seq_pos_max(mem, seq)) for seq, _, pos, _, _ in starts)
            return propose(self, starts, on_depth)

        monkeypatch.setattr(drafting_mod.MTPHead, "propose", checked)
        with Llama(full_path, draft="mtp", draft_max="auto", n_seq_max=n_seq, **KW) as llm:
            e = llm._engine
            e.defer_catch_up = defer
            decodes.clear()  # the cost prior's at load
            step = iter(range(10 ** 6))

            def scripted(going, verdicts):
                i = next(step)
                return [min(script[i % len(script)], e.draft_length(v)) for v in going]

            monkeypatch.setattr(e, "draft_lengths", scripted)
            import concurrent.futures as cf
            gate = threading.Event()  # the engine's thread held until every request waits: they start together
            with cf.ThreadPoolExecutor(n_seq + 1) as pool:
                held = pool.submit(e.exclusive, gate.wait)
                runs = [pool.submit(lambda p=p: llm.create_completion(p, max_tokens=40, temperature=0.0)
                                    ["choices"][0]["text"]) for p in prompts]
                deadline = time.monotonic() + 60
                while len(e.queued()[0]) < n_seq and time.monotonic() < deadline:
                    time.sleep(0.01)
                gate.set()
                held.result()
                outs = [f.result() for f in runs]
            total = e.total
            lags = [len(s.lag) for s in e.slots]
        monkeypatch.setattr(drafting_mod.MTPHead, "_decode", real)
        monkeypatch.setattr(drafting_mod.MTPHead, "propose", propose)
        assert behind and all(held == pos - 1 for pos, held in behind), (defer, behind)
        return outs, (total.drafted, total.accepted), decodes, lags

    outs, stats, decodes, lags = run(True)
    outs0, stats0, decodes0, lags0 = run(False)
    assert outs == outs0
    assert stats[0] > 0 and stats[1] == stats[0]  # the head agrees: every draft kept, as when fed each step
    assert lags == lags0 == [0] * n_seq  # nothing left waiting after the requests
    catch_ups = [n for phase, n in decodes if phase == "decoding"]
    catch_ups0 = [n for phase, n in decodes0 if phase == "decoding"]
    fed = [sum(n for phase, n in d if phase != "drafting") for d in (decodes, decodes0)]
    assert stats == stats0 and fed[0] == fed[1]  # the same tokens (a prompt's last one may be a catch-up), fed ...
    assert len(catch_ups) <= len(catch_ups0) / 2, (catch_ups, catch_ups0)  # ... in half the decodes or fewer
    assert max(catch_ups) > max(catch_ups0)  # a lag fed in one batch


def _recurrent_split(seqs):
    """A recurrent target's graphs for a step where slot i decodes counts[i] tokens (llama.cpp's
    split_equal, keeping the last 7 tokens of a sequence in one graph)."""
    from llama_metaws.engine.schedule import ubatch_sizes

    return lambda counts: ubatch_sizes(list(zip(seqs, counts)), 64, sequential=True, keep_tail=7, split_equal=True)


def test_a_recurrent_targets_batch_is_split_into_graphs_of_equal_tokens_per_sequence():
    from llama_metaws.engine.schedule import ubatch_sizes

    split = _recurrent_split([0, 1, 2, 3])
    assert split([1, 1]) == [2] and split([2, 2]) == [4]     # equal: one graph
    assert split([2, 1]) == [2, 1] and split([1, 1, 1, 1]) == [4]
    assert split([2, 1, 1, 1]) == [2, 3]                     # one slot drafts: two graphs
    assert ubatch_sizes([(0, 150), (1, 1)], 64, sequential=False, keep_tail=0, split_equal=False) == [64, 64, 23]
    assert ubatch_sizes([(0, 0)], 64, sequential=True, keep_tail=0, split_equal=True) == []


# a graph of 2 to 14 tokens costs about what one of a single token does (a device with room);
# 2 graphs cost twice
TILED = dict(target=lambda n: 0.020 if n == 1 else 0.021 + 0.0001 * n, catch_up=lambda n: 0.0, draft=lambda m: 0.001)


def test_several_slots_draft_equal_lengths_where_a_step_costs_its_graphs():
    costs = FixedCosts(TILED["target"], TILED["catch_up"], TILED["draft"])
    agree = ([1.0] * CAP, CAP)
    # probes of one token each: one slot drafting alone makes two graphs and does not pay, both
    # drafting make one graph of 4 tokens and do
    policy = DraftPolicy(costs)
    assert policy.choose([agree, agree], limits=[1, 1], split=_recurrent_split([0, 1])) == [1, 1]
    # where only one head agrees, its draft alone would be a second graph: the other slot drafts
    # too (a token it will not keep, nearly free in a graph of equal lengths)
    never = ([0.0] * CAP, CAP)
    assert policy.choose([agree, never], limits=[1, 1], split=_recurrent_split([0, 1])) == [1, 1]
    # and where a graph's tokens cost, neither drafts
    assert DraftPolicy(FixedCosts(lambda n: 0.010 * n)).choose(
        [agree, never], limits=[1, 1], split=_recurrent_split([0, 1])) == [0, 0]
    # as one graph (no split given: a unified KV cache, no recurrent state) that draft pays
    assert DraftPolicy(costs).choose([agree, never], limits=[1, 1]) == [1, 0]
    # the step's costs are each graph's: 2 graphs of 2 and 1 tokens
    assert costs.step([2, 1], [1]) == pytest.approx(TILED["target"](2) + TILED["target"](1) + 0.001)
    assert costs.step([3], [1]) == pytest.approx(TILED["target"](3) + 0.001)
