"""A hypothesis state machine over the phase-aware workspace: random sequences of requests,
target-only and draft-only work, detach/attach and teardown in either order, on agreement
models of several acceptance rates and a random one, with split_mode "none" and "tensor" (two
CPU devices), in the modes "alias", "private-meta" and "off".

After every step:

* every output equals the greedy output of the model alone (no workspace, no drafting), computed
  once per prompt on a plain context of the same split mode;
* nothing crashed (a crash would end the run);
* each shared entry holds at least the larger published requirement (ggml-alloc.h: "an entry is
  never smaller than the largest published requirement"), and exactly that once both roles
  have republished since the last shrink request (see ``_settles``);
* the generation of each living context (``context_info(ctx).generation``) never goes back,
  also across the scheduler rebuild that follows a detach
  (``test_the_generation_of_a_survivor_does_not_go_back``).

Seeded (``derandomize=True``) and bounded: the same examples every run, in well under 90 s.
Models are loaded once per module and kept in a dict outside the machine.
"""

import collections

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

import llama_cpp
from llama_cpp import _internals

from llama_metaws.engine.batch import Batch
from llama_metaws.engine.contexts import greedy_tokens, load_model, new_context
from llama_metaws.engine.core import Engine
from llama_metaws.engine.request import Request
from llama_metaws.engine.samplers import SamplingParams
from llama_metaws.engine.workspace import Workspace, context_info

TARGET, DRAFT = "target", "draft"

N_CTX = 128
N_BATCH = 32    # the engine evaluates prompts in chunks of n_batch: the longer ones take two or three
N_UBATCH = 16   # and each chunk is cut into ubatches of 16: a prompt-sized reservation is 16 tokens
DRAFT_MAX = 3
N_DECODE = DRAFT_MAX + 1  # batches up to this size get the decode-sized reservation
N_GEN = 10
# the engine holds the last prompt token back: 0, 1, 4 (decode-sized), 14, 15, 16, 31, 32, 46
# tokens are prefilled, around the ubatch (16) and batch (32) boundaries
PROMPT_LENGTHS = (1, 2, 5, 15, 16, 17, 32, 33, 47)
PROMPTS = [[(13 * i + 7 * j + 1) % 127 for i in range(n)] for j, n in enumerate(PROMPT_LENGTHS)]

# agreement models accept all, half, none of the drafts; the random one almost none, and its
# head is unsure enough for draft_p_min to cut drafts short
MODELS = {"agree-1.0": 1.0, "agree-0.5": 0.5, "agree-0.0": 0.0, "random": None}
SPLITS = {"none": dict(devices=None, split_mode="none"),
          "tensor": dict(devices=["CPU", "CPU"], split_mode="tensor")}
MODES = ("alias", "private-meta", "off")


class Resources:
    """Model files, loaded models and greedy references, shared by every example."""

    def __init__(self, models_dir):
        self.models_dir = models_dir
        self.paths, self.models, self.refs = {}, {}, {}

    def model(self, name, split):
        key = (name, split)
        if key not in self.models:
            if name not in self.paths:
                from llama_metaws_dev.testing import make_tiny_mtp_model

                self.paths[name] = make_tiny_mtp_model(
                    self.models_dir / f"stateful-{name}.gguf", seed=41, agreement=MODELS[name])
            self.models[key] = load_model(self.paths[name], load_mtp=True, **SPLITS[split])
        return self.models[key]

    def reference(self, name, split, prompt_index):
        key = (name, split, prompt_index)
        if key not in self.refs:
            ctx = new_context(self.model(name, split), n_ctx=N_CTX, n_batch=128, n_ubatch=N_UBATCH, n_rs_seq=1)
            try:
                self.refs[key] = greedy_tokens(ctx, PROMPTS[prompt_index], N_GEN)
            finally:
                ctx.close()
        return self.refs[key]

    def close(self):
        for model in self.models.values():
            model.close()
        self.models.clear()


@pytest.fixture(scope="module")
def resources(models_dir):
    res = Resources(models_dir)
    yield res
    res.close()


def _target_greedy(ctx, prompt, n):
    """The target alone: the prompt in chunks of n_batch, then n greedy single-token decodes."""
    ctx.kv_cache_clear()
    n_vocab = llama_cpp.llama_vocab_n_tokens(ctx.model.vocab)
    batch = _internals.LlamaBatch(n_tokens=N_BATCH, embd=0, n_seq_max=1)
    try:
        for start in range(0, len(prompt), N_BATCH):
            batch.set_batch(prompt[start:start + N_BATCH], n_past=start, logits_all=False)
            assert llama_cpp.llama_decode(ctx.ctx, batch.batch) == 0
        out, pos = [], len(prompt)
        for _ in range(n):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx.ctx, -1), shape=(n_vocab,))
            out.append(int(np.argmax(logits)))
            batch.set_batch([out[-1]], n_past=pos, logits_all=True)
            assert llama_cpp.llama_decode(ctx.ctx, batch.batch) == 0
            pos += 1
        return out
    finally:
        batch.close()


