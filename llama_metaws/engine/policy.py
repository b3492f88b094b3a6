"""``draft_max="auto"``: each step's draft lengths, chosen from measured costs.

Speculation pays only while verifying ``1 + k`` tokens costs little more than decoding one. On a
CPU, or on a GPU whose batch is full of other sequences, the verification batch is compute-bound
and costs almost ``1 + k`` decodes; there drafting makes every request slower. So the lengths are
chosen to maximize the tokens a step yields per second, for the whole step, since the batch is
shared: drafting for one slot makes every slot's step longer.

- **What a draft yields**: each slot keeps, per draft depth ``d``, an estimate ``p_d`` of how often
  the ``d``-th draft token is accepted once the ones before it were (a moving average of the
  verdicts, :class:`~.drafting.AdaptiveLength`). A draft of ``k`` tokens yields
  ``1 + p_1 + p_1 p_2 + ... + p_1 ... p_k`` tokens on average.
- **What a step costs**: :class:`StepCosts` holds the time of a target decode of ``n`` tokens,
  of the draft context's catch-up over those ``n`` tokens, and of one draft decode of ``n``
  tokens (one per slot drafting; with chained NextN heads depth ``d`` decodes each slot's chain so
  far, ``d + 1`` tokens, under head ``d``) (moving averages per size, interpolated between the
  sizes seen, extrapolated linearly beyond them). On a recurrent target whose snapshots do not
  reach a draft (qwen3next: none), a draft is verified with a speculative checkpoint
  (:mod:`.rollback`): the state saved before the step, and on a partial accept put back and the
  tokens kept replayed in the next step; :meth:`StepCosts.rollback` weighs what that costs, at
  each draft length's chance of a partial accept (the save and restore timed as the engine runs). They start from a prior the engine measures at load (:mod:`.prior`: batches of
  1 to ``cap + 1`` tokens, or a curve saved by an earlier run), and the engine goes on measuring
  as it runs. The target's are timed on steps without prompt tokens only, where every token is
  an output row: a prompt of 7 tokens has one, and computes a seventh of the output head a
  verification of 6 drafts does (at Qwen's vocabulary, a third of a decode's weights). The
  clock is the engine thread's own CPU time (:func:`engine_clock`), not the wall: the HTTP,
  tokenizer and client threads sharing the cores stretch a step's wall time by about the same
  amount whatever its size, which made a plain 1-token step look dearer, per token, than it is.
  A step costs each of its target graphs (llama.cpp splits a recurrent target's batch into graphs
  of equal tokens per sequence: at two slots, one slot's draft of one token is a second graph,
  both slots' is one; :func:`~.schedule.ubatch_sizes`); the target is timed on steps of one graph.
- **The choice** (:meth:`DraftPolicy.choose`): starting from no draft anywhere, each slot in
  turn, those whose drafts yield most first, takes the length (0 to its cap) that gives the
  step the most expected tokens per second given the others' lengths, until none changes; a
  plain decode step (``k = 0``) where no draft pays by a margin (:attr:`DraftPolicy.MARGIN`:
  near break-even the costs' noise decides, and the estimates start at full acceptance). A
  slot's limit (a probe of one token first, then twice what it kept) bounds its length; where
  the limit alone keeps a slot from a draft that would pay, the slot *scouts*: it drafts its
  limit, and what it keeps doubles the limit (on a CPU a 2-token batch can cost two decodes,
  and only a longer draft pays). A scout of a slot whose best length is none is flagged
  (:attr:`DraftPolicy.shadows`): the engine drafts it on the side of the plain step, unverified,
  and judges it by the tokens that follow (:func:`~.drafting.auto_lengths`).

Depths given up are tried again now and then: every step each estimate drifts up a little
(``AdaptiveLength.RETRY``, less after each draft in a row that was cut short; the draft
after a miss, a rejected first token, is a one-token probe, and lengths grow by doubling), so a
change of content is noticed cheaply; and every :attr:`DraftPolicy.EXPLORE` steps with measured costs one
slot, in turn, drafts one token more than its best length, where acceptance alone would (its
leading depths whose estimate is at least one half), so the cost of a longer batch is measured
again and a change of load is noticed too (while steps stay plain, each explore doubles the wait
for the next, up to :attr:`DraftPolicy.EXPLORE_MAX` steps: where drafting cannot pay, exploring
is all it costs; the prior timed at load counts as the first explore, and a scout, which drafts
where drafting does not pay yet, does not bring the next one forward); and every
:attr:`DraftPolicy.FILL` steps without prompt tokens, while a length up to that one makes a
target batch that was never timed and could pay at the least that batch can cost (that of the
cheapest timed size below it), one slot drafts the shortest such (the costs between timed sizes
are interpolated, and the best length may sit at a size of its own: a batch that fills a
kernel's tile). The other slots of such a step keep their best lengths: the
engine explores, not each slot at once. A cost model can be injected (tests, and a
clock: :class:`StepCosts` takes one).
"""

