"""``Engine``: a target context, its MTP draft context, their workspace and N sequence slots, stepped
by one thread.

Front-ends (``Llama``, the server) hand it :class:`~.request.Request` objects from any thread
(:meth:`Engine.submit`) and read their outputs; the engine's thread steps every busy slot
together, each step in three phases (vLLM's split): :func:`~.schedule.schedule` decides what each
slot contributes, :func:`~.execute.execute` runs the decodes, the sampling and the drafts, and
:func:`~.update.update` applies the results to the slots and the requests. A call that needs the
contexts to itself (the binding's low-level ``eval``, a state save or load) runs on the engine's
thread between steps, once no slot is busy (:meth:`Engine.exclusive`).

Faults: a decode that fails (an allocation failure, a lost RPC server) fails every request of
that step with the error and clears their sequences; the other slots go on, the next request on
a cleared slot evaluates its prompt afresh.
"""

from __future__ import annotations

import collections
import ctypes
import threading
import time
import warnings
import weakref
from typing import Callable, Deque, List, Optional, Sequence, Tuple

import numpy as np

from ..native.binding import llama_cpp
from .batch import Batch
from .checkpoints import (DEFAULT_CHECKPOINT_BYTES, DEFAULT_CHECKPOINT_MIN_STEP, DEFAULT_CTX_CHECKPOINTS,
                          CheckpointStore, PrefixReuse, write_state)
from .drafting import AdaptiveLength, MTPHead, auto_lengths
from .policy import DraftPolicy, StepCosts
from .prior import CostPrior, SavedAcceptance, calibrate
from . import rollback, shift, synthetic
from .execute import DecodeError, Verdict, execute, feed_lags
from .limits import check_draft_max
from .request import DraftStats, Output, Request
from .samplers import SlotSampler
from .schedule import Segment, n_graphs, schedule, ubatch_sizes
from .slots import Slot, SlotState
from .update import update

__all__ = ["Engine", "DecodeError"]


def _notify(cv) -> None:
    with cv:
        cv.notify_all()


def _run(ref, cv) -> None:
    """The engine's thread: waits for work without holding the engine."""
    while True:
        with cv:
            while True:
                engine = ref()
                if engine is None or engine._closed:
                    return
                if engine._ops or engine.waiting or engine.busy():
                    break
                del engine
                cv.wait()
        worked = engine._work()
        del engine
        if not worked:  # every busy slot waits for its reader (a throttled request)
            with cv:
                cv.wait(0.05)


class _Exclusive:
    def __init__(self, fn: Callable, idle: bool = True):
        self.fn = fn
        self.idle = idle  # run only once no slot is busy
        self.done = threading.Event()
        self.result = None
        self.error: Optional[BaseException] = None


