"""Drafting on a recurrent target whose rollback snapshots do not reach the draft: speculative
checkpoints (``llama_metaws.engine.rollback``), as llama-server and llama-speculative-simple draft
for qwen3next (llama.cpp clamps its ``n_rs_seq`` to 0).

Each case checks what a user sees (greedy output equal to no drafting, drafts made and accepted,
the workspace shared) and that the checkpoints were used (``DraftStats.restored``): qwen3next
through ``Llama`` (one and two sequences, two on one device and under tensor split,
``draft_max="auto"``, a binding draft model) and ``serve -np 2``; a qwen35 target whose snapshots
reach fewer tokens than the draft; and the policy weighing a checkpoint's cost.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import llama_cpp

from llama_metaws import Llama
from llama_metaws.engine import contexts as loading
from llama_metaws.engine.core import Engine
from llama_metaws.engine.limits import check_draft_max
from llama_metaws.engine.policy import DraftPolicy, FixedCosts
from llama_metaws.engine.request import Request
from llama_metaws.engine.samplers import SamplingParams
from llama_metaws_dev.testing import make_tiny_mtp_model, split_devices
from llama_metaws_dev.testing.families import family_plan, make_family_model

from drafting_runs import KW, MAX_TOKENS, PROMPTS, concurrently, shares_workspace as _shared, tokens as _tokens
from serving import Server

AGREEMENT = 0.75  # a partial accept every few steps: the checkpoint is restored often


@pytest.fixture(scope="module")
def next_path(models_dir):
    return str(make_family_model("qwen3next", models_dir / "ckpt-qwen3next.gguf", seed=5, agreement=AGREEMENT))


@pytest.fixture(scope="module")
def expected(next_path):
    """Each prompt's greedy tokens without drafting."""
    with Llama(next_path, **KW) as llm:
        return [_tokens(llm, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]


def test_qwen3next_has_no_rollback_snapshots_and_drafts_losslessly_with_checkpoints(next_path, expected):
    with Llama(next_path, draft="mtp", draft_max=3, **KW) as llm:
        assert llama_cpp.llama_n_rs_seq(llm._ctx.ctx) == 0  # llama.cpp clamped it: no snapshots
        for prompt, n, want in zip(PROMPTS, MAX_TOKENS, expected):
            assert _tokens(llm, prompt, n) == want
        total = llm.draft_stats.total
        assert 0 < total.accepted < total.drafted
        assert total.restored > 0  # partial accepts, undone by the checkpoint and replayed
        assert _shared(llm)
        # a request after one that ended with a replay pending reuses what its slot holds
        restored = llm.checkpoint_stats()["restored"]
        assert _tokens(llm, PROMPTS[2], MAX_TOKENS[2]) == expected[2]
        assert llm.checkpoint_stats()["restored"] == restored + 1


@pytest.mark.parametrize("draft_max", [1, 5])
def test_other_draft_lengths(next_path, expected, draft_max):
    with Llama(next_path, draft="mtp", draft_max=draft_max, **KW) as llm:
        for prompt, n, want in zip(PROMPTS, MAX_TOKENS, expected):
            assert _tokens(llm, prompt, n) == want
        assert llm.draft_stats.total.restored > 0 and llm.draft_stats.total.accepted > 0


# under tensor split too: two sequences in a batch aborted in the meta backend before patch 0032,
# and the zeroed partial of a device without a slice read unwritten memory before patch 0030 (NaN
# logits in some runs)
@pytest.mark.parametrize("split", [{}, dict(devices=split_devices(2), split_mode="tensor")], ids=["one", "tensor"])
def test_two_sequences_at_once_equal_their_solo_outputs(next_path, expected, split):
    with Llama(next_path, draft="mtp", draft_max=3, n_seq_max=2, **split, **KW) as llm:
        assert concurrently(llm) == expected
        assert llm.engine_stats()["slots_busy_max"] == 2
        assert llm.draft_stats.total.restored > 0 and _shared(llm)


def test_auto_draft_max_weighs_the_checkpoints_and_stays_lossless(next_path, expected):
    with Llama(next_path, draft="mtp", draft_max="auto", **KW) as llm:
        costs = llm._engine.costs
        assert costs.checkpoint_above == 0
        for prompt, n, want in zip(PROMPTS, MAX_TOKENS, expected):
            assert _tokens(llm, prompt, n) == want
        if llm.draft_stats.total.drafted:  # the steps that drafted timed their checkpoints
            assert costs.save.known


def test_a_stop_inside_a_draft_leaves_the_slot_holding_what_the_target_holds(next_path, expected):
    """A stop string at a draft token ends the request with the rest of the draft rejected: the
    checkpoint is restored and the replay never runs, so the slot gives back what the target no
    longer holds; the next request on it reuses its prefix from there."""
    with Llama(next_path, **KW) as ref:
        pieces = [ref.detokenize(expected[0][i:i + 2]).decode() for i in range(1, 14)]
        want = [ref.create_completion(PROMPTS[0], max_tokens=24, temperature=0.0, stop=[s])["choices"][0]["text"]
                for s in pieces]
    with Llama(next_path, draft="mtp", draft_max=3, **KW) as llm:
        engine, pending = llm._engine, []
        finish = engine.finish
        engine.finish = lambda slot, reason, *a, **kw: pending.append(slot.replay) or finish(slot, reason, *a, **kw)
        for stop, text in zip(pieces, want):
            assert llm.create_completion(PROMPTS[0], max_tokens=24, temperature=0.0, stop=[stop])["choices"][0]["text"] == text
            assert engine.slots[0].replay == 0
            assert _tokens(llm, PROMPTS[0], MAX_TOKENS[0]) == expected[0]
        assert any(pending)  # some ended with a replay pending


class Successors:
    """A binding draft model for the agreement design: the target's next two tokens, then a wrong
    one (two of three accepted on every step: a checkpoint restored each time)."""

    def __init__(self, succ):
        self.succ = succ

    def __call__(self, input_ids, **kw):
        a = int(self.succ[int(input_ids[-1])])
        b = int(self.succ[a])
        return np.asarray([a, b, int(self.succ[self.succ[b]])], dtype=np.intc)


def test_a_binding_draft_model_on_qwen3next(next_path, expected):
    succ = family_plan("qwen3next", AGREEMENT, seed=5)["succ"]
    with Llama(next_path, draft_model=Successors(succ), **KW) as llm:
        for prompt, n, want in zip(PROMPTS, MAX_TOKENS, expected):
            assert _tokens(llm, prompt, n) == want
        total = llm.draft_stats.total
        # a step asked for k drafts proposes min(k, 3): two kept, a checkpoint restored from three on
        assert total.accepted == sum(min(k, 2) * c for k, c in total.lengths.items())
        assert total.restored == sum(c for k, c in total.lengths.items() if k >= 3) > 0


def test_serve_np_2_drafts_for_qwen3next(next_path, expected, tmp_path):
    srv = Server(next_path, "--spec-type", "draft-mtp", "--spec-draft-n-max", "3", "-np", "2", "-c", "512",
                 "-b", "64", "-ub", "64", log_path=tmp_path / "serve.log")
    try:
        body = lambda i: {"prompt": PROMPTS[i], "n_predict": MAX_TOKENS[i], "temperature": 0.0,  # noqa: E731
                          "n_probs": 1, "cache_prompt": False}
        got = [None] * 2

        def run(i):
            status, out = srv.json("POST", "/completion", body(i))
            assert status == 200, out
            got[i] = ([p["id"] for p in out["completion_probabilities"]], out["timings"])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert [ids for ids, _ in got] == expected[:2]
        assert sum(t.get("draft_n_accepted", 0) for _, t in got) > 0
    finally:
        srv.kill()
    assert "Traceback" not in srv.log(), srv.log()


# --------------------------------------------------------------------------------------------
# a qwen35 target whose snapshots reach fewer tokens than the draft


def test_drafts_longer_than_the_snapshots_reach_use_a_checkpoint(models_dir):
    path = make_tiny_mtp_model(models_dir / "ckpt-qwen35.gguf", seed=7, agreement=0.75)
    model = loading.load_model(str(path), load_mtp=True)
    ref = loading.new_context(model, n_ctx=256, n_batch=32)
    tgt = loading.new_context(model, n_ctx=256, n_batch=32, n_rs_seq=1)
    dft = loading.new_context(model, n_ctx=256, n_batch=32, mtp=True)
    try:
        prompt = [3, 1, 4, 1, 5, 9, 2, 6]
        want = loading.greedy_tokens(ref, prompt, 30)
        with Engine(tgt, dft, draft_max=3) as engine:
            restores = []
            restore = engine.restore_target
            engine.restore_target = lambda seq, state, n: restores.append(n) or restore(seq, state, n)
            r = engine.submit(Request(prompt, SamplingParams(temp=0.0), max_tokens=30, stop_at_eog=False))
            assert r.wait() == want
            assert restores and r.stats.restored == len(restores)  # drafts of 2 and 3
            assert 0 < r.stats.accepted < r.stats.drafted
    finally:
        for ctx in (dft, tgt, ref):
            ctx.close()
        model.close()


def test_the_ubatch_rule_holds_for_the_drafts_the_snapshots_undo_only():
    check_draft_max(6, 64, n_rs_seq=0, n_ubatch=2)   # every draft checkpointed
    check_draft_max(6, 64, n_rs_seq=1, n_ubatch=2)   # one token undone by the snapshots: 2 tokens
    with pytest.raises(ValueError, match=r"3 tokens.*n_rs_seq 2.*n_ubatch 2"):
        check_draft_max(6, 64, n_rs_seq=2, n_ubatch=2)


def test_the_policy_weighs_a_checkpoint():
    """A draft that pays on its own does not where a checkpoint costs more than it gains; the
    chance of a partial accept weighs the restore and the replay."""
    def choose(save, restore=lambda m: 0.0, p=0.9):
        costs = FixedCosts(target=lambda n: 0.010 + 0.001 * n, draft=lambda n: 0.001, save=save, restore=restore)
        costs.checkpoint_above = 0
        return DraftPolicy(costs).choose([([p] * 3, 3)])[0]

    assert choose(lambda m: 0.0) == 3
    assert choose(lambda m: 0.05) == 0  # the checkpoint costs five decodes
    # a restore that costs much makes a long draft (more chances to be cut short) dearer
    assert choose(lambda m: 0.0, restore=lambda m: 0.02, p=0.6) < choose(lambda m: 0.0, p=0.6)