from __future__ import annotations

import bisect
import time
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["StepCosts", "FixedCosts", "DraftPolicy", "acceptance_length", "expected_tokens", "engine_clock"]


def engine_clock() -> float:
    """The calling thread's CPU time in seconds (``time.thread_time``), the clock of the steps'
    costs: the time the engine's thread computed (or spun waiting for a device, or for ggml's
    worker threads), without the time other threads held the cores or the GIL. Read through the
    ``time`` module at each call (a test's fake machine replaces it there). A device whose
    synchronization sleeps instead of spinning would hide its time from this clock; give the
    engine ``StepCosts(clock=time.perf_counter)`` there."""
    return time.thread_time()


def expected_tokens(p: Sequence[float], k: int) -> float:
    """The tokens a step with a draft of ``k`` yields on average, with per-depth acceptance ``p``."""
    total, keep = 1.0, 1.0
    for d in range(k):
        keep *= p[d]
        total += keep
    return total


class _Curve:
    """Seconds as a function of a size: moving averages per size seen, linear in between (through
    the two nearest sizes), and beyond (below the smallest: through the two smallest; above the
    largest: through the smallest and the largest; proportional to the size from a single one)."""

    RATE = 0.2

    def __init__(self) -> None:
        self.sizes: List[int] = []
        self.values: Dict[int, float] = {}

    def add(self, size: int, seconds: float) -> None:
        if size <= 0 or seconds < 0:
            return
        if size in self.values:
            self.values[size] += self.RATE * (seconds - self.values[size])
        else:
            bisect.insort(self.sizes, size)
            self.values[size] = seconds

    def seed(self, values: Mapping[int, float]) -> None:
        """Start from ``values`` (size -> seconds, a prior): they replace what the curve holds."""
        self.sizes, self.values = [], {}
        for size, seconds in values.items():
            self.add(int(size), float(seconds))

    @property
    def known(self) -> bool:
        return bool(self.sizes)

    def has(self, size: int) -> bool:
        """Whether ``size`` was measured (not interpolated)."""
        return size in self.values

    def floor(self, size: int) -> float:
        """The least ``size`` can cost: the cheapest size measured up to it (0.0 where none is).
        A batch reads the same weights as a smaller one and computes more, but its cost need not
        grow with the size (on one CPU a 3-token q8_0 batch took 0.8x a 2-token one)."""
        i = bisect.bisect_right(self.sizes, size)
        return min(self.values[s] for s in self.sizes[:i]) if size > 0 and i else 0.0

    def __call__(self, size: int) -> float:
        if size <= 0 or not self.sizes:
            return 0.0
        if size in self.values:
            return self.values[size]
        s = self.sizes
        if len(s) == 1:
            return self.values[s[0]] * size / s[0]
        i = bisect.bisect_left(s, size)
        # beyond the largest size: the slope over every size seen (two neighbours' timings can
        # be in either order on a CPU, and a slope of nothing would make every batch look free)
        lo, hi = (s[0], s[1]) if i == 0 else (s[0], s[-1]) if i >= len(s) else (s[i - 1], s[i])
        a, b = self.values[lo], self.values[hi]
        return max(0.0, a + (b - a) * (size - lo) / (hi - lo))


