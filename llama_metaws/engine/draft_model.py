"""The model's MTP head as a llama-cpp-python draft model (:class:`MTPDraftModel`).

The binding's ``Llama.generate`` asks its draft model for tokens after each sampled one;
:class:`MTPDraftModel` answers from the model's MTP (NextN) head in a second context, kept in
step with the target by :meth:`llama_metaws.llama.Llama.eval` (every decoded batch is handed to
:meth:`MTPDraftModel.target_decoded`). It drives :class:`~llama_metaws.engine.mtp.MTPDrafter` through
its public step-by-step calls only.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import numpy as np

from ..native.binding import LlamaDraftModel
from .limits import AUTO_DRAFT_MAX
from .mtp import DraftStats, MTPDrafter

__all__ = ["AdaptiveLength", "DraftStatsReport", "MTPDraftModel", "OpenDraft"]


class AdaptiveLength:
    """``draft_max="auto"``: the draft length chosen per step from the recent verdicts.

    It keeps, for every draft depth ``d`` (1 to :attr:`CAP`), an estimate of how often a
    draft's ``d``-th token is accepted once the ones before it were: a moving average of the
    verdicts (weight :attr:`RATE`). A step drafts the leading depths whose estimate is at
    least :attr:`KEEP`, none when the first is below it (a plain decode step: where the head
    rarely agrees, drafting only costs). Every step each estimate drifts up by :attr:`RETRY`,
    so a depth given up is tried again now and then. The cap bounds what the contexts are
    sized for (the verification batch, a recurrent target's rollback snapshots ``n_rs_seq``).
    """

    CAP = AUTO_DRAFT_MAX
    KEEP = 0.5
    RATE = 0.5
    RETRY = 0.02

    def __init__(self) -> None:
        self.p = [1.0] * self.CAP

    @property
    def n(self) -> int:
        """Draft tokens the next step asks for."""
        n = 0
        while n < self.CAP and self.p[n] >= self.KEEP:
            n += 1
        return n

    def next_step(self) -> int:
        """A step starts: the estimates drift up; return its draft length."""
        self.p = [min(1.0, p + self.RETRY) for p in self.p]
        return self.n

    def update(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens was verified, its first ``accepted`` kept."""
        for d in range(min(drafted, accepted + 1)):  # depths with a verdict
            hit = 1.0 if d < accepted else 0.0
            self.p[d] += self.RATE * (hit - self.p[d])


class DraftStatsReport:
    """Draft statistics: ``last`` (the last request) and ``total`` (since the model loaded)."""

    def __init__(self) -> None:
        self.last = DraftStats()
        self.total = DraftStats()

    def __repr__(self) -> str:
        return (f"DraftStatsReport(last={self.last} acceptance={self.last.acceptance:.3f}, "
                f"total={self.total} acceptance={self.total.acceptance:.3f})")


@dataclasses.dataclass
class OpenDraft:
    """A draft handed to the binding and awaiting its verdict."""

    start: int              # the position of the first draft token
    tokens: List[int]       # the draft
    verified: bool = False  # the target has decoded them (the sampling since says what it kept)

    @property
    def count(self) -> int:
        return len(self.tokens)


class MTPDraftModel(LlamaDraftModel):
    """The model's MTP head as a llama-cpp-python draft model.

    It keeps the draft context in step with the target: :meth:`Llama.eval` hands it every
    decoded batch (:meth:`target_decoded`), and before each evaluation :meth:`sync` cuts it
    back to where the target was cut (a rejected draft, a reset, a reused prefix). Called with
    the tokens so far (the last one sampled, not yet evaluated), it drafts from that token and
    the target's hidden row before it. It drives :class:`~llama_metaws.engine.mtp.MTPDrafter` through
    its step-by-step interface (``rewind_draft``, ``follow_target``, ``propose``).
    """

    def __init__(self, drafter: MTPDrafter, stats: DraftStatsReport):
        self.drafter = drafter
        self.stats = stats
        self.fed = 0                  # positions the draft context holds
        self.rows = {}                # position -> the target's hidden row (recent ones)
        self.open_draft: Optional[OpenDraft] = None
        self.length: Optional[AdaptiveLength] = None  # draft_max="auto"
        self.remaining: Optional[int] = None  # tokens the request may still take (None: unbounded)

    # the target's side ----------------------------------------------------------------------

    def sync(self, n_tokens: int) -> None:
        """The target holds ``n_tokens`` positions: settle the last draft, cut the draft context."""
        self._settle(n_tokens)
        if n_tokens == 0:
            self.drafter.rewind_draft(0)
            self.fed = 0
            self.rows.clear()
        elif self.fed > n_tokens:
            # the row of the last kept position, when it is still known
            self.drafter.rewind_draft(n_tokens, self.rows.get(n_tokens - 1))
            self.fed = n_tokens

    def _settle(self, n_tokens: int) -> None:
        """Count the open draft once it was verified: the sampling since kept what it accepted."""
        d = self.open_draft
        if d is None or not d.verified:
            return
        self._count(d.count, max(0, min(n_tokens, d.start + d.count) - d.start))

    def _count(self, drafted: int, accepted: int) -> None:
        if self.length is not None:
            self.length.update(drafted, accepted)
        for s in (self.stats.last, self.stats.total):
            s.drafted += drafted
            s.accepted += accepted
            s.steps += 1
        self.open_draft = None

    def restart_at(self, n_tokens: int, row: Optional[np.ndarray]) -> None:
        """The target was put back at ``n_tokens`` (a checkpoint, a loaded state): keep the draft
        context's positions before it; the next token pairs with ``row`` (None: a zero row)."""
        self.open_draft, self.fed, self.rows = None, n_tokens, {} if row is None else {n_tokens - 1: row}
        self.drafter.rewind_draft(n_tokens, row)

    def end_request(self, sampled: Optional[Sequence[int]]) -> None:
        """A request ended with the tokens ``sampled`` at positions 0.. (None: unknown, a caller
        sent tokens). Its last draft is counted when every verdict on it is known (a position
        sampled otherwise, or all of them sampled), and dropped when the request stopped
        inside it (not counted as rejected: those positions were never sampled)."""
        d, self.open_draft = self.open_draft, None
        if d is None or not d.verified or sampled is None:
            return
        known = [int(t) for t in sampled[d.start : d.start + d.count]]
        accepted = 0
        while accepted < len(known) and known[accepted] == d.tokens[accepted]:
            accepted += 1
        if accepted < len(known) or len(known) == d.count:
            self._count(d.count, accepted)

    def target_decoded(self, tokens: Sequence[int], pos0: int) -> None:
        """The target decoded ``tokens`` at ``pos0``: feed the draft, token p with row p-1."""
        if pos0 != self.fed:  # out of step (should not happen): start the draft afresh
            self.sync(0)
            if pos0 != 0:
                return
        h = self.drafter.follow_target(tokens, pos0)
        keep = {p: r for p, r in self.rows.items() if p >= pos0 - 1}
        for i in range(len(tokens)):
            keep[pos0 + i] = h[i]
        d = self.open_draft
        if d is not None and pos0 < d.start <= pos0 + len(tokens):
            d.verified = True
        self.rows = keep
        self.fed = pos0 + len(tokens)

    # the draft model interface --------------------------------------------------------------

    def __call__(self, input_ids, /, **kwargs) -> np.ndarray:
        n_past = len(input_ids) - 1  # position of the last (sampled, not evaluated) token
        # a rejected draft: the binding cut the target back to n_past; cut the draft context
        # too (the verification batch left the target's row for n_past - 1) and draft again
        self.sync(n_past)
        return np.array(self.draft_at(int(input_ids[-1]), n_past), dtype=np.intc)

    def draft_at(self, last: int, n_past: int) -> List[int]:
        """Drafts continuing ``last`` at position ``n_past`` (not yet decoded on the target,
        which holds the positions before it); none when the draft context is not there."""
        d = self.drafter
        if n_past != self.fed or n_past < 1:
            return []
        n_max = d.draft_max if self.length is None else self.length.next_step()
        # a step yields its accepted drafts and one token more: no more than the request takes
        n_max = min(n_max, d.n_ctx - n_past - 1, n_max if self.remaining is None else self.remaining - 1)
        drafts = d.propose(last, n_past, n_max) if n_max > 0 else []
        self.open_draft = OpenDraft(n_past + 1, list(drafts)) if drafts else None
        return drafts
