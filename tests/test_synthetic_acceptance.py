"""Synthetic draft acceptance, llama-server's benchmarking mode: ``Llama(draft_synth_rates=...)`` and
``serve --spec-synth-rates`` / ``--spec-synth-len`` accept each draft token at random at the rates
given, whatever the target samples (engine/synthetic.py)."""

import math
import subprocess
import sys

import numpy as np
import pytest

import llama_cpp

from llama_metaws import Llama
from llama_metaws.engine import synthetic
from llama_metaws_dev.testing import EOS_TOKEN, free_port, make_tiny_mtp_model
from serving import Server

KW = dict(n_ctx=256, n_batch=64, n_ubatch=64, verbose=False)
PROMPT = "the quick brown fox"
SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
N_DRAFT_MODEL = 10  # Llama's draft_max with a binding draft model (PROPOSER_MAX)

pytestmark = pytest.mark.filterwarnings("ignore:synthetic speculative acceptance")


@pytest.fixture(scope="module")
def half_path(models_dir):
    # its head agrees with the target half the time; it never drafts nor samples the end token
    return str(make_tiny_mtp_model(models_dir / "synth-half.gguf", seed=31, agreement=0.5))


class Propose:
    """A binding draft model (``draft_model=``) that drafts the same tokens every step."""

    def __init__(self, tokens):
        self.tokens = np.asarray(tokens, dtype=np.intc)

    def __call__(self, input_ids, **kw):
        return self.tokens


def _run(llm, prompt=PROMPT, **kw):
    out = llm(prompt, **kw)
    t = llm.timings()
    return out["choices"][0]["text"], t["draft_n"], t["draft_n_accepted"]


def _ids(llm, **kw):
    """A completion's token ids (its logprobs carry them), and its timings."""
    out = llm(PROMPT, logprobs=1, **kw)
    return out["choices"][0]["logprobs"]["token_ids"], llm.timings()


def test_rates_of_one_keep_every_draft_token_whatever_the_target_samples(tiny_model):
    drafts = [5, 6, 7]
    with Llama(str(tiny_model), draft_model=Propose(drafts), draft_synth_rates=[1.0] * N_DRAFT_MODEL, **KW) as llm:
        ids, t = _ids(llm, max_tokens=21, temperature=0.0)
    assert t["draft_n"] > 0 and t["draft_n_accepted"] == t["draft_n"]
    # after the first token, each step is the three drafts and one token of the target's
    assert len(ids) == 21 and all(ids[1 + 4 * s : 4 + 4 * s] == drafts for s in range(5)), ids


def test_a_drafted_end_of_generation_token_is_never_taken(tiny_model):
    with Llama(str(tiny_model), draft_model=Propose([5, EOS_TOKEN, 6]), draft_synth_rates=[1.0] * N_DRAFT_MODEL,
               **KW) as llm:
        ids, t = _ids(llm, max_tokens=24, temperature=0.0)
    steps = sum(n for length, n in t["draft_lengths"].items() if length > 0)
    assert steps > 3 and t["draft_n_accepted"] == steps < t["draft_n"]  # the 5 of each draft, then the target's
    assert EOS_TOKEN not in ids and ids.count(5) >= steps


def test_synthetic_tokens_do_not_advance_the_grammar(tiny_model):
    """The grammar sees only the target's tokens: drafts it does not allow are taken, and the target
    samples within it (a grammar that took the drafts would refuse them)."""
    grammar = llama_cpp.LlamaGrammar.from_string('root ::= "1"+', verbose=False)
    with Llama(str(tiny_model), draft_model=Propose([2, 2, 2]), draft_synth_rates=[1.0] * N_DRAFT_MODEL,
               **KW) as llm:
        ids, _ = _ids(llm, max_tokens=13, temperature=0.0, grammar=grammar)
    target = [format(i, "x") for i in ids if i != 2]  # the test vocabulary's texts: the ids in hex
    assert len(ids) == 13 and ids.count(2) == 9, ids  # three steps of three drafts after the first token
    assert len(target) == 4 and set("".join(target)) == {"1"}, target


def test_rates_of_zero_take_no_draft_and_give_no_draftings_tokens(half_path):
    with Llama(half_path, **KW) as plain:
        ref = plain(PROMPT, max_tokens=24, seed=123, **SAMPLED)["choices"][0]["text"]
    with Llama(half_path, draft="mtp", draft_synth_rates=[0.0] * 3, **KW) as llm:
        text, drafted, accepted = _run(llm, max_tokens=24, seed=123, **SAMPLED)
    assert drafted > 0 and accepted == 0 and text == ref


