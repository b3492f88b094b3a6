"""Context shift, llama-server's ``--context-shift``: a generation that fills its slot's context drops
half of what follows the kept tokens and goes on (``Llama(context_shift=True)``, engine/shift.py);
a model whose memory cannot shift (qwen35's M-RoPE attention) gets a warning and ends there, as
llama-server does."""

import warnings

import numpy as np
import pytest

from llama_metaws import Llama
from llama_metaws_dev.testing import EOS_TOKEN, make_tiny_model
from serving import Server

N_CTX = 256
PROMPT = [1 + i % 120 for i in range(199)]  # 199 token ids: 57 positions left in a 256-token slot
KW = dict(n_ctx=N_CTX, n_batch=64, n_ubatch=64, verbose=False)
NO_END = {EOS_TOKEN: float("-inf")}


@pytest.fixture(scope="module")
def plain(models_dir):
    return str(make_tiny_model(models_dir / "shift-llama.gguf", seed=5))


class Propose:
    """A binding draft model that drafts the same tokens every step."""

    def __init__(self, tokens):
        self.tokens = np.asarray(tokens, dtype=np.intc)

    def __call__(self, input_ids, **kw):
        return self.tokens


def _complete(llm, n, prompt=PROMPT):
    out = llm(prompt, max_tokens=n, temperature=0.0, logit_bias=NO_END, logprobs=1)
    choice = out["choices"][0]
    return choice["logprobs"]["token_ids"], choice["finish_reason"]


def test_a_generation_goes_on_past_the_slots_context(plain):
    with Llama(plain, **KW) as llm:  # as before: the context ends it
        short, finish = _complete(llm, 300)
    assert finish == "length" and len(short) == N_CTX - len(PROMPT)
    with Llama(plain, context_shift=True, **KW) as llm:
        ids, finish = _complete(llm, 300)
        n_past = llm.slots()[0]["n_past"]
        # what the contexts hold is what the slot says (positions 0 .. n_past - 1)
        assert llm._engine.seq_pos_max(0) == n_past - 1
        again, _ = _complete(llm, 5)  # the slot serves the next request
        assert llm.timings()["prompt_n"] >= 1 and len(again) == 5
    assert finish == "length" and len(ids) == 300 and n_past < N_CTX
    assert ids[: len(short)] == short  # nothing changes before the context is full


def test_drafts_go_on_across_a_shift(plain):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # synthetic acceptance's
        llm = Llama(plain, context_shift=True, draft_model=Propose([5, 6, 7]), draft_synth_rates=[1.0] * 10, **KW)
    with llm:
        ids, finish = _complete(llm, 301)
        t = llm.timings()
        assert llm._engine.seq_pos_max(0) == llm.slots()[0]["n_past"] - 1
    assert finish == "length" and len(ids) == 301 and t["draft_n_accepted"] == t["draft_n"] > 150
    tail = ids[-40:]  # well past the shift, still drafts and the target's token in turn
    assert any(tail[i : i + 3] == [5, 6, 7] for i in range(len(tail) - 3))


def test_a_model_that_cannot_shift_is_warned_and_ends_at_its_context(tiny_mtp_model):
    with pytest.warns(RuntimeWarning, match="context shift is not supported by this model's memory"):
        llm = Llama(str(tiny_mtp_model), draft="mtp", context_shift=True, **KW)
    with llm:
        ids, finish = _complete(llm, 300, prompt=[1] + PROMPT[:100])
    assert finish == "length" and len(ids) == N_CTX - 101


@pytest.mark.parametrize("which,flags", [("plain", ["--context-shift"]), ("plain", []),
                                         ("mtp", ["--context-shift", "--spec-type", "draft-mtp"])],
                         ids=["shift", "no-shift", "qwen35-shift"])
def test_serve_with_and_without_context_shift(plain, tiny_mtp_model, tmp_path, which, flags):
    model = plain if which == "plain" else tiny_mtp_model
    srv = Server(model, "-c", str(N_CTX), "-b", "64", "-ub", "64", *flags, log_path=tmp_path / "shift.log")
    body = {"prompt": PROMPT, "n_predict": 300, "temperature": 0, "ignore_eos": True}
    try:
        status, res = srv.json("POST", "/completion", body)
        assert status == 200, res
        again, res2 = srv.json("POST", "/completion", dict(body, n_predict=4))  # it still answers
        _, slots = srv.json("GET", "/slots")
        log = srv.log()
    finally:
        srv.kill()
    assert again == 200 and res2["tokens_predicted"] == 4
    assert res["truncated"] is True and res["stop_type"] == "limit" and res["timings"]["prompt_n"] == len(PROMPT)
    if which == "plain" and flags:
        assert res["tokens_predicted"] == 300 and slots[0]["n_past"] < N_CTX
    else:  # as before: the context ends it
        assert res["tokens_predicted"] == N_CTX - len(PROMPT)
    assert ("context shift is not supported" in log) == (which == "mtp"), log


def test_a_generator_read_past_the_context_keeps_what_its_reader_took(plain):
    """``generate`` (token by token, closed by its reader) across a shift: the slot keeps the tokens
    read, in the shifted positions, and the next completion over them reuses them."""
    with Llama(plain, context_shift=True, **KW) as llm:
        taken = []
        gen = llm.generate(PROMPT, temp=0.0, logits_processor=[lambda ids, row: _no_end(row)])
        for tok in gen:
            taken.append(tok)
            if len(taken) == 100:
                break
        gen.close()
        n_past = llm.slots()[0]["n_past"]
        assert llm._engine.seq_pos_max(0) == n_past - 1
        held = llm._engine.slots[0].held().tolist()
    # 199 + 100 tokens read through a 256-token slot: a shift took the first half (this vocabulary
    # adds no BOS: n_keep 0) when 255 were held; the slot holds the tokens read (the last one too
    # where it was decoded), none past them
    assert n_past < len(PROMPT) + 100 - 127 + 1 and held[:3] == PROMPT[127:130]
    assert held[-29:] in (taken[-29:], taken[-30:-1]), (held[-30:], taken[-30:])


def _no_end(row):
    row[EOS_TOKEN] = -np.inf
    return row