def _settles(n):
    """Whether a request of ``n`` tokens leaves the shared entries settled: both roles
    republished since the last shrink request, so that each holds exactly
    max(owner_need, borrower_need).

    Shrinking waits (ggml-alloc.h): a shrink request starts an epoch, and an entry shrinks only
    once every attached role has reserved again in it. A context requests a shrink on its first
    decode-sized batch after prompt-sized ones. An engine step is: target decode, the draft's
    catch-up over the same batch, then the draft decodes of the next step's draft. With two
    tokens or more the prompt is followed by a draft decode (the draft's request, if any), then
    the first step's target decode (the target's request, or its reserve in the draft's epoch)
    and the draft's catch-up (its reserve in the target's): settled, whatever came before. With
    one token there is no draft to make: the target's request at its decode may be followed by
    the draft's own at the catch-up, the very last decode, which waits for a target reserve that
    only the next request brings; whether it comes depends on what the last request left, so
    such a request is not checked exactly. A request of no tokens decodes nothing.
    """
    return n >= 2


def _request(engine, prompt, n, on_step=None):
    """A fresh greedy request of ``n`` tokens on slot 0 (the whole prompt evaluated)."""
    r = engine.submit(Request(prompt, SamplingParams(temp=0.0), max_tokens=n, stop_at_eog=False,
                              cache_prompt=False))
    return r.wait(timeout=120), r