class StepCosts:
    """The costs the engine measures as it runs (see the module docstring); ``clock``: seconds of
    the engine thread's own time (:func:`engine_clock`)."""

    def __init__(self, clock: Callable[[], float] = engine_clock) -> None:
        self.clock = clock
        self.target = _Curve()    # target decode of n tokens, each an output row
        self.catch_up = _Curve()  # the draft context's catch-up over n tokens
        self.draft = _Curve()     # one draft decode of n tokens
        self.save = _Curve()      # speculative checkpoints of m slots' states, before a verification
        self.restore = _Curve()   # m of them put back after partial accepts
        #: chained NextN heads: draft depth d decodes d + 1 tokens a slot
        self.chained = False
        #: a draft longer than this is verified with a speculative checkpoint (the target's
        #: n_rs_seq; None: never, a target without recurrent state)
        self.checkpoint_above: Optional[int] = None

    @property
    def known(self) -> bool:
        return self.target.known

    #: measured as the engine runs (worth measuring again now and then)
    measured = True

    def step(self, sizes: Sequence[int], depths: Sequence[int], least: bool = False) -> float:
        """A step's seconds: the target's graphs of ``sizes`` tokens each (how llama.cpp splits the
        batch), their catch-up, and draft decodes over ``depths[d]`` slots at depth ``d``;
        ``least``: with the least each target graph can cost (:meth:`_Curve.floor`) in place of
        its estimate."""
        target = sum(self.target.floor(n) if least else self.target(n) for n in sizes)
        drafts = sum(self.draft(m * (d + 1) if self.chained else m) for d, m in enumerate(depths) if m)
        return target + self.catch_up(sum(sizes)) + drafts

    def rollback(self, ks: Sequence[int], yields: Sequence[Sequence[float]]) -> float:
        """The expected seconds the speculative checkpoints of a step with draft lengths ``ks``
        cost (:mod:`.rollback`; ``yields[s][x]``: slot ``s``'s expected tokens with a draft of
        ``x``): a save for each draft longer than :attr:`checkpoint_above`, and where ``a`` tokens
        of one are kept (``a`` short of its length: a partial accept), a restore and the replay of
        ``a + 1`` tokens in the next step (what they add to its one-token decode)."""
        if self.checkpoint_above is None:
            return 0.0
        saved = [s for s, k in enumerate(ks) if k > self.checkpoint_above]
        if not saved:
            return 0.0
        total, one = self.save(len(saved)), self.target(1)
        for s in saved:
            y, k = yields[s], ks[s]
            kept = [1.0] + [y[a] - y[a - 1] for a in range(1, k + 1)]  # the first a tokens kept
            for a in range(k):
                total += (kept[a] - kept[a + 1]) * (self.restore(1) + self.target(a + 2) - one)
        return total


class _Given:
    """A curve given as a function: what the engine measures is not added to it."""

    known = True

    def __init__(self, f: Callable[[int], float]) -> None:
        self.f = f

    def add(self, size: int, seconds: float) -> None:
        pass

    def __call__(self, size: int) -> float:
        return self.f(size) if size > 0 else 0.0

    floor = __call__


class FixedCosts(StepCosts):
    """Costs given as functions (tests): ``target(n)``, ``catch_up(n)``, ``draft(n)`` seconds (a
    draft decode of ``n`` tokens: one per slot, each slot's chain with chained heads), ``save(m)``
    and ``restore(m)`` (speculative checkpoints of ``m`` slots)."""

    def __init__(self, target: Callable[[int], float], catch_up: Callable[[int], float] = lambda n: 0.0,
                 draft: Callable[[int], float] = lambda m: 0.0, save: Callable[[int], float] = lambda m: 0.0,
                 restore: Callable[[int], float] = lambda m: 0.0) -> None:
        super().__init__()
        self.target, self.catch_up, self.draft = _Given(target), _Given(catch_up), _Given(draft)  # type: ignore[assignment]
        self.save, self.restore = _Given(save), _Given(restore)  # type: ignore[assignment]

    measured = False

    @property
    def known(self) -> bool:
        return True


def acceptance_length(p: Sequence[float], cap: int, keep: float = 0.5) -> int:
    """The length acceptance alone would take: the leading depths whose estimate is at least
    ``keep``, at most ``cap``."""
    n = 0
    while n < cap and p[n] >= keep:
        n += 1
    return n