def test_the_same_seed_gives_the_same_acceptance(half_path):
    with Llama(half_path, draft="mtp", draft_synth_rates=[0.8, 0.5, 0.3], **KW) as llm:
        first = _run(llm, max_tokens=40, seed=7, temperature=0.0)
        assert _run(llm, max_tokens=40, seed=7, temperature=0.0) == first
        counts = {_run(llm, max_tokens=40, seed=s, temperature=0.0)[2] for s in range(1, 7)}
    assert first[1] > first[2] > 0 and len(counts) > 1, (first, counts)


def test_a_mean_length_resolves_to_llama_cpps_geometric_rates(half_path):
    rates = synthetic.resolve(None, 2.5, 3)
    p = rates[0]
    assert rates == pytest.approx([p, p * p, p ** 3]) and sum(rates) == pytest.approx(1.5, abs=1e-6)
    assert synthetic.conditional(rates) == pytest.approx([p, p, p])
    assert synthetic.resolve(None, 4.0, 3) == [1.0, 1.0, 1.0] and synthetic.resolve(None, 1.0, 3) == [0.0] * 3
    assert synthetic.conditional([0.5, 0.0, 0.0]) == [0.5, 0.0, 0.0]
    with Llama(half_path, draft="mtp", draft_synth_len=4.0, **KW) as llm:  # every draft kept
        _, drafted, accepted = _run(llm, max_tokens=20, temperature=0.0)
    assert drafted > 0 and accepted == drafted


@pytest.mark.parametrize("kw,words", [
    (dict(draft_synth_rates=[1.0] * 3), "requires speculative decoding"),
    (dict(draft="mtp", draft_synth_rates=[1.0] * 2), "must contain 3 values"),
    (dict(draft="mtp", draft_synth_rates=[0.5, 0.6, 0.1]), "monotonically non-increasing"),
    (dict(draft="mtp", draft_synth_rates=[1.5, 0.6, 0.1]), "within [0, 1]"),
    (dict(draft="mtp", draft_synth_rates=[math.nan, 0.6, 0.1]), "within [0, 1]"),
    (dict(draft="mtp", draft_synth_rates=[1.0] * 3, draft_synth_len=2.0), "mutually exclusive"),
    (dict(draft="mtp", draft_synth_len=4.5), "within [1, 4]"),
    (dict(draft="mtp", draft_synth_len=0.5), "within [1, 4]"),
])
def test_bad_rates_are_a_value_error_before_loading(half_path, kw, words):
    with pytest.raises(ValueError) as e:
        Llama(half_path, **KW, **kw)
    assert words in str(e.value)


def _serve_fails(model, *flags):
    res = subprocess.run([sys.executable, "-m", "llama_metaws", "serve", "-m", str(model), "--port", str(free_port()),
                          *flags], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 2, (res.returncode, res.stderr)
    return res.stderr


def test_serves_flags_are_checked_at_start_up(half_path):
    assert "--spec-synth-rates: invalid value" in _serve_fails(half_path, "--spec-synth-rates", "1,x")
    assert "--spec-synth-len: invalid value" in _serve_fails(half_path, "--spec-synth-len", "-1")
    err = _serve_fails(half_path, "--spec-type", "draft-mtp", "--spec-synth-rates", "1,1", "-c", "256")
    assert "must contain 3 values" in err and "Traceback" not in err, err
    err = _serve_fails(half_path, "--spec-synth-rates", "1,1,1", "-c", "256")
    assert "requires speculative decoding" in err and "Traceback" not in err, err


@pytest.mark.parametrize("flag,value", [("--spec-synth-rates", "0,0,0"), ("--spec-synth-len", "4")])
def test_serve_accepts_at_the_rates_given_and_warns(half_path, tmp_path, flag, value):
    srv = Server(half_path, "--spec-type", "draft-mtp", "--spec-draft-n-max", "3", "-c", "256", "-b", "64", "-ub", "64",
                 flag, value, log_path=tmp_path / "synth.log")
    body = dict(prompt=PROMPT, n_predict=24, seed=123, return_tokens=True, **SAMPLED)
    try:
        status, res = srv.json("POST", "/completion", body)
        log = srv.log()
    finally:
        srv.kill()
    assert status == 200, res
    t = res["timings"]
    assert "generated output is not valid" in log and t["draft_n"] > 0
    if flag == "--spec-synth-len":  # the longest mean length: every draft kept
        assert t["draft_n_accepted"] == t["draft_n"]
        return
    with Llama(half_path, **KW) as plain:  # no draft kept: the tokens of no drafting
        ref_ids, _ = _ids(plain, max_tokens=24, seed=123, **SAMPLED)
    assert t["draft_n_accepted"] == 0 and res["tokens"] == ref_ids, (res["tokens"], ref_ids)