class WorkspaceMachine(RuleBasedStateMachine):
    res: Resources = None  # set by the test before the machine runs
    seen = collections.Counter()  # what the examples covered (checked after the run)

    def __init__(self):
        super().__init__()
        self.tgt = self.dft = self.ws = self.engine = None
        self.generations = {}    # id(context) -> the last generation seen
        self.settled = False

    # -- the pair ---------------------------------------------------------------------------

    def _make(self, which):
        model = self.res.model(self.model_name, self.split)
        if which == TARGET:
            return new_context(model, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_UBATCH, n_rs_seq=DRAFT_MAX)
        return new_context(model, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_UBATCH, mtp=True)

    def _attach(self, mode):
        self.seen.update([("mode", mode), ("split+mode", self.split, mode)])
        self.mode = mode
        self.ws = Workspace(self.tgt, self.dft, mode=mode, n_decode_tokens=N_DECODE)
        assert self.ws.shared == (mode != "off")
        for ctx in (self.tgt, self.dft):
            assert context_info(ctx).paired == (mode != "off")
        if self.engine is not None:
            self.engine.close()
        self.engine = Engine(self.tgt, self.dft, draft_max=DRAFT_MAX)
        # the attach reserves both roles prompt-sized, with no shrink request: settled
        self.settled = True

    def _forget(self, ctx):
        self.generations.pop(id(ctx), None)

    def _close_pair(self, first):
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        order = (self.tgt, self.dft) if first == TARGET else (self.dft, self.tgt)
        for ctx in order:
            self._forget(ctx)
            ctx.close()
        self.ws.close()  # harmless once the contexts are gone
        self.tgt = self.dft = self.ws = None

    def _ref(self, prompt_index, n):
        return self.res.reference(self.model_name, self.split, prompt_index)[:n]

    @initialize(model=st.sampled_from(sorted(MODELS)), split=st.sampled_from(sorted(SPLITS)),
                mode=st.sampled_from(MODES))
    def start(self, model, split, mode):
        self.seen.update([("model", model), ("split", split)])
        self.model_name, self.split = model, split
        self.tgt, self.dft = self._make(TARGET), self._make(DRAFT)
        self._attach(mode)

    def teardown(self):
        if self.tgt is not None:
            self._close_pair(TARGET)

    # -- requests ---------------------------------------------------------------------------

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), n=st.integers(0, N_GEN),
          p_min=st.sampled_from([0.0, 0.9]))
    def generate(self, prompt, n, p_min):
        """A whole request through the engine."""
        self.seen[("rule", "generate")] += 1
        with Engine(self.tgt, self.dft, draft_max=DRAFT_MAX, p_min=p_min) as engine:
            out, _ = _request(engine, PROMPTS[prompt], n)
        assert out == self._ref(prompt, n)
        if n:
            self.settled = _settles(n)

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), n=st.integers(1, N_GEN),
          counts=st.lists(st.integers(0, DRAFT_MAX), min_size=1, max_size=4))
    def generate_stepwise(self, prompt, n, counts):
        """The same request with a chosen draft length per step (acceptance lengths from 0 to
        DRAFT_MAX+1 tokens), checking the invariants between steps on the engine's thread."""
        self.seen[("rule", "generate_stepwise")] += 1
        engine, asked = self.engine, []
        length = engine.draft_length

        def chosen(v):
            want = min(counts[len(asked) % len(counts)], length(v)) if length(v) else 0
            asked.append(want)
            return want

        def between_steps():
            self.settled = False  # between steps: only the lower bound
            self.check_entries()
            self.check_generations()

        engine.draft_length, engine.after_step = chosen, between_steps
        try:
            out, r = _request(engine, PROMPTS[prompt], n)
        finally:
            engine.draft_length, engine.after_step = length, None
        assert out == self._ref(prompt, n)
        self.settled = _settles(n)

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), n=st.integers(0, 3))
    def target_alone(self, prompt, n):
        """Prompt and decodes on the target only (the draft does not follow)."""
        self.seen[("rule", "target_alone")] += 1
        assert _target_greedy(self.tgt, PROMPTS[prompt], n) == self._ref(prompt, n)
        # the target's move from prompt- to decode-sized requests a shrink that the draft has not
        # answered: the entry may stay larger than both requirements until it does
        self.settled = False

    @rule(prompt=st.integers(0, len(PROMPTS) - 1))
    def draft_alone(self, prompt):
        """The draft context alone processes a prompt (zero hidden rows): the borrower's own
        grow, or its own shrink request for a short one."""
        self.seen[("rule", "draft_alone")] += 1
        tokens = PROMPTS[prompt]
        self.engine.exclusive(lambda: self.engine.clear_sequence(self.engine.slots[0]))
        n_embd = llama_cpp.llama_model_n_embd_out(llama_cpp.llama_get_model(self.dft.ctx))
        b = Batch(N_BATCH, n_embd)
        for start in range(0, len(tokens), N_BATCH):
            chunk = tokens[start:start + N_BATCH]
            b.clear()
            b.add(chunk, start, 0, False, np.zeros((len(chunk), n_embd), np.float32))
            assert llama_cpp.llama_decode(self.dft.ctx, b.batch) == 0
        self.settled = False

    # -- pairing and teardown ---------------------------------------------------------------

    @rule(mode=st.sampled_from(MODES))
    def detach_and_attach(self, mode):
        self.seen[("rule", "detach_and_attach")] += 1
        self.ws.close()
        for ctx in (self.tgt, self.dft):
            assert not context_info(ctx).paired
        self._attach(mode)

    @rule(first=st.sampled_from([TARGET, DRAFT]), mode=st.sampled_from(MODES), use_survivor=st.booleans())
    def close_one_and_replace_it(self, first, mode, use_survivor):
        """Close one context of the pair (the workspace still attached), use the survivor on its
        own, then pair it with a new peer."""
        self.seen[("rule", "close_one_and_replace_it")] += 1
        self.engine.close()
        self.engine = None
        gone, survivor = (self.tgt, self.dft) if first == TARGET else (self.dft, self.tgt)
        self._forget(gone)
        gone.close()
        assert not context_info(survivor).paired  # back to private buffers
        self.ws.close()  # harmless once a context is gone
        if use_survivor and survivor is self.tgt:
            assert _target_greedy(self.tgt, PROMPTS[7], 4) == self._ref(7, 4)
        if first == TARGET:
            self.tgt = self._make(TARGET)
        else:
            self.dft = self._make(DRAFT)
        self._attach(mode)

    @rule(first=st.sampled_from([TARGET, DRAFT]), model=st.sampled_from(sorted(MODELS)),
          split=st.sampled_from(sorted(SPLITS)), mode=st.sampled_from(MODES))
    def close_both_and_start_again(self, first, model, split, mode):
        self.seen[("rule", "close_both_and_start_again")] += 1
        self._close_pair(first)
        self.start(model, split, mode)

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def check_entries(self):
        if self.tgt is None:
            return
        entries = self.ws.stats()
        shared = [e for e in entries if e.shared]
        if self.mode == "off":
            assert not shared, entries
            return
        assert shared, entries
        for e in shared:
            need = max(e.owner_need, e.borrower_need)
            assert need > 0, e
            if self.settled:
                self.seen["exact"] += 1
                assert e.allocated == need, (e, "settled")
            else:
                assert e.allocated >= need, e
        metas = [e for e in entries if e.buffer_type.startswith("Meta")]
        if self.split == "tensor":
            if self.mode == "alias":
                assert len(metas) == 1 and metas[0].shared and metas[0].alias, metas
            else:  # private-meta: one meta buffer per context, neither shared nor aliased
                assert len(metas) == 2 and not any(e.shared or e.alias for e in metas), metas
        else:
            assert not metas and not any(e.alias for e in entries), entries

    @invariant()
    def check_generations(self):
        if self.tgt is None:
            return
        for ctx in (self.tgt, self.dft):
            key = id(ctx)
            generation = context_info(ctx).generation
            # across the scheduler rebuild after a detach too (llama carries the count over)
            if key in self.generations:
                assert generation >= self.generations[key], (generation, self.generations[key])
            self.generations[key] = generation


