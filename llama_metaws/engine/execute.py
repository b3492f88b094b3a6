"""A step is run here: the decodes, the sampling, the drafts.

:func:`execute` is the second of a step's three phases (after :mod:`.schedule`, before
:mod:`.update`). It runs every llama.cpp call of the step and changes no slot or request (but
``draft_max="auto"``'s acceptance estimates, which choosing the next drafts needs):

1. one target decode of the step's batch (every slot's segment, in sequence order), after a
   speculative checkpoint of each slot whose draft the target's snapshots cannot roll back
   (:mod:`.rollback`);
2. the checkpoints a prompt chunk ends at (the recurrent state, read before the next decode);
3. one draft decode that catches the MTP context up with that batch, for all slots at once,
   but a plain one-token decode's: that token waits in the slot's lag (:attr:`Slot.lag`), fed
   with the slot's next catch-up, or in one batch before its next draft, at the end of its
   request, or once :data:`LAG_MAX` wait (a plain step then costs the target's decode alone);
4. per slot, the sampling of its output rows with its own sampler: a generating slot verifies
   its draft (a draft token is kept while it equals what the target samples at its position,
   so greedy output equals no drafting and sampled output keeps the target's distribution; with
   synthetic acceptance, :mod:`.synthetic`, at random), and the rejected positions are removed
   from both contexts (or the checkpoint restored, the tokens kept replayed next step);
5. the drafts of every slot that goes on, together, one draft decode per depth (chained NextN
   heads: depth k under head k, :class:`~.drafting.MTPHead`; with
   ``draft_max="auto"``, a scout of a plain slot is a shadow draft: proposed with the others,
   then kept on the slot's acceptance to be judged against the tokens the target samples next,
   :meth:`~.drafting.AdaptiveLength.judge`; the step stays plain).

What it found is a :class:`Verdict` per slot; :mod:`.update` applies them.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Dict, List, Optional

import numpy as np

from ..native.binding import llama_cpp
from .schedule import Segment, StepPlan

__all__ = ["Verdict", "execute", "feed_lags", "DecodeError", "LAG_MAX"]

#: the most tokens a slot's draft context lags behind the target (after plain decode steps)
LAG_MAX = 32


class DecodeError(RuntimeError):
    """A decode of the step failed: every request of the step fails with it."""


@dataclasses.dataclass
class Verdict:
    """What one step gave one slot."""

    segment: Segment
    tokens: List[int] = dataclasses.field(default_factory=list)   # sampled, to emit
    rows: Optional[List[np.ndarray]] = None   # their logits rows (the request asked for them)
    prompt_rows: Optional[np.ndarray] = None  # a prompt chunk's rows (echo with logprobs)
    n: int = 0                                # positions held after the step
    last: Optional[int] = None                # the token at position n, not yet decoded
    pending: Optional[np.ndarray] = None      # the target's row of position n - 1
    finish: Optional[str] = None
    replay: int = 0                           # positions before n the target gave back (rollback.py)
    drafted: int = 0                          # the verified draft: its length ...
    accepted: int = 0                         # ... and the tokens of it kept
    verdict_known: bool = False               # every draft token was judged
    drafts: List[int] = dataclasses.field(default_factory=list)   # proposed for the next step
    draft_len: Optional[int] = None           # the length asked for (None: no draft step)
    shadow: bool = False                      # the draft asked for is a shadow draft (not verified)
    recent: Dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # position -> row, held


def execute(engine, plan: StepPlan) -> List[Verdict]:
    head = engine.head
    costs = engine.costs
    verdicts = [Verdict(seg) for seg in plan.segments]
    if plan.segments:
        b = engine.tbatch
        b.clear()
        for seg in plan.segments:
            seg.i0 = b.add(seg.tokens, seg.pos0, seg.slot.seq_id, seg.outputs)
        phase = "prompt processing" if any(s.kind == "prompt" for s in plan.segments) else "decoding"
        costs, clock = engine.costs, engine.costs.clock
        engine.checkpoint_drafts(plan.segments)  # a draft the target cannot roll back (rollback.py)
        t0 = clock()
        engine.decode_target(b, phase)
        llama_cpp.llama_synchronize(engine.target.ctx)
        # every token an output row, as in the steps the policy weighs, in one graph (a step of
        # several is weighed as their sum: policy.StepCosts.step)
        plan.graphs = engine.graphs(plan.segments)
        if phase == "decoding" and plan.graphs == 1 and b.n_outputs == b.n:
            costs.target.add(b.n, clock() - t0)

        rows = head.target_rows(b.n) if head is not None else None
        for v in verdicts:  # before any other decode: the state_back reads this decode's snapshots
            if v.segment.backs:
                engine.take_checkpoints(v.segment, rows)
        if head is not None:
            now = []
            for s in plan.segments:
                if engine.defer_catch_up and s.kind == "decode" and s.n == 1:  # waits in the lag
                    s.slot.lag.append((int(s.tokens[0]), s.pos0, head.zero if s.slot.pending is None
                                       else s.slot.pending))
                else:
                    now.append(s)
            if now:
                # a replay is held there already (rollback.py): from last on
                _catch_up(engine, head.entries([(s.slot.seq_id, s.i0 + s.replay, s.n - s.replay, s.slot.pending,
                                                 s.slot.take_lag()) for s in now], b.token, b.pos, rows), phase)

        tctx = engine.target.ctx
        for v in verdicts:
            seg = v.segment
            if seg.kind == "prompt":
                _prompt(engine, v, tctx, rows)
            else:
                _verify(engine, v, tctx, rows, drafts=seg.tokens[1 + seg.replay:], first=seg.i0 + seg.replay)
        engine.roll_back(verdicts)
    for slot in plan.draft_only:  # a prompt held already: the step drafts from its last token
        v = Verdict(Segment(slot, "draft", [], slot.n, False), n=slot.n, last=slot.last, pending=slot.pending)
        verdicts.append(v)

    starts = []
    if engine.draft_max:
        going = [v for v in verdicts if v.finish is None and v.last is not None]
        for v, n_max in zip(going, engine.draft_lengths(going, verdicts)):
            v.draft_len = n_max
            if n_max > 0:
                starts.append((v, n_max))
    if head is not None:  # the lags that must not wait: a draft from them, a request's end, LAG_MAX
        drafting = {id(v) for v, _ in starts}
        feed_lags(engine, [v.segment.slot for v in verdicts if v.segment.slot.lag and (
            id(v) in drafting or v.finish is not None or len(v.segment.slot.lag) >= LAG_MAX)])
    if engine.draft_max:
        if starts and head is not None:
            def on_depth(n, seconds):
                costs.draft.add(n, seconds)
                engine.graphs_draft += 1

            proposed = head.propose([(v.segment.slot.seq_id, v.last, v.n, v.pending, n) for v, n in starts],
                                    on_depth)
            for v, _ in starts:
                drafts = proposed.get(v.segment.slot.seq_id, [])
                if v.shadow:  # judged against what the target samples next (AdaptiveLength.judge)
                    v.segment.slot.length.shadow, v.draft_len = drafts, 0
                else:
                    v.drafts = drafts
        elif starts:  # a Python draft model (the binding's prompt lookup, ...)
            for v, n in starts:
                r = v.segment.slot.request
                ids = np.asarray(r.prompt + r.generated + v.tokens, dtype=np.intc)
                v.drafts = [int(x) for x in np.asarray(engine.proposer(ids)).ravel()[:n]]
    return verdicts


def feed_lags(engine, slots) -> None:
    """The draft context catches up with what these slots' lags hold (:attr:`Slot.lag`), in one
    batch (or as few as hold it)."""
    entries = []
    for slot in slots:
        lag = slot.take_lag()
        if lag is not None:
            entries.append((slot.seq_id, *lag))
    if entries:
        _catch_up(engine, entries, "decoding")


def _catch_up(engine, entries, phase: str) -> None:
    """The draft context fed ``entries`` (:meth:`~.drafting.MTPHead.feed`'s), timed for the cost
    model, its graphs counted."""
    clock = engine.costs.clock
    t0 = clock()
    carried = engine.head.feed(entries, phase)
    llama_cpp.llama_synchronize(engine.draft.ctx)
    engine.costs.catch_up.add(sum(len(e[1]) for e in entries), clock() - t0)
    passes = engine.head.n_heads if engine.head.chained else 1  # chained heads: each decodes the batch
    engine.graphs_draft += passes * sum(engine.graphs_of_draft([SimpleNamespace(n=n, slot=SimpleNamespace(seq_id=q))
                                                                for q, n in c]) for c in carried)


def _stopped(engine, r, token: int) -> bool:
    """A stop string in the request's text now (pieces of its tokens, the last one included)."""
    piece = engine.piece(token)
    r.text += piece
    window = r.text[-(max(len(s) for s in r.stop) + len(piece)):]
    return any(s in window for s in r.stop)


def _row(rows: Optional[np.ndarray], i: int) -> Optional[np.ndarray]:
    return None if rows is None else rows[i].copy()


def _prompt(engine, v: Verdict, tctx, rows) -> None:
    seg = v.segment
    slot, r = seg.slot, seg.slot.request
    end = seg.pos0 + seg.n
    v.n = end
    v.pending = _row(rows, seg.i0 + seg.n - 1)
    if r.prompt_rows:  # every prompt position's row but the last one's (the first token's)
        n_rows = min(seg.n, len(r.prompt) - 1 - seg.pos0)
        v.prompt_rows = np.stack([engine.logits(tctx, seg.i0 + j) for j in range(max(n_rows, 0))]) \
            if n_rows > 0 else np.zeros((0, engine.n_vocab), dtype=np.float32)
    if not seg.ends_prompt:
        return
    if end < len(r.prompt):  # drafting: the last prompt token is held back, decoded with the first draft
        v.last = r.prompt[-1]
        return
    # the prompt's last row: sample the first token now, as a step with no draft
    v.n = end - 1
    _verify(engine, v, tctx, rows, drafts=[], first=seg.i0 + seg.n - 1)


def _verify(engine, v: Verdict, tctx, rows, *, drafts: List[int], first: int) -> None:
    """Sample from row ``first`` on, keeping each draft token that equals what was sampled
    before it. ``v.n`` is the position of the row ``first`` (the token decoded there)."""
    seg = v.segment
    slot, r = seg.slot, seg.slot.request
    n0 = seg.pos0 + seg.replay if seg.kind == "decode" else v.n
    k = len(drafts)
    toks: List[int] = []
    keep_rows = r.logits_rows
    out_rows: List[np.ndarray] = []
    finish = None
    budget = r.remaining
    slot.step_tokens = toks  # a logits processor's history
    taken: List[bool] = []  # toks[j] is drafts[j], kept
    synth = engine.synth_probs if seg.kind == "decode" else None
    for j in range(k + 1):
        idx = first + j
        if synth and j < k:  # synthetic acceptance (.synthetic): drafts[j] taken at random
            tok = slot.sampler.select(tctx, idx)
            took = slot.synth_rng.random() < synth[j] and not engine.is_eog(drafts[j])
            if took:
                tok = drafts[j]
                slot.sampler.accept_draft(tok)
            else:
                slot.sampler.accept(tok)
        else:
            tok = slot.sampler.sample(tctx, idx)
            took = j < k and tok == drafts[j]
        if r.stopping_criteria is not None:
            ids = np.asarray(r.prompt + r.generated + toks, dtype=np.intc)
            if r.stopping_criteria(ids, engine.logits(tctx, idx, copy=False)):
                finish = "stop"
                break
        if r.stop_at_eog and engine.is_eog(tok):
            finish = "stop"
            r.eog = True  # sampled, not returned (llama-server counts it in predicted_n)
            break
        toks.append(tok)
        taken.append(took)
        if keep_rows:
            out_rows.append(engine.logits(tctx, idx))
        if budget is not None and len(toks) >= budget:
            finish = "length"
            break
        if r.stop and _stopped(engine, r, tok):
            finish = "stop"
            break
        if took:
            continue
        break
    slot.step_tokens = []
    valid = 0  # drafts decoded at positions that the sampled tokens confirm
    while valid < min(k, len(toks)) and taken[valid]:
        valid += 1
    v.tokens, v.rows = toks, out_rows if keep_rows else None
    v.n = n0 + 1 + valid
    v.pending = _row(rows, first + valid)
    if rows is not None:  # the rows of the positions held, for a cut back into them
        v.recent = {n0 + j: rows[first + j].copy() for j in range(valid + 1)}
    if seg.kind == "decode":
        v.drafted, v.accepted = k, valid
        v.verdict_known = valid == k or len(toks) > valid
    if not engine.context_shift and v.n + 1 >= slot.n_ctx and finish != "stop":
        r.truncated = True  # llama-server's: the next token would not fit
        if finish is None and v.n >= slot.n_ctx:
            finish = "length"  # the context of the sequence is full
    v.finish = finish
    v.last = toks[valid] if finish is None else None
