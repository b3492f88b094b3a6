"""Several NextN heads in their places: draft step k runs head k (mimo2's three NextN layers,
step35's chained heads), as llama.cpp's draft-mtp does (``chain_heads`` in common/speculative.cpp).

The models are the agreement design with one rate per head (``families.agreement``): head k drafts
``heads_draft[k][x]`` from the token it is given, so each draft can be checked token by token, and
a probe whose head 0 is always right and later heads always wrong accepts exactly the first token
of every draft. Greedy output equals no drafting, with one and two sequences (one device and
tensor split); a draft is at most as long as there are heads, ``draft_max="auto"`` included; a
head the model does not have is an error, not an abort. ``bench/bench_heads.py`` compares the
counts with llama-speculative-simple's.
"""

from __future__ import annotations

import pytest

from llama_metaws import Llama
from llama_metaws_dev.testing import split_devices
from llama_metaws_dev.testing.families import FAMILIES, family_plan, make_family_model

from drafting_runs import KW, MAX_TOKENS, PROMPTS, concurrently, shares_workspace, tokens as _tokens

SEED = 4
CHAINED = [a for a, f in FAMILIES.items() if f.chained_heads and f.mtp_graph]


def test_the_chained_families_are_mimo2_and_step35():
    assert sorted(CHAINED) == ["mimo2", "step35"] and all(FAMILIES[a].n_nextn == 3 for a in CHAINED)


_PATHS = {}


def _path(models_dir, arch, rates):
    key = (arch, tuple(rates))
    if key not in _PATHS:
        name = "-".join(str(r) for r in rates)
        _PATHS[key] = str(make_family_model(arch, models_dir / f"heads-{arch}-{name}.gguf", seed=SEED,
                                            agreement=list(rates)))
    return _PATHS[key]


def _expected(path):
    with Llama(path, **KW) as llm:
        return [_tokens(llm, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]


def _steps(llm):
    """Record each verification's (drafted, accepted)."""
    seen = []
    engine = llm._engine
    roll_back = engine.roll_back

    def recording(verdicts):
        seen.extend((v.drafted, v.accepted) for v in verdicts if v.segment.kind == "decode" and v.drafted)
        return roll_back(verdicts)

    engine.roll_back = recording
    return seen


def _proposals(llm):
    """Record each draft: (the token it continues, the drafts)."""
    seen = []
    head = llm._engine.head
    propose = head.propose

    def recording(starts, *args):
        out = propose(starts, *args)
        seen.extend((last, out[seq]) for seq, last, _pos, _row, _n in starts)
        return out

    head.propose = recording
    return seen


@pytest.mark.parametrize("arch", CHAINED)
def test_head_0_right_and_the_others_wrong_keeps_the_first_draft_token_only(models_dir, arch):
    path = _path(models_dir, arch, [1.0, 0.0, 0.0])
    expected = _expected(path)
    with Llama(path, draft="mtp", draft_max=3, **KW) as llm:
        steps = _steps(llm)
        for prompt, n, want in zip(PROMPTS, MAX_TOKENS, expected):
            assert _tokens(llm, prompt, n) == want
        assert steps and all(accepted == 1 for _, accepted in steps), steps
        assert sum(1 for drafted, _ in steps if drafted == 3) >= len(steps) - len(PROMPTS)
        total = llm.draft_stats.total
        assert total.accepted == total.steps and total.drafted > 2 * total.steps


@pytest.mark.parametrize("arch", CHAINED)
@pytest.mark.parametrize("rates, kept", [([1.0, 1.0, 1.0], "all"), ([0.0, 1.0, 1.0], "none"),
                                         ([1.0, 1.0, 0.0], "two")])
def test_acceptance_follows_each_heads_rate(models_dir, arch, rates, kept):
    path = _path(models_dir, arch, rates)
    expected = _expected(path)
    with Llama(path, draft="mtp", draft_max=3, **KW) as llm:
        steps = _steps(llm)
        for prompt, n, want in zip(PROMPTS, MAX_TOKENS, expected):
            assert _tokens(llm, prompt, n) == want
    want = {"all": lambda d: d, "none": lambda d: 0, "two": lambda d: min(d, 2)}[kept]
    assert steps and all(a == want(d) for d, a in steps), steps


@pytest.mark.parametrize("arch", CHAINED)
def test_draft_step_k_is_head_ks_token(models_dir, arch):
    rates = [0.75, 0.5, 0.25]
    path = _path(models_dir, arch, rates)
    heads = family_plan(arch, rates, seed=SEED)["heads_draft"]
    with Llama(path, draft="mtp", draft_max=3, **KW) as llm:
        drafts = _proposals(llm)
        for prompt, n in zip(PROMPTS, MAX_TOKENS):
            _tokens(llm, prompt, n)
    assert drafts and any(len(d) == 3 for _, d in drafts)
    for last, d in drafts:
        given = [last] + d[:-1]  # head k continues the token drafted before it
        assert d == [int(heads[k][x]) for k, x in enumerate(given)], (last, d)


@pytest.mark.parametrize("split", [{}, dict(devices=split_devices(2), split_mode="tensor")], ids=["one", "tensor"])
@pytest.mark.parametrize("arch", CHAINED)
def test_two_sequences_at_once_equal_their_solo_outputs(models_dir, arch, split):
    path = _path(models_dir, arch, [1.0, 0.0, 0.0])
    expected = _expected(path)
    with Llama(path, draft="mtp", draft_max=3, n_seq_max=2, **split, **KW) as llm:
        steps = _steps(llm)
        assert concurrently(llm) == expected
        assert llm.engine_stats()["slots_busy_max"] == 2
        assert steps and all(accepted == 1 for _, accepted in steps)
        assert shares_workspace(llm)


@pytest.mark.parametrize("draft_max", [5, "auto"])
def test_a_draft_is_at_most_as_long_as_there_are_heads(models_dir, draft_max):
    path = _path(models_dir, "mimo2", [1.0, 1.0, 1.0])
    expected = _expected(path)
    with Llama(path, draft="mtp", draft_max=draft_max, **KW) as llm:
        engine = llm._engine
        assert engine.draft_max == 3 and engine.costs.chained
        drafts = _proposals(llm)
        for prompt, n, want in zip(PROMPTS, MAX_TOKENS, expected):
            assert _tokens(llm, prompt, n) == want
        assert all(len(d) <= 3 for _, d in drafts)
        total = llm.draft_stats.total
        assert total.accepted == total.drafted
        if draft_max == 5:  # (auto drafts where the measured costs say it pays: maybe not here)
            assert max(len(d) for _, d in drafts) == 3 and total.drafted > 0


def test_a_head_the_model_does_not_have_is_an_error(models_dir):
    with Llama(_path(models_dir, "mimo2", [1.0, 0.0, 0.0]), draft="mtp", **KW) as llm:
        head = llm._engine.head
        assert head.n_heads == 3 and head.chained
        for bad in (3, -1):
            with pytest.raises(IndexError, match="NextN blocks"):
                llm._engine.exclusive(lambda: head.select(bad))
        assert _tokens(llm, PROMPTS[0], 6) == _expected(_path(models_dir, "mimo2", [1.0, 0.0, 0.0]))[0][:6]