@pytest.mark.slow
def test_random_sequences_keep_outputs_memory_and_generations(resources):
    WorkspaceMachine.res = resources
    WorkspaceMachine.seen.clear()
    try:
        run_state_machine_as_test(WorkspaceMachine, settings=settings(
            max_examples=50, stateful_step_count=30, derandomize=True, database=None, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]))
    finally:
        WorkspaceMachine.res = None
    # the examples reached every rule, model, split and mode, and the exact check ran
    seen = WorkspaceMachine.seen
    rules = [name for name, f in vars(WorkspaceMachine).items() if hasattr(f, "hypothesis_stateful_rule")]
    assert len(rules) == 7, rules
    expected = ([("rule", r) for r in rules] + [("model", m) for m in MODELS]
                + [("split+mode", s, m) for s in SPLITS for m in MODES])
    missing = [key for key in expected if not seen[key]]
    assert not missing, (missing, seen)
    assert seen["exact"] > 0, seen


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_a_one_step_request_without_drafts_leaves_the_shrink_pending(resources, split):
    """The case ``_settles`` excludes, as the contract has it: after a long prompt, a one-token
    request's draft decode is the catch-up after the target's decode; it requests a shrink that
    the target has not answered, so the entry stays larger than both requirements, and the next
    request's first target decode settles it."""
    model = resources.model("agree-0.5", split)
    tgt = new_context(model, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_UBATCH, n_rs_seq=DRAFT_MAX)
    dft = new_context(model, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_UBATCH, mtp=True)
    ws = Workspace(tgt, dft, n_decode_tokens=N_DECODE)
    engine = Engine(tgt, dft, draft_max=DRAFT_MAX)

    def excess():
        return {e.buffer_type: e.allocated - max(e.owner_need, e.borrower_need) for e in ws.stats() if e.shared}

    try:
        out, _ = _request(engine, PROMPTS[-1], 4)
        assert out == resources.reference("agree-0.5", split, len(PROMPTS) - 1)[:4]
        assert set(excess().values()) == {0}
        out, r = _request(engine, PROMPTS[-1], 1)
        assert out == resources.reference("agree-0.5", split, len(PROMPTS) - 1)[:1]
        assert r.stats.lengths == {0: 1} and not _settles(1)  # one step, no draft
        assert min(excess().values()) > 0, ws.stats()  # every entry waits for the target
        out, _ = _request(engine, PROMPTS[2], 1)
        assert out == resources.reference("agree-0.5", split, 2)[:1]
        assert set(excess().values()) == {0}  # the short prompt's target decode answered it
    finally:
        engine.close()
        ws.close()
        dft.close()
        tgt.close()


@pytest.mark.parametrize("first", [DRAFT, TARGET])
def test_the_generation_of_a_survivor_does_not_go_back(resources, first):
    model = resources.model("agree-0.5", "none")
    tgt = new_context(model, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_UBATCH, n_rs_seq=DRAFT_MAX)
    dft = new_context(model, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_UBATCH, mtp=True)
    ws = Workspace(tgt, dft, n_decode_tokens=N_DECODE)
    try:
        with Engine(tgt, dft, draft_max=DRAFT_MAX) as engine:
            _request(engine, PROMPTS[-1], N_GEN)
        gone, survivor = (dft, tgt) if first == DRAFT else (tgt, dft)
        seen = context_info(survivor).generation
        gone.close()
        ws.close()
        assert context_info(survivor).generation >= seen  # the detach itself counts up
        seen = context_info(survivor).generation
        if survivor is tgt:
            _target_greedy(tgt, PROMPTS[3], 2)
        else:  # attaching to a new target rebuilds the draft's scheduler too
            tgt = new_context(model, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_UBATCH, n_rs_seq=DRAFT_MAX)
            ws = Workspace(tgt, dft, n_decode_tokens=N_DECODE)
        assert context_info(survivor).generation >= seen
    finally:
        ws.close()
        for ctx in (dft, tgt):
            ctx.close()