class DraftPolicy:
    """Chooses each step's draft lengths (see the module docstring) from ``costs``."""

    #: every this many steps with measured costs, one slot explores (drafts one token more than
    #: its best length, where acceptance would); doubled after each explore while steps are plain
    EXPLORE = 50
    #: the longest wait between explores
    EXPLORE_MAX = 800
    #: and every this many, one slot drafts a length whose target batch was never timed and
    #: could pay, if any is (the shortest such, up to what acceptance alone would draft)
    FILL = 8
    #: a step with drafts is chosen over a plain one only where its rate is this much higher:
    #: near break-even a draft is a bet that the costs' noise decides (on a CPU the same batch
    #: timed 10% apart between the prior and the steps), at acceptance estimates that start at
    #: one, and a lost bet costs more than a won one gains
    MARGIN = 1.1

    def __init__(self, costs: Optional[StepCosts] = None, primed: bool = False) -> None:
        """``primed``: every size was timed just now (the engine's cost prior, :mod:`.prior`): that
        counts as an explore, so the first comes after twice :attr:`EXPLORE` steps (a request of
        64 tokens where drafting does not pay then drafts one probe, not a probe and an explore)."""
        self.costs = costs if costs is not None else StepCosts()
        self.steps = 0
        self.turn = 0  # whose turn it is to explore (see _try_one)
        self.every = 2 * self.EXPLORE if primed else self.EXPLORE  # the wait between explores
        self.next_explore = self.every  # the step that explores next
        self.shadows: List[bool] = []  # per slot of the last choice: its length is a scout of a plain slot
        self.split: Optional[Callable[[List[int]], List[int]]] = None  # see choose

    def choose(self, slots: Sequence[Tuple[Sequence[float], int]], base_tokens: int = 0,
               limits: Optional[Sequence[int]] = None,
               split: Optional[Callable[[List[int]], List[int]]] = None) -> List[int]:
        """Draft lengths for the slots of the next step: each is ``(p, cap)``, its per-depth
        acceptance estimates and the longest draft it may take; ``base_tokens``: the batch's other
        tokens (prompt chunks); ``limits``: each slot's :attr:`~.drafting.AdaptiveLength.limit`
        (a probe's length, or twice what its last draft kept; None: the caps alone). Until a cost
        is measured every slot drafts its cap (within its limit).

        The step's rate, ``sum(expected tokens) / step seconds``, is maximized one slot at a time
        (each slot's best length given the others', every length from 0 to its cap within its
        limit, since a draft decode is a fixed cost per depth that one token alone may not pay and
        three may), over the slots in turn until no slot changes; a step with drafts must beat
        one without by :attr:`MARGIN`. Where a slot's limit alone keeps it from a draft that would
        pay (on a CPU, where a batch of 2 costs twice one token and only a longer draft can pay),
        one slot, in turn, *scouts*: it drafts its limit, so that what it keeps grows the limit
        towards that draft (see :meth:`_scout`).

        ``split``: the graphs llama.cpp computes for a step where the slots decode these many
        tokens each (the batch's other tokens included; :func:`~.schedule.ubatch_sizes`): a step
        costs each graph's target time. A recurrent target splits a batch into graphs of equal
        tokens per sequence, so at two slots a step where one drafts a token is two graphs (on one
        CPU 114 ms, against 84 for the plain step and 105 where both draft one); lengths equal
        across the slots are tried as a whole. None: one graph of all the tokens."""
        self.split = split
        caps = [max(0, min(cap, len(p))) for p, cap in slots]
        held = caps if limits is None else [min(c, max(0, int(x))) for c, x in zip(caps, limits)]
        self.shadows = [False] * len(slots)
        if not self.costs.known:
            return held
        self.steps += 1
        yields = [[expected_tokens(p, k) for k in range(cap + 1)] for (p, _), cap in zip(slots, caps)]
        k = self._best(yields, base_tokens, held)
        if any(k):  # drafting pays now (a scout is not that): explore at the first rate again
            self.every = self.EXPLORE
            self.next_explore = min(self.next_explore, self.steps + self.every)
        if any(c > h > x for c, h, x in zip(caps, held, k)):  # a slot could scout: the best without limits
            self._scout(k, held, self._best(yields, base_tokens, caps))
        explore, fill = self.steps >= self.next_explore, self.steps % self.FILL == 0
        if explore:  # while steps are plain, each explore doubles the wait for the next
            if not any(k):
                self.every = min(2 * self.every, self.EXPLORE_MAX)
            self.next_explore = self.steps + self.every
        if self.costs.measured and (explore or fill):  # the acceptance lengths only when needed
            wanted = [min(acceptance_length(p, cap), h) for (p, _), cap, h in zip(slots, caps, held)]
            self._try_one(k, wanted, yields, base_tokens, explore)
        return k

    def _scout(self, k: List[int], held: Sequence[int], free: Sequence[int]) -> None:
        """A scout (in place): the first slot, from :attr:`turn` on, whose best length ``k`` is
        short of its limit ``held`` where the best length without limits (``free``) is longer
        than the limit drafts its limit. A fresh slot's limit is one token: a probe that is cheap
        where the head disagrees; kept, it doubles the limit, so a draft long enough to pay is
        reached in a few steps. One slot a step: a scout is bought for the engine. A scout of a
        slot whose best length is none is flagged in :attr:`shadows`: the engine may draft it on
        the side of the plain step, unverified (a shadow draft, :meth:`~.drafting.AdaptiveLength.judge`)."""
        for i in range(len(k)):
            s = (self.turn + i) % len(k)
            if free[s] > held[s] > k[s]:
                self.shadows[s] = k[s] == 0
                k[s] = held[s]
                self.turn = s + 1
                return

    def _rate(self, ks: Sequence[int], yields: List[List[float]], base_tokens: int, least: bool = False) -> float:
        """A step's expected tokens per second with draft lengths ``ks`` (``least``: at the least
        its target batch can cost); a step with drafts is weighed at its seconds times
        :attr:`MARGIN`."""
        depths = [sum(1 for x in ks if x > d) for d in range(max(ks, default=0))]
        seconds = self.costs.step(self._sizes(ks, base_tokens), depths, least) + self.costs.rollback(ks, yields)
        if depths:
            seconds *= self.MARGIN
        tokens = sum(y[x] for y, x in zip(yields, ks))
        return tokens / seconds if seconds > 0 else float("inf")

    def _sizes(self, ks: Sequence[int], base_tokens: int) -> List[int]:
        """The target graphs' tokens of a step with draft lengths ``ks`` (see :meth:`choose`)."""
        counts = [1 + x for x in ks]
        return self.split(counts) if self.split is not None else [base_tokens + sum(counts)]

    def _best(self, yields: List[List[float]], base_tokens: int, tops: Sequence[int]) -> List[int]:
        """The lengths that maximize the step's rate (see :meth:`choose`); ``yields[s][x]``: slot
        ``s``'s expected tokens with a draft of ``x``; ``tops[s]``: its longest draft here."""
        k = [0] * len(yields)
        if len(k) > 1 and self.split is not None:  # from the best of equal lengths (one graph each)
            best = self._rate(k, yields, base_tokens)
            for x in range(1, max(tops, default=0) + 1):
                trial = [min(x, t) for t in tops]
                r = self._rate(trial, yields, base_tokens)
                if r > best * (1 + 1e-9):
                    k, best = trial, r
        # the slots whose drafts yield most choose first: where the batch has room for some
        # drafts only, theirs
        order = sorted(range(len(yields)), key=lambda s: -yields[s][tops[s]])
        for _ in range(4):  # a few rounds: each slot's best length given the others'
            changed = False
            for s in order:
                best_k, best = k[s], self._rate(k, yields, base_tokens)
                for x in range(tops[s] + 1):
                    if x == k[s]:
                        continue
                    trial = list(k)
                    trial[s] = x
                    r = self._rate(trial, yields, base_tokens)
                    if r > best * (1 + 1e-9):
                        best_k, best = x, r
                if best_k != k[s]:
                    k[s], changed = best_k, True
            if not changed:
                break
        return k

    def _try_one(self, k: List[int], wanted: List[int], yields: List[List[float]], base_tokens: int,
                 explore: bool) -> None:
        """An explore or fill step: one slot, in turn, drafts another length than ``k`` gives it
        (in place); the others keep the best lengths. Exploring for the engine rather than for
        every slot at once: at N slots, a step where each drafted what acceptance would was a
        batch N times as long, for one more timing.

        Explore: the slot drafts one token more than ``k`` gives it, where its acceptance would
        (a size next to the best one timed again: if it pays now, the next explore goes one
        further). Fill (only on a step without prompt tokens: each prompt chunk makes a batch
        size of its own, which timing would never end): the shortest length, up to what its
        acceptance would draft, that makes a target batch never timed and would beat ``k`` at the
        least that batch can cost (:meth:`_Curve.floor`). Costs between timed sizes are
        interpolated, and a size with a cost of its own (a kernel's tile filled, say) is found
        only by timing it; one that could not pay even so is not worth a step."""
        if not explore and base_tokens:
            return
        best = None if explore else self._rate(k, yields, base_tokens)
        for i in range(len(k)):
            s = (self.turn + i) % len(k)
            if explore:
                x = k[s] + 1 if wanted[s] > k[s] else None
            else:
                x = self._untimed(k, s, wanted[s], yields, base_tokens, best)
            if x is not None:
                k[s], self.shadows[s] = x, False
                self.turn = s + 1
                return

    def _untimed(self, k: List[int], s: int, wanted: int, yields: List[List[float]], base_tokens: int,
                 best: float) -> Optional[int]:
        """Slot ``s``'s shortest length up to ``wanted`` whose target batch (the others at ``k``)
        was never timed and beats ``best`` at the least it can cost; None where none does."""
        for length in range(1, wanted + 1):
            trial = list(k)
            trial[s] = length
            if length != k[s] and not all(self.costs.target.has(n) for n in self._sizes(trial, base_tokens)):
                if self._rate(trial, yields, base_tokens, least=True) > best:
                    return length
        return None