class Engine:
    """Steps N slots of ``target`` (and, with ``draft``, MTP drafting) on one thread.

    ``target``/``draft``: the binding's ``_internals.LlamaContext`` objects (the draft an
    ``LLAMA_CONTEXT_TYPE_MTP`` context over the same model, None without drafting);
    ``workspace``: their :class:`~.workspace.Workspace` (kept for its stats); ``n_slots``: the
    sequences used (default: the target's ``n_seq_max``). ``draft_max``: the longest draft
    (``adaptive``: a length chosen per step, at most ``draft_max``); ``p_min``: llama.cpp's
    ``--draft-p-min``. ``proposer``: without a draft context, drafts from a callable instead
    (the binding's draft models: ``proposer(input_ids) -> tokens``, ``input_ids`` the tokens up to
    the one to continue). ``after_decode``: called after each decode (a lost RPC server raises
    there). The checkpoint arguments are ``Llama``'s (``ctx_checkpoints``, ...). ``synth_rates``:
    synthetic acceptance's rates per draft position (:mod:`.synthetic`, resolved; empty: off).
    ``context_shift``: a generating slot whose context is full drops half of what follows its
    request's ``n_keep`` and goes on (:mod:`.shift`; the contexts must be able to shift).
    """

    def __init__(self, target, draft=None, *, workspace=None, n_slots: Optional[int] = None, draft_max: int = 3,
                 adaptive: bool = False, p_min: float = 0.0, ctx_checkpoints: int = DEFAULT_CTX_CHECKPOINTS,
                 checkpoint_min_step: int = DEFAULT_CHECKPOINT_MIN_STEP,
                 ctx_checkpoints_bytes: int = DEFAULT_CHECKPOINT_BYTES, proposer: Optional[Callable] = None,
                 after_decode: Optional[Callable[[str], None]] = None, synth_rates: Sequence[float] = (),
                 context_shift: bool = False) -> None:
        tctx = target.ctx
        if tctx is None or (draft is not None and (draft.ctx is None or draft is target)):
            raise ValueError("the engine needs open target and draft contexts (two distinct ones)")
        self.target, self.draft, self.workspace = target, draft, workspace
        self.model = target.model
        model = llama_cpp.llama_get_model(tctx)
        self.vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.n_embd = int(llama_cpp.llama_model_n_embd_out(model))
        self.n_batch = int(llama_cpp.llama_n_batch(tctx))
        self.n_ubatch = int(llama_cpp.llama_n_ubatch(tctx))
        self.n_ctx_seq = int(llama_cpp.llama_n_ctx_seq(tctx))
        n_seq = int(llama_cpp.llama_n_seq_max(tctx))
        n_slots = n_seq if n_slots is None else n_slots
        if isinstance(n_slots, bool) or not isinstance(n_slots, int) or not 1 <= n_slots <= n_seq:
            raise ValueError(f"n_slots must be an integer in [1, {n_seq}] (the target's n_seq_max), got {n_slots!r}")
        params = getattr(target, "params", None)
        n_out = int(getattr(params, "n_outputs_max", 0) or 0) if params is not None else 0
        self.n_outputs_max = self.n_batch if n_out == 0 else min(n_out, self.n_batch)
        self.recurrent = bool(llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model))
        self.n_rs_seq = int(llama_cpp.llama_n_rs_seq(tctx))
        self.unified = bool(getattr(params, "kv_unified", False)) if params is not None else False
        self.proposer = proposer if draft is None else None
        drafting = draft is not None or self.proposer is not None
        self.draft_max = int(draft_max) if drafting else 0
        self.adaptive = adaptive and draft is not None
        if drafting:
            n_batch = min(self.n_batch, int(llama_cpp.llama_n_batch(draft.ctx))) if draft else self.n_batch
            check_draft_max(draft_max, n_batch, n_ubatch=self.n_ubatch,
                            n_rs_seq=self.n_rs_seq if self.recurrent else None)
        self.head: Optional[MTPHead] = MTPHead(target, draft, p_min=p_min) if draft is not None else None
        if self.head is not None and self.head.chained:  # a draft is at most as long as there are heads
            self.draft_max = min(self.draft_max, self.head.n_heads)
        if synth_rates and not drafting:
            raise ValueError("synthetic acceptance requires drafting")
        self.synth_probs = synthetic.conditional(synth_rates)  # empty: verification by match
        if self.synth_probs:
            warnings.warn(synthetic.WARNING, RuntimeWarning, stacklevel=3)
        self.context_shift = bool(context_shift)
        if self.context_shift and not shift.supported(self):  # llama-server turns it off, with a warning
            warnings.warn(shift.UNSUPPORTED, RuntimeWarning, stacklevel=3)
            self.context_shift = False
        #: a plain one-token decode's catch-up waits in the slot's lag (execute.py); False: every step's at once
        self.defer_catch_up = True
        self.prior: Optional[CostPrior] = None  # draft_max="auto": the costs measured before any request
        self.set_costs(StepCosts())  # what the engine's decodes cost (the prior, then measured as it runs)
        # a sliding-window cache that is not full-size keeps prefixes as llama-server does (.checkpoints)
        swa_full = bool(getattr(params, "swa_full", True)) if params is not None else True
        self.n_swa = 0 if swa_full else int(llama_cpp.llama_model_n_swa(model))
        self.reuse = PrefixReuse(recurrent=self.recurrent, reach=self.n_rs_seq, checkpoint_min_step=checkpoint_min_step,
                                 n_swa=self.n_swa, n_ubatch=self.n_ubatch, n_batch=self.n_batch)
        self.slots: List[Slot] = [
            Slot(i, self.n_ctx_seq, self.n_embd, CheckpointStore(ctx_checkpoints, ctx_checkpoints_bytes, seq_id=i))
            for i in range(n_slots)]
        self.tbatch = Batch(self.n_batch)
        self.after_decode = after_decode
        self.after_step: Optional[Callable[[], None]] = None  # an observer, on the engine's thread
        self.waiting: Deque[Request] = collections.deque()
        self.total = DraftStats()
        self.length_prior = None  # draft_max="auto": the acceptance a new request starts from
        self.saved_acceptance: Optional[SavedAcceptance] = None  # where it is kept for a later process
        self.last: Optional[Request] = None   # the request that ended last
        self.steps = 0
        self.peak_busy = 0                   # the most slots busy in one step
        self.busy_slot_steps = 0             # busy slots summed over the steps (their mean: /metrics)
        self.graphs_target = 0
        self.graphs_draft = 0
        self._pieces: dict = {}
        self._cv = threading.Condition()
        self._ops: Deque[_Exclusive] = collections.deque()
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    # any thread ------------------------------------------------------------------------------

    def submit(self, request: Request) -> Request:
        """Queue ``request``; its outputs come on :meth:`Request.outputs`."""
        bad = [t for t in request.prompt if not 0 <= t < self.n_vocab]
        if bad:
            raise ValueError(f"prompt token {bad[0]} is outside the vocabulary [0, {self.n_vocab})")
        if len(request.prompt) >= self.n_ctx_seq:
            raise ValueError(f"a prompt of {len(request.prompt)} tokens does not fit a sequence's context "
                             f"(n_ctx {self.n_ctx_seq} per slot): shorten it, or load with a larger n_ctx")
        if request.max_tokens == 0:
            request.finish = "length"
            request.emit(Output([], finish="length"))
            return request
        request.on_consumed = self._wake
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self.waiting.append(request)
            self._start()
            self._cv.notify_all()
        return request

    def complete(self, prompt, max_tokens: Optional[int], **kw) -> List[int]:
        """Submit a request and wait for its tokens (greedy by default)."""
        from .samplers import SamplingParams

        sampling = kw.pop("sampling", None) or SamplingParams(temp=0.0)
        return self.submit(Request(prompt, sampling, max_tokens=max_tokens, **kw)).wait()

    def exclusive(self, fn: Callable, *, idle: bool = True):
        """Run ``fn()`` on the engine's thread once no slot is busy (new requests wait meanwhile);
        its result. ``idle=False``: at the next step boundary, the slots as they are
        (:meth:`between_steps`)."""
        if threading.current_thread() is self._thread:
            return fn()
        op = _Exclusive(fn, idle)
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._ops.append(op)
            self._start()
            self._cv.notify_all()
        op.done.wait()
        if op.error is not None:
            raise op.error
        return op.result

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def between_steps(self, fn: Callable):
        """Run ``fn()`` on the engine's thread between two steps (reading the contexts' state while
        requests run); its result."""
        return self.exclusive(fn, idle=False)

    def queued(self) -> Tuple[List[Request], bool]:
        """What waits, as the engine's thread may read it: a copy of the queue, and whether an
        exclusive call waits for the slots to go idle (new requests wait behind it). Taken under
        the lock: :meth:`submit` and :meth:`exclusive` append from other threads, and a deque
        iterated while another thread appends raises."""
        with self._cv:
            return list(self.waiting), any(op.idle for op in self._ops)

    def dequeue(self, requests: Sequence[Request]) -> None:
        """Take ``requests`` (each one queued, from :meth:`queued`) off the queue, under the lock."""
        if not requests:
            return
        gone = {id(r) for r in requests}
        with self._cv:
            kept = [r for r in self.waiting if id(r) not in gone]
            self.waiting.clear()
            self.waiting.extend(kept)

    def busy(self) -> int:
        return sum(1 for s in self.slots if s.busy)

    def close(self, timeout: float = 30.0) -> None:
        """Cancel every request, stop the thread (closing twice is harmless)."""
        with self._cv:
            self._closed = True
            for r in list(self.waiting):
                r.cancel("shutdown")
            for s in self.slots:
                if s.request is not None:
                    s.request.cancel("shutdown")
            self._cv.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        with self._cv:  # closed: nothing is appended any more, but take them under the lock still
            ops, waiting = list(self._ops), list(self.waiting)
            self._ops.clear()
            self.waiting.clear()
        for op in ops:
            op.error = RuntimeError("the engine is closed")
            op.done.set()
        for r in waiting:
            self.drop(r)
        for s in self.slots:
            if s.request is not None:
                self.finish(s, "cancelled")

    # the engine's thread ---------------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None:
            # the thread holds the engine only while it works: an engine nobody holds is
            # collected like any object, and its thread ends
            self._thread = threading.Thread(target=_run, args=(weakref.ref(self), self._cv),
                                            name="llama-metaws-engine", daemon=True)
            weakref.finalize(self, _notify, self._cv)
            self._thread.start()

    def _work(self) -> bool:
        """One turn of the engine's thread: an exclusive call, or a step. False: nothing to do."""
        with self._cv:
            op = next((o for o in self._ops if not o.idle or not self.busy()), None)
            if op is not None:
                self._ops.remove(op)
        if op is not None:
            try:
                op.result = op.fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                op.error = e
            op.done.set()
            return True
        try:
            return self.step()
        except BaseException as e:  # noqa: BLE001 - never lose the thread: fail what was running
            for s in self.slots:
                if s.request is not None:
                    self.fail(s, e)
            return True

    def step(self) -> bool:
        """One step: schedule, execute, update. False when there was nothing to do."""
        plan = schedule(self)
        if plan.empty:
            return False
        try:
            verdicts = execute(self, plan)
        except BaseException as e:  # noqa: BLE001 - a failed decode fails the step's requests
            for slot in [seg.slot for seg in plan.segments] + plan.draft_only:
                if slot.request is not None:
                    self.fail(slot, e)
            return True
        self.steps += 1
        self.peak_busy = max(self.peak_busy, len(plan.segments) + len(plan.draft_only))
        self.busy_slot_steps += len(plan.segments) + len(plan.draft_only)
        self.graphs_target += plan.graphs
        if self.after_step is not None:  # before the requests hear of the step: the contexts are still ours
            try:
                self.after_step()
            except BaseException as e:  # noqa: BLE001 - an observer's failure fails the step's requests
                for slot in [seg.slot for seg in plan.segments] + plan.draft_only:
                    if slot.request is not None:
                        self.fail(slot, e)
                return True
        update(self, plan, verdicts)
        return True

    # what the phases call ----------------------------------------------------------------

    def admit(self, slot: Slot, r: Request) -> bool:
        """Put ``r`` on ``slot``: its sampler, the prefix it reuses, its prompt's chunks."""
        try:
            slot.sampler = SlotSampler(self.model, self.n_vocab, r.sampling, slot.history)
            slot.sampler.accept_prompt(r.prompt)
        except BaseException as e:  # noqa: BLE001 - a bad grammar fails this request alone
            r.fail(e)
            return False
        slot.request, slot.state = r, SlotState.PROMPT
        if self.synth_probs:  # synthetic acceptance: the request's own draws, from its seed
            slot.synth_rng = synthetic.request_rng(r.sampling.seed)
        r.slot, r.t_start = slot.seq_id, time.perf_counter()
        fresh = r.prompt_rows or not r.cache_prompt  # every prompt row wanted, or no reuse asked for
        held_back = self.head is not None and r.draft  # draft-mtp: the last token comes with the first draft
        end = len(r.prompt) - 1 if held_back else len(r.prompt)
        try:
            keep = self.reuse.start(self, slot, r.prompt, fresh=fresh)
        except BaseException as e:  # noqa: BLE001
            self.fail(slot, e)
            return False
        r.cache_n = keep
        slot.cursor, slot.prompt_end = keep, end
        slot.length = AdaptiveLength(self.length_prior) if self.adaptive else None
        self.reuse.stops(slot, keep, end, len(r.prompt))
        if keep >= end:  # the prompt but its held-back token is held already: draft from it first
            slot.state, slot.last, slot.drafts, slot.asked = SlotState.GENERATING, r.prompt[-1], [], 0
            slot.needs_draft = True
            r.t_encoded = time.perf_counter()
        r.report_progress(keep)  # on its slot: nothing evaluated yet (llama-server's first report)
        return True

    def shift_context(self, slot: Slot) -> None:
        """A generating slot's context is full: shift it (:mod:`.shift`), or fail its request."""
        try:
            feed_lags(self, [slot])  # the positions move: none may wait
            shift.shift(self, slot)
        except BaseException as e:  # noqa: BLE001 - this request alone
            self.fail(slot, e)

    def eval_session(self, tokens, *, every_row: bool) -> np.ndarray:
        """The binding's low-level ``eval`` on slot 0 (called on the engine's thread with no slot
        busy): ``tokens`` after what the slot holds, in chunks of ``n_batch`` (of ``n_outputs_max``
        with ``every_row``), the draft context following. Returns the logits rows (the last, or
        every one)."""
        slot = self.slots[0]
        self.seq_rm(0, slot.n)  # anything past what the slot holds (the binding's eval does so)
        step = min(self.n_batch, self.n_outputs_max) if every_row else self.n_batch
        out = []
        b = self.tbatch
        try:
            for start in range(0, len(tokens), step):
                chunk = tokens[start : start + step]
                b.clear()
                b.add(chunk, slot.n, slot.seq_id, True if every_row else "last")
                self.decode_target(b, "prompt processing")
                pending = None
                if self.head is not None:
                    rows = self.head.target_rows(b.n)
                    self.head.catch_up([(slot.seq_id, 0, b.n, slot.pending)], b.token, b.pos, rows,
                                       "prompt processing")
                    pending = rows[b.n - 1].copy()
                idx = range(b.n) if every_row else [b.n - 1]
                out.extend(self.logits(self.target.ctx, i) for i in idx)
                slot.tokens[slot.n : slot.n + b.n] = chunk
                slot.keep(slot.n + b.n, pending)
        except BaseException:
            self.clear_sequence(slot)
            raise
        return np.stack(out) if out else np.zeros((0, self.n_vocab), dtype=np.float32)

    def draft_length(self, v: Verdict) -> int:
        """The longest draft the slot of ``v`` may take in the next step: ``draft_max``, less where
        the request's ``max_tokens`` or the slot's context leave fewer (0: a plain decode step)."""
        slot = v.segment.slot
        r = slot.request
        if not r.draft or self.draft_max == 0 or v.replay:  # a replay step drafts nothing (rollback.py)
            return 0
        n = self.draft_max
        remaining = r.remaining
        if remaining is not None:  # a step yields its accepted drafts and one token more
            n = min(n, remaining - len(v.tokens) - 1)
        return max(0, min(n, slot.n_ctx - 1 - v.n))

    def draft_lengths(self, going: List[Verdict], verdicts: List[Verdict]) -> List[int]:
        """The draft lengths of the next step for the slots that go on (``going``): each one's
        :meth:`draft_length`, or with ``draft_max="auto"`` the :class:`~.policy.DraftPolicy`'s
        choice within it, from each slot's acceptance (this step's verdicts applied first) and the
        measured costs of the step (:func:`~.drafting.auto_lengths`)."""
        caps = [self.draft_length(v) for v in going]
        return auto_lengths(self, going, verdicts, caps) if self.adaptive else caps

    def decode_target(self, b: Batch, phase: str = "decoding") -> None:
        while True:
            rc = llama_cpp.llama_decode(self.target.ctx, b.batch)
            if self.after_decode is not None:
                self.after_decode("target")
            # 1: no KV cells for the batch (llama.cpp found them before computing anything, so the
            # memory is as it was). In a unified KV the idle slots' cached prompts share the cells
            # the running ones need: as llama-server (try_clear_idle_slots), one idle slot's
            # sequence is cleared and the batch tried again
            if not (rc == 1 and self.unified and self.clear_an_idle_slot()):
                break
        if rc != 0:
            # 1: no KV cells free for the batch (llama.h), what llama-server reports as below
            why = "; the context size has been exceeded (no free KV cells)" if rc == 1 else ""
            raise DecodeError(f"llama_decode on the target context returned {rc} during {phase} ({b.n} tokens, "
                              f"{b.n_outputs} output rows; n_batch {self.n_batch}, "
                              f"n_outputs_max {self.n_outputs_max}){why}")

    def take_checkpoints(self, seg: Segment, rows) -> None:
        slot = seg.slot
        end = seg.pos0 + seg.n
        tokens = np.concatenate([slot.tokens[: seg.pos0], np.asarray(seg.tokens, dtype=np.intc)])
        for back in seg.backs:
            self.reuse.save(self.target.ctx, slot, tokens[: end - back], rows, seg.i0 + seg.n - 1, back)

    def checkpoint_drafts(self, segments: List[Segment]) -> None:
        """Before the target decode: the state of each slot whose draft its snapshots cannot roll
        back (:func:`~.rollback.save`)."""
        rollback.save(self, segments)

    def roll_back(self, verdicts: List[Verdict]) -> None:
        """Remove the positions a verdict did not keep (rejected drafts) from both contexts
        (:func:`~.rollback.roll_back`)."""
        rollback.roll_back(self, verdicts)

    def restore_target(self, seq: int, state: bytes, n: int) -> bool:
        """Sequence ``seq`` of the target back to its first ``n`` positions with ``state`` (a
        checkpoint's recurrent state, ``b""`` for none: ``n`` 0) and its KV cut there; whether the
        target now holds exactly those positions."""
        if n == 0:
            return bool(llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.target.ctx), seq, -1, -1))
        write_state(self.target.ctx, state, seq)
        return self.seq_rm(seq, n, target_only=True) and self.seq_pos_max(seq) == n - 1

    def logits(self, ctx, i: int, *, copy: bool = True) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(ctx, i)
        if not ptr:
            raise RuntimeError(f"the context returned no logits for batch index {i}")
        row = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
        return row.copy() if copy else row

    def piece(self, token: int) -> bytes:
        """A token's text (``llama_token_to_piece``, special tokens as text), cached."""
        got = self._pieces.get(token)
        if got is None:
            buf = ctypes.create_string_buffer(64)
            n = int(llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True))
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = int(llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, True))
            got = self._pieces[token] = buf.raw[:max(n, 0)]
        return got

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def seq_rm(self, seq: int, p0: int, *, target_only: bool = False) -> bool:
        """Remove positions ``p0..`` of ``seq`` from the target (and the draft context)."""
        ok = bool(llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.target.ctx), seq, p0, -1))
        if ok and not target_only:
            ok = self.seq_rm_draft(seq, p0)
        return ok

    def seq_rm_draft(self, seq: int, p0: int) -> bool:
        if self.draft is None:
            return True
        return bool(llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.draft.ctx), seq, p0, -1))

    def seq_pos_min(self, seq: int) -> int:
        return int(llama_cpp.llama_memory_seq_pos_min(llama_cpp.llama_get_memory(self.target.ctx), seq))

    def seq_pos_max(self, seq: int) -> int:
        return int(llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(self.target.ctx), seq))

    def clear_an_idle_slot(self) -> bool:
        """Clear the sequence of one idle slot that holds tokens; False when there is none."""
        for slot in self.slots:
            if slot.state == SlotState.IDLE and slot.n > 0:
                self.clear_sequence(slot)
                return True
        return False

    def clear_sequence(self, slot: Slot) -> None:
        """The slot's sequence removed from both contexts (its checkpoints too)."""
        for ctx in (self.target, self.draft):
            if ctx is not None and ctx.ctx is not None:
                llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx.ctx), slot.seq_id, -1, -1)
        slot.forget()

    def set_costs(self, costs: StepCosts) -> None:
        """Another cost model (a test's, or one with its own clock) for draft_max="auto", and a
        policy that starts from it (the prior is dropped: :meth:`calibrate` measures one again)."""
        self.costs = costs
        costs.chained = self.head is not None and self.head.chained
        costs.checkpoint_above = self.n_rs_seq if self.recurrent else None
        self.policy = DraftPolicy(costs)
        self.prior = None
        if self.head is not None:
            self.head.clock = costs.clock

    def calibrate(self, key: Optional[dict] = None, load_s: Optional[float] = None) -> Optional[CostPrior]:
        """draft_max="auto": the cost prior (:mod:`.prior`: measured on the engine's thread once no
        slot is busy, or the curve saved under ``key``, checked), and the policy starts from it.
        The slots' sequences are cleared (what they held is evaluated again). None without the
        MTP head."""
        if not self.adaptive or self.head is None:
            return None
        self.prior = self.exclusive(lambda: calibrate(self, key, load_s))
        self.policy = DraftPolicy(self.costs, primed=True)  # every size timed: the first explore waits
        return self.prior

    def remember_acceptance(self, key: dict) -> Optional[str]:
        """draft_max="auto": the acceptance is kept in the user cache under ``key``
        (:class:`~.prior.SavedAcceptance`): the next request starts from what was saved there, and
        each request that drafted saves what it left as it ends. The saved file it started from."""
        if not self.adaptive or self.head is None:
            return None
        self.saved_acceptance = SavedAcceptance(key)
        self.length_prior = self.saved_acceptance.load() or self.length_prior
        return self.saved_acceptance.path

    def graphs_of_draft(self, segments) -> int:
        """The graphs the MTP draft context computed catching up with a step of these segments
        (its KV cache: a stream per sequence without kv_unified, the same split as the target's
        attention)."""
        return n_graphs(segments, self.n_ubatch, sequential=not self.unified, keep_tail=0,
                        split_equal=not self.unified and len(self.slots) > 1)

    def graphs(self, segments) -> int:
        """The graphs the target computed for a step of these segments (llama.cpp's ubatch split)."""
        return len(self.target_split([(s.slot.seq_id, s.n) for s in segments]))

    def target_split(self, counts) -> List[int]:
        """The tokens of each graph the target computes for a batch of ``counts``, ``(seq_id,
        tokens)`` in batch order (:func:`~.schedule.ubatch_sizes`)."""
        return ubatch_sizes(counts, self.n_ubatch, sequential=not self.unified,
                            keep_tail=self.n_rs_seq + 1 if self.recurrent and self.n_rs_seq > 0 else 0,
                            split_equal=self.recurrent or (not self.unified and len(self.slots) > 1))

    def finish(self, slot: Slot, reason: str, tokens=None, rows=None, prompt_rows=None) -> None:
        """End the slot's request (its last output), keep what the sequence holds (for a request
        read token by token and closed, what its reader took, where the contexts can cut back)."""
        slot.last_used = self.steps
        feed_lags(self, [slot])  # a request cancelled between steps: its slot's last plain steps
        if slot.replay:  # tokens the target gave back (a restored checkpoint) are not held
            held = slot.n - slot.replay
            slot.replay = 0
            if self.seq_rm_draft(slot.seq_id, held):
                slot.keep(held, slot.row(held - 1))
            else:
                self.clear_sequence(slot)
        r = slot.request
        if r is not None and r.throttle and reason == "cancelled":
            keep = len(r.prompt) + r.n_consumed - r.shifted
            if 0 < keep < slot.n and self.seq_rm(slot.seq_id, keep):
                slot.keep(keep, slot.row(keep - 1))
        r = slot.release()
        if r is None:
            return
        r.finish = reason
        self.last = r
        if self.saved_acceptance is not None:
            self.saved_acceptance.save(self.length_prior)
        r.emit(Output(list(tokens or []), rows=rows, prompt_rows=prompt_rows, finish=reason))

    def fail(self, slot: Slot, error: BaseException) -> None:
        """Fail the slot's request with ``error``; its sequence is cleared on both contexts."""
        try:
            self.clear_sequence(slot)
        except BaseException:  # noqa: BLE001 - the contexts may be gone with the error
            slot.forget()
        r = slot.release()
        if r is not None:
            self.last = r
            r.fail(error)

    def drop(self, r: Request) -> None:
        """A request that never reached a slot: ended as cancelled."""
        r.finish = "cancelled"
        self.last = r
        r.emit(Output([], finish="cancelled"))

    def slot_states(self) -> list:
        return [s.describe() for s in self.slots]

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
