"""MTP drafting across slots: the draft context follows the target, and drafts for every slot at once.

This is llama.cpp's draft-mtp (``common/speculative.cpp``, as llama-server drives it for all its
slots) over the binding's low-level calls:

* the target outputs its NextN hidden row for every token
  (``llama_set_embeddings_nextn(target, True, masked=False)``); the draft context is an
  ``LLAMA_CONTEXT_TYPE_MTP`` context with NextN rows for its output tokens only (``masked``);
* :meth:`MTPHead.catch_up`: after each target decode, the same tokens are decoded on the draft
  context in one batch, token ``p`` of a slot paired with the target's row ``p - 1`` (the slot's
  first token with its ``pending`` row);
* :meth:`MTPHead.propose`: each drafting slot drafts from ``(last, pending)``; one draft decode per
  depth carries one token of every slot still drafting (the head's argmax, stopped below
  ``p_min``), and the drafted positions are removed afterwards: the next catch-up fills them with
  the target's rows;
* a model with several NextN blocks (mimo2's three, step35's chained heads) has a trained head per
  draft depth, and llama.cpp's draft-mtp *chains* them (``chain_heads``): draft step ``k`` runs
  head ``k`` (``llama_set_nextn_layer_offset``, :meth:`MTPHead.select`), a draft is at most as
  long as there are heads, and head 0 runs every decode that is not a draft. Each head attends
  over its own layer's KV: the catch-up runs once per head, and draft step ``k`` decodes the whole
  chain so far (``last`` and the drafts before it, each with the row it pairs with) under head
  ``k``, after the draft positions are cleared;
* a draft that reads the target's KV cache (a Gemma 4 assistant, whose context's ``ctx_other`` is
  the target's: llama.cpp's ``is_mem_shared``) has no memory of its own to catch up: it is never
  fed, its blocks run in one graph (never chained), and every draft token of a step sits at the
  draft's first position, where the target's cache ends (the assistant is trained so).

:class:`AdaptiveLength` is ``draft_max="auto"``'s acceptance per slot, and :func:`auto_lengths`
its choice of the next step's draft lengths (a scout of a plain slot drafted on the side, a
*shadow draft*: :meth:`AdaptiveLength.judge`).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..native.binding import llama_cpp, llama_ext
from ..native.shim import check_error, ffi, lib
from .batch import Batch
from .buffers import context_address
from .limits import AUTO_DRAFT_MAX
from .policy import acceptance_length, engine_clock

__all__ = ["AdaptiveLength", "MTPHead", "auto_lengths", "top_probability", "P_MIN_TOP_K"]

P_MIN_TOP_K = 10  # llama.cpp's draft sampler: top-k 10, then a softmax over those


def top_probability(logits: np.ndarray) -> float:
    """The top candidate's probability as llama.cpp's draft-mtp measures it for ``p_min``: a
    softmax over the 10 largest logits (its draft sampler is ``top_k(10)``)."""
    k = min(P_MIN_TOP_K, logits.shape[0])
    top = np.partition(logits, logits.shape[0] - k)[-k:].astype(np.float64)
    return float(1.0 / np.exp(top - top.max()).sum())


class AdaptiveLength:
    """A slot's acceptance per draft depth, for ``draft_max="auto"``.

    It keeps, for every draft depth ``d`` (1 to :attr:`CAP`), an estimate of how often a
    draft's ``d``-th token is accepted once the ones before it were: a moving average of the
    verdicts (weight :attr:`RATE`). With chained NextN heads (mimo2, step35) depth ``d`` is
    drafted by head ``d - 1`` (:class:`MTPHead`), so each estimate is one head's, and the engine's
    ``draft_max`` (the cap the policy chooses within) is the number of heads. Every step each estimate drifts up by :attr:`RETRY`, so a
    depth given up is tried again now and then. The engine's :class:`~.policy.DraftPolicy`
    weighs these against the measured costs; :attr:`n` is the length acceptance alone would take
    (the leading depths whose estimate is at least :attr:`KEEP`, none when the first is below it).

    Trying is kept cheap where drafting does not pay. A depth never verified keeps its estimate,
    but the policy weighs it at most as the deepest verified one (:attr:`estimates`). Until a
    draft was verified, and after a draft whose first token was rejected (a *miss*), the next
    draft is a probe of one token; after a draft that kept ``a`` tokens of more the next is at
    most ``2 a`` long, and after one that kept every token twice the limit (:attr:`limit`: the
    length grows by doubling, as far as the cap, even where the policy chose a shorter draft than
    the limit allowed, a batch size cheaper than the next ones). Each draft in a row that was cut
    short (a miss, or a token rejected further on) halves the drift (up to :attr:`BACKOFF`
    times), so the probes and scouts thin out while the head keeps disagreeing. The drift is 0.01
    a step, 0.005 after one miss: where the head never agrees a request of 64 tokens pays for one
    probe (at 0.02, with a miss counted only at the first token and the depths never tried
    weighed at their start, it paid for three to five on one CPU thread). A new request's
    estimates start from ``prior``'s (the engine passes the slot that verified a draft last): the
    same model pair tends to agree as often on the next request, and a fresh start would probe
    again. Across processes the same holds through the user cache (:meth:`state`,
    :func:`~.prior.save_acceptance`): a fresh process of the same model pair starts where the last
    one left off.
    """

    CAP = AUTO_DRAFT_MAX
    KEEP = 0.5
    RATE = 0.5
    RETRY = 0.01
    BACKOFF = 5

    def __init__(self, prior: Optional["AdaptiveLength"] = None) -> None:
        self.p = list(prior.p) if prior is not None else [1.0] * self.CAP
        self.misses = prior.misses if prior is not None else 0  # drafts cut short, in a row
        self.limit = prior.limit if prior is not None else 1    # see the class docstring
        self.seen = prior.seen if prior is not None else 0      # the depths that had a verdict
        self.shadow: List[int] = []  # a shadow draft's tokens not judged yet (:meth:`judge`)
        self.shadow_kept = 0         # ... and how many of them the target sampled so far

    def state(self) -> dict:
        """What a later process starts from (:func:`~.prior.save_acceptance`): the estimates, the
        drafts cut short in a row, the limit and the depths that had a verdict."""
        return dict(p=[round(x, 6) for x in self.p], misses=self.misses, limit=self.limit, seen=self.seen)

    @classmethod
    def from_state(cls, state: dict) -> "AdaptiveLength":
        """An :class:`AdaptiveLength` with :meth:`state`'s figures (clamped to their ranges; depths
        beyond :attr:`CAP` dropped, missing ones at 1.0); ValueError (or TypeError) where they are
        not numbers."""
        out = cls()
        p = [min(1.0, max(0.0, float(x))) for x in list(state["p"])[:cls.CAP]]
        out.p = p + [1.0] * (cls.CAP - len(p))
        out.misses = max(0, int(state["misses"]))
        out.limit = max(1, min(cls.CAP, int(state["limit"])))
        out.seen = max(0, min(cls.CAP, int(state["seen"])))
        return out

    @property
    def estimates(self) -> List[float]:
        """:attr:`p` as the policy weighs it: a depth that never had a verdict is taken to agree
        at most as often as the deepest one that had (after a miss at the first depth, a draft of
        three is not worth a scout on the strength of two depths never tried)."""
        if not self.seen:
            return list(self.p)
        last = self.p[self.seen - 1]
        return self.p[:self.seen] + [min(p, last) for p in self.p[self.seen:]]

    @property
    def n(self) -> int:
        return min(self.limit, acceptance_length(self.estimates, self.CAP, self.KEEP))

    def drift(self) -> None:
        """A step starts: the estimates drift up, so a depth given up is tried again now and then
        (more slowly after each draft cut short in a row)."""
        step = self.RETRY * 0.5 ** min(self.misses, self.BACKOFF)
        self.p = [min(1.0, p + step) for p in self.p]

    def next_step(self) -> int:
        """A step starts (:meth:`drift`); the draft length acceptance alone would take: the leading
        depths whose estimate is at least :attr:`KEEP`, within :attr:`limit`."""
        self.drift()
        return self.n

    def judge(self, drafted: int, accepted: int, tokens: Sequence[int]) -> bool:
        """A step's verdicts: a verified draft's (``drafted`` tokens, the first ``accepted`` kept;
        none: 0), then the pending shadow draft's (:attr:`shadow`) against ``tokens``, what the
        target sampled this step, in order. True where either was applied (:meth:`update`).

        A *shadow draft* is a scout drafted on the side of a plain step: the draft context
        proposes its tokens, the target does not verify them, and each is judged against the
        token the target samples at its position in the steps that follow (kept while they are
        equal, as verification keeps a draft token). It costs the draft decodes alone, where a
        verified scout costs a longer target batch too (on a CPU a 2-token batch took up to 3.2
        one-token decodes), and what it teaches is the same."""
        judged = bool(drafted)
        if drafted:
            self.update(drafted, accepted)
        for token in tokens if self.shadow else ():
            if token != self.shadow[self.shadow_kept]:
                break
            self.shadow_kept += 1
            if self.shadow_kept == len(self.shadow):
                break
        else:
            return judged
        self.update(len(self.shadow), self.shadow_kept)
        self.shadow, self.shadow_kept = [], 0
        return True

    def update(self, drafted: int, accepted: int) -> None:
        """A draft of ``drafted`` tokens was judged (verified, or a shadow draft), its first ``accepted`` kept."""
        for d in range(min(drafted, accepted + 1)):  # depths with a verdict
            hit = 1.0 if d < accepted else 0.0
            self.p[d] += self.RATE * (hit - self.p[d])
        self.seen = max(self.seen, min(drafted, accepted + 1))
        if drafted:  # cut short (a miss, or a rejection further on): the drift halves again
            self.misses = self.misses + 1 if accepted < drafted else 0
            # every token kept: twice the limit (the policy may have drafted less than it allowed,
            # where that batch size was cheaper: the limit must not hold it there)
            grown = max(accepted, self.limit) if accepted == drafted else accepted
            self.limit = max(1, min(self.CAP, 2 * grown))


def _splitter(engine, going, fixed):
    """The next step's target graphs (their tokens) as a function of the tokens each of ``going``
    decodes, ``fixed`` (the prompt chunks that go on, ``(seq_id, tokens)``) included
    (:meth:`~.core.Engine.target_split`), for :meth:`~.policy.DraftPolicy.choose`; a slot's
    replay (:mod:`.rollback`) goes with its tokens."""
    seqs = [v.segment.slot.seq_id for v in going]
    replays = [v.replay for v in going]
    seen: Dict[Tuple[int, ...], List[int]] = {}

    def split(counts: List[int]) -> List[int]:
        key = tuple(counts)
        if key not in seen:
            seen[key] = engine.target_split(sorted(fixed + [(q, c + r) for q, c, r in zip(seqs, counts, replays)]))
        return seen[key]

    return split


def auto_lengths(engine, going, verdicts, caps: List[int]) -> List[int]:
    """``draft_max="auto"``: the next step's draft lengths for the slots that go on (``going``,
    their :class:`~.execute.Verdict`; ``caps``: each one's longest draft). This step's verdicts
    are judged first (a verified draft's, a shadow draft's: :meth:`AdaptiveLength.judge`), then
    the estimates drift and the engine's :class:`~.policy.DraftPolicy` chooses. A scout of a
    plain slot (:attr:`~.policy.DraftPolicy.shadows`) is a shadow draft (``Verdict.shadow``: its
    tokens are proposed with the step's drafts and kept on the slot's :attr:`AdaptiveLength.shadow`,
    not verified), unless one is pending there (no draft then) or acceptance is synthetic
    (verified at random, not by match: the scout is verified)."""
    for v in going:
        length = v.segment.slot.length
        if length.judge(v.drafted if v.verdict_known else 0, v.accepted, v.tokens):
            engine.length_prior = length  # the next request's estimates start here
            if engine.saved_acceptance is not None:
                engine.saved_acceptance.dirty = True
        length.drift()
    # the next step's prompt tokens, as far as they are known now: (seq_id, tokens) per chunk
    fixed = [(v.segment.slot.seq_id, min(v.segment.slot.prompt_end - (v.segment.pos0 + v.segment.n), engine.n_batch))
             for v in verdicts if v.segment.kind == "prompt" and not v.segment.ends_prompt and v.finish is None]
    lengths = [v.segment.slot.length for v in going]
    ks = engine.policy.choose([(x.estimates, cap) for x, cap in zip(lengths, caps)], sum(n for _, n in fixed),
                              [x.limit for x in lengths],  # a probe, or twice what was kept
                              _splitter(engine, going, fixed))
    for i, (v, x) in enumerate(zip(going, lengths)):
        v.shadow = bool(engine.policy.shadows[i] and ks[i]) and not engine.synth_probs
        if v.shadow and x.shadow:
            ks[i], v.shadow = 0, False
    return ks


class MTPHead:
    """The MTP draft context of a target, fed and drafting for several slots."""

    def __init__(self, target, draft, *, p_min: float = 0.0) -> None:
        tctx, dctx = target.ctx, draft.ctx
        try:
            p_min = float(p_min)
        except (TypeError, ValueError):
            raise ValueError(f"p_min must be a number in [0, 1], got {p_min!r}") from None
        if not 0.0 <= p_min <= 1.0:  # also refuses NaN
            raise ValueError(f"p_min must be in [0, 1], got {p_min!r}")
        params = getattr(draft, "params", None)
        if params is not None and int(getattr(params, "ctx_type", 0)) != llama_cpp.LLAMA_CONTEXT_TYPE_MTP:
            raise ValueError("the draft context is not an MTP context: create it with "
                             "ctx_type=LLAMA_CONTEXT_TYPE_MTP (engine.contexts.new_context(..., mtp=True))")
        params = getattr(target, "params", None)
        if params is not None and int(getattr(params, "ctx_type", 0)) == llama_cpp.LLAMA_CONTEXT_TYPE_MTP:
            raise ValueError("the target context is an MTP context; it must be a default one")
        self.target, self.draft = target, draft
        tmodel, dmodel = llama_cpp.llama_get_model(tctx), llama_cpp.llama_get_model(dctx)
        if llama_cpp.llama_model_n_layer_nextn(dmodel) < 1:
            raise ValueError("the draft context's model has no NextN (MTP) layers: load it with load_mtp=True")
        self.n_embd = int(llama_cpp.llama_model_n_embd_out(tmodel))
        if int(llama_cpp.llama_model_n_embd_out(dmodel)) != self.n_embd:
            raise ValueError("the draft model's hidden width differs from the target's")
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(tmodel)))
        self.p_min = float(p_min)
        #: the draft attends over the target's KV cache (llama.cpp's is_mem_shared): nothing to feed
        self.shares_memory = (llama_ext.llama_get_ctx_other(dctx) or 0) == (tctx or 0)
        #: the NextN heads; more than one: chained (draft step k runs head k, llama.cpp's chain_heads),
        #: unless the draft shares the target's memory (then they are blocks of one graph)
        self.n_heads = max(1, int(llama_cpp.llama_model_n_layer_nextn(dmodel)))
        self.chained = self.n_heads > 1 and not self.shares_memory
        self.capacity = int(llama_cpp.llama_n_batch(dctx))
        self.batch = Batch(self.capacity, self.n_embd)
        self.zero = np.zeros(self.n_embd, dtype=np.float32)
        self.clock = engine_clock  # the cost model's clock (Engine.set_costs)
        llama_ext.llama_set_embeddings_nextn(tctx, True, False)  # a hidden row for every token
        llama_ext.llama_set_embeddings_nextn(dctx, True, True)   # rows for output tokens only

    def target_rows(self, n: int) -> np.ndarray:
        """The target's hidden rows of its last decode (``n`` tokens, in batch order): a view,
        valid until the target's next decode."""
        ptr = llama_ext.llama_get_embeddings_nextn(self.target.ctx)
        if not ptr:
            raise RuntimeError("the target context returned no NextN rows")
        return np.ctypeslib.as_array(ptr, shape=(n, self.n_embd))

    def catch_up(self, segments: Sequence[Tuple], tokens: np.ndarray, pos: np.ndarray, rows: np.ndarray,
                 phase: str = "decoding") -> List[List[Tuple[int, int]]]:
        """Decode the target's last batch on the draft context: ``segments`` are ``(seq_id, i0, n,
        pending)`` per slot in batch order, ``tokens``/``pos`` the batch's, ``rows`` the target's
        rows for it. Token ``i0 + j`` pairs with row ``i0 + j - 1``, the first with ``pending``.
        A fifth item, ``(tokens, pos0, rows)`` or None, is the slot's lag (:meth:`feed`): tokens
        the target decoded in earlier steps, fed first. Returns what each decode carried."""
        if self.shares_memory:
            return []
        return self.feed(self.entries(segments, tokens, pos, rows), phase)

    def entries(self, segments: Sequence[Tuple], tokens: np.ndarray, pos: np.ndarray,
                rows: np.ndarray) -> List[Tuple[int, np.ndarray, int, np.ndarray]]:
        """:meth:`catch_up`'s segments as :meth:`feed`'s entries (each token with its row)."""
        entries = []
        for seq_id, i0, n, pending, *lag in segments:
            paired = np.empty((n, self.n_embd), dtype=np.float32)
            paired[0] = self.zero if pending is None else pending
            paired[1:] = rows[i0 : i0 + n - 1]
            toks, p0 = tokens[i0 : i0 + n], int(pos[i0])
            if lag and lag[0] is not None:
                ltoks, lpos, lrows = lag[0]
                toks, p0 = np.concatenate([np.asarray(ltoks, dtype=np.int32), toks]), lpos
                paired = np.concatenate([lrows, paired])
            entries.append((seq_id, toks, p0, paired))
        return entries

    def feed(self, entries: Sequence[Tuple[int, Sequence[int], int, np.ndarray]],
             phase: str = "decoding") -> List[List[Tuple[int, int]]]:
        """Decode ``entries`` on the draft context, each ``(seq_id, tokens, pos0, rows)`` (the
        tokens at ``pos0..``, each with the target's row of the position before it), in as few
        batches as hold them. Returns, per decode, the ``(seq_id, n)`` it carried (none: a draft
        that reads the target's memory is fed nothing)."""
        if self.shares_memory:
            return []
        b = self.batch
        b.clear()
        carried: List[List[Tuple[int, int]]] = []
        now: List[Tuple[int, int, int]] = []  # (seq_id, tokens, first position) in the batch
        for seq_id, toks, pos0, paired in entries:
            i = 0
            while i < len(toks):
                if not b.room:
                    self._decode_heads(b, now, phase)
                    carried.append([(q, n) for q, n, _ in now])
                    b.clear()
                    now = []
                take = min(b.room, len(toks) - i)
                b.add(toks[i : i + take], pos0 + i, seq_id, False, paired[i : i + take])
                now.append((seq_id, take, pos0 + i))
                i += take
        if b.n:
            self._decode_heads(b, now, phase)
            carried.append([(q, n) for q, n, _ in now])
        return carried

    def _decode_heads(self, b: Batch, parts: Sequence[Tuple[int, int, int]], phase: str) -> None:
        """A catch-up batch (``parts``: ``(seq_id, tokens, first position)``) decoded under each head
        in turn, its positions cleared before each (chained heads: every head's layer holds the
        KV of every position, as llama.cpp's draft-mtp fills it); one decode with a single head."""
        if not self.chained:
            self._decode(b, phase)
            return
        mem = llama_cpp.llama_get_memory(self.draft.ctx)
        try:
            for head in range(self.n_heads):
                for seq_id, _n, p0 in parts:
                    llama_cpp.llama_memory_seq_rm(mem, seq_id, p0, -1)
                self.select(head)
                self._decode(b, phase)
        finally:
            self.select(0)

    def select(self, head: int) -> None:
        """The NextN head the draft context's next decodes run (``llama_set_nextn_layer_offset``
        through the shim, which refuses a head the model does not have)."""
        ctx = ffi.cast("struct llama_context *", context_address(self.draft))
        check_error(lib.lmws_set_nextn_layer_offset(ctx, head))

    def propose(self, starts: Sequence[Tuple[int, int, int, Optional[np.ndarray], int]],
                on_depth=None) -> Dict[int, List[int]]:
        """Drafts for several slots: ``starts`` are ``(seq_id, last, pos, pending, n_max)``; one
        draft decode per depth carries every slot still drafting (chained heads: depth ``k`` under
        head ``k``, each slot's whole chain so far, ``n_max`` at most the heads). Returns seq_id ->
        drafts. ``on_depth(n, seconds)``: told each draft decode's tokens (one per slot drafting,
        a chain's prefix each with chained heads) and time (its logits read)."""
        out: Dict[int, List[int]] = {s[0]: [] for s in starts}
        # per slot: seq_id, pos, n_max, the chain's tokens (last, drafts) and the rows they pair with
        live = [(seq_id, pos, min(n_max, self.n_heads) if self.chained else n_max, [last],
                 [self.zero if pending is None else pending])
                for seq_id, last, pos, pending, n_max in starts if n_max > 0]
        dctx, depth = self.draft.ctx, 0
        mem = llama_cpp.llama_get_memory(dctx)
        b = self.batch
        try:
            while live:
                b.clear()
                last_index = []
                for seq_id, pos, _n, toks, rows in live:
                    if self.chained:  # head `depth` rebuilds its own layer's KV over the draft positions
                        llama_cpp.llama_memory_seq_rm(mem, seq_id, pos, -1)
                        i0 = b.add(toks, pos, seq_id, "last", np.stack(rows))
                        last_index.append(i0 + len(toks) - 1)
                    else:  # a draft over the target's memory: every token where that memory ends
                        at = pos if self.shares_memory else pos + depth
                        last_index.append(b.add(toks[-1:], at, seq_id, True, rows[-1][None, :]))
                if self.chained:
                    self.select(depth)
                t0 = self.clock()
                self._decode(b, "drafting")
                nxt = []
                for j, (seq_id, pos, n_max, toks, rows) in enumerate(live):
                    i = last_index[j]
                    logits = self._logits(dctx, i)
                    if j == 0 and on_depth is not None:  # the logits read waited for the decode
                        on_depth(b.n, self.clock() - t0)
                    tok = int(np.argmax(logits))
                    if self.p_min > 0.0 and top_probability(logits) < self.p_min:
                        continue
                    out[seq_id].append(tok)
                    if len(out[seq_id]) >= n_max:
                        continue
                    ptr = llama_ext.llama_get_embeddings_nextn_ith(dctx, i)
                    if not ptr:
                        raise RuntimeError("the draft context returned no NextN row while drafting")
                    row = np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy()
                    nxt.append((seq_id, pos, n_max, toks + [tok], rows + [row]))
                live = nxt
                depth += 1
        finally:
            if self.chained:
                self.select(0)  # head 0 for the decodes that are not drafts
            # the drafted positions go: the next catch-up fills them with the target's rows (a
            # draft over the target's memory wrote none)
            for seq_id, _last, pos, _pending, n_max in starts:
                if n_max > 0 and not self.shares_memory:
                    llama_cpp.llama_memory_seq_rm(mem, seq_id, pos, -1)
        return out

    def _logits(self, ctx, i: int) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(ctx, i)
        if not ptr:
            raise RuntimeError(f"the draft context returned no logits for output {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def _decode(self, b: Batch, phase: str) -> None:
        rc = llama_cpp.llama_decode(self.draft.ctx, b.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode on the draft context returned {rc} during {phase} "
                               f"({b.n} tokens)")
