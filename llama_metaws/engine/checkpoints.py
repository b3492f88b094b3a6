"""Context checkpoints: the recurrent state of a target at chosen positions, in host memory.

A recurrent or hybrid target (qwen35) cannot cut its state back to an arbitrary position: the
state folds in every token, and its rollback snapshots (``n_rs_seq``) reach only into the last
decode (with the series' patch 0011 ``llama_memory_seq_rm`` says so by returning false). So
prompt reuse keeps, as llama-server does with ``--ctx-checkpoints``, copies of the recurrent
part of the state (what ``llama_state_seq_get_data_ext`` writes with
``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``, taken through patch 0024's call, :func:`state_back`)
at the end of each prompt and every ``checkpoint_every`` tokens of a long one. A later request
restores the newest checkpoint inside the prefix it shares with the tokens held, cuts the
attention KV after it and evaluates only the rest. A checkpoint is also taken 4 tokens before the
end of each prompt, as llama-server does, for a next prompt that parts from this one in its last
tokens (the same prompt again, a template's or a tokenizer's seam). Where the target's rollback
snapshots reach that far back (``n_rs_seq >= 3``: ``draft_max`` 3 or more), that one is read from
them after the prompt's last batch (the series' patch 0024, :func:`state_back`); else the prompt's
batches end there too, which costs one more small batch.

A :class:`Checkpoint` also keeps the tokens it covers (it is valid only while the context holds
exactly those tokens before it) and the target's hidden row of its last position (the MTP draft
context pairs the next token with it). A :class:`CheckpointStore` holds at most ``max_count``
checkpoints and ``max_bytes`` bytes (state, tokens and row together), dropping the oldest.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import List, Optional, Sequence

import numpy as np

from ..native.binding import llama_cpp
from ..native.shim import check_error, ffi, lib
from .buffers import context_address

__all__ = ["Checkpoint", "CheckpointStore", "PromptReuse", "DraftingLlamaState", "DEFAULT_CTX_CHECKPOINTS",
           "DEFAULT_CHECKPOINT_EVERY", "DEFAULT_CHECKPOINT_BYTES", "common_prefix"]

#: checkpoints kept at most (llama-server's ``--ctx-checkpoints``; its default is 32)
DEFAULT_CTX_CHECKPOINTS = 8
#: a checkpoint every this many tokens of a long prompt (0: only at the end of each prompt)
DEFAULT_CHECKPOINT_EVERY = 512
#: bytes of host memory the checkpoints may take at most
DEFAULT_CHECKPOINT_BYTES = 1 << 30
#: a checkpoint this many tokens before the end of each prompt too (llama-server's choice)
TAIL = 4

PARTIAL = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


def state_back(ctx, n_back: int, seq_id: int = 0) -> Optional[bytes]:
    """The recurrent part of sequence ``seq_id``'s state in ``ctx`` as it stood ``n_back``
    positions before its last one (``llama_state_seq_get_data_ext`` with ``PARTIAL_ONLY`` then,
    read back by it), from the rollback snapshots of the last decode (patch 0024); None when they
    do not reach back so far. The sequence itself is left as it is."""
    c = ffi.cast("struct llama_context *", context_address(ctx))
    size = ffi.new("size_t *")
    check_error(lib.lmws_state_seq_size_back(c, seq_id, n_back, size))
    if size[0] == 0:
        return None
    buf = ffi.new("uint8_t[]", size[0])
    check_error(lib.lmws_state_seq_get_back(c, seq_id, n_back, buf, size[0], size))
    return bytes(ffi.buffer(buf, size[0]))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


@dataclasses.dataclass
class Checkpoint:
    """The recurrent state after ``tokens`` (``n_tokens`` positions), with the row for the draft."""

    n_tokens: int
    tokens: np.ndarray          # the tokens it covers (intc)
    state: bytes                # what llama_state_seq_get_data_ext(..., PARTIAL_ONLY) writes
    row: Optional[np.ndarray]   # the target's hidden row of position n_tokens - 1 (None: unknown)

    @property
    def nbytes(self) -> int:
        return len(self.state) + self.tokens.nbytes + (0 if self.row is None else self.row.nbytes)

    def covers(self, held: np.ndarray) -> bool:
        """The context holds this checkpoint's tokens at its first positions."""
        return len(held) >= self.n_tokens and np.array_equal(held[: self.n_tokens], self.tokens)


class CheckpointStore:
    """At most ``max_count`` checkpoints and ``max_bytes`` bytes of them; the oldest go first."""

    def __init__(self, max_count: int = DEFAULT_CTX_CHECKPOINTS, max_bytes: int = DEFAULT_CHECKPOINT_BYTES,
                 seq_id: int = 0) -> None:
        for name, value in (("ctx_checkpoints", max_count), ("ctx_checkpoints_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.seq_id = seq_id
        self.items: List[Checkpoint] = []  # oldest first
        self.saved = self.restored = self.evicted = self.skipped = 0

    @property
    def enabled(self) -> bool:
        return self.max_count > 0 and self.max_bytes > 0

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.items)

    def newest(self) -> Optional[Checkpoint]:
        return max(self.items, key=lambda c: c.n_tokens, default=None)

    def save(self, ctx, tokens: Sequence[int], row: Optional[np.ndarray], back: int = 0) -> Optional[Checkpoint]:
        """Copy the recurrent state of ``ctx`` (a llama_context pointer) after ``tokens``: its
        state now, or ``back`` positions before now (:func:`state_back`; skipped when its
        snapshots do not reach)."""
        if not self.enabled or len(tokens) == 0:
            return None
        n = len(tokens)
        extra = n * np.dtype(np.intc).itemsize + (0 if row is None else row.nbytes)
        state = state_back(ctx, back, self.seq_id)  # back 0: the state as it stands
        if state is None or len(state) + extra > self.max_bytes:
            self.skipped += 1  # never fits (or not there): keep the ones there are
            return None
        cp = Checkpoint(n, np.asarray(tokens, dtype=np.intc).copy(), state,
                        None if row is None else np.asarray(row, dtype=np.float32).copy())
        self.items = [c for c in self.items if c.n_tokens != n]  # one per position: the newest
        self.items.append(cp)
        self.saved += 1
        while self.items and (len(self.items) > self.max_count or self.nbytes > self.max_bytes):
            self.items.pop(0)
            self.evicted += 1
        return cp

    def prune(self, held: np.ndarray) -> None:
        """Drop the checkpoints whose tokens the context no longer holds (their KV is gone)."""
        keep = [c for c in self.items if c.covers(held)]
        self.evicted += len(self.items) - len(keep)
        self.items = keep

    def best(self, limit: int) -> Optional[Checkpoint]:
        """The newest checkpoint at ``limit`` positions or fewer (call :meth:`prune` first)."""
        fit = [c for c in self.items if 0 < c.n_tokens <= limit]
        return max(fit, key=lambda c: c.n_tokens, default=None)

    def restore(self, ctx, cp: Checkpoint) -> None:
        """Put ``cp``'s recurrent state back into ``ctx`` (the attention KV is left alone)."""
        buf = (ctypes.c_uint8 * len(cp.state)).from_buffer_copy(cp.state)
        got = int(llama_cpp.llama_state_seq_set_data_ext(ctx, buf, len(cp.state), self.seq_id, PARTIAL))
        if got != len(cp.state):
            raise RuntimeError(f"llama_state_seq_set_data_ext read {got} of {len(cp.state)} bytes")
        self.restored += 1

    def clear(self) -> None:
        self.evicted += len(self.items)
        self.items = []

    def stats(self) -> dict:
        """``count``, ``bytes``, their bounds, the positions held, and the counters so far."""
        return {
            "count": len(self.items), "bytes": self.nbytes,
            "max_count": self.max_count, "max_bytes": self.max_bytes,
            "positions": sorted(c.n_tokens for c in self.items),
            "saved": self.saved, "restored": self.restored, "evicted": self.evicted, "skipped": self.skipped,
        }


def _memory(llm):
    return llama_cpp.llama_get_memory(llm._ctx.ctx)


def _pos_max(llm) -> int:
    # a hybrid memory answers the smaller of its attention and recurrent parts' last positions
    return int(llama_cpp.llama_memory_seq_pos_max(_memory(llm), 0))


class PromptReuse:
    """Prompt reuse for a :class:`~llama_metaws.Llama` whose target is recurrent or hybrid and
    drafts with its MTP head (``active``): the checkpoint store and the request-start logic.

    ``ctx_checkpoints`` (count) and ``ctx_checkpoints_bytes`` bound the store; ``checkpoint_every``
    adds a checkpoint every that many positions of a long prompt (0: only at each prompt's end).
    """

    def __init__(self, ctx_checkpoints: int = DEFAULT_CTX_CHECKPOINTS,
                 checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
                 ctx_checkpoints_bytes: int = DEFAULT_CHECKPOINT_BYTES) -> None:
        self.store = CheckpointStore(ctx_checkpoints, ctx_checkpoints_bytes)
        if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be an integer >= 0 (0: only at the end of each "
                             f"prompt), got {checkpoint_every!r}")
        self.every = checkpoint_every
        self.active = False

    def chunks(self, n_past: int, n: int, n_batch: int, prompt: bool, held_back: int = 0, reach: int = 0):
        """(start, size, backs) for evaluating ``n`` tokens after ``n_past``, less the last
        ``held_back`` (evaluated later, with drafts): chunks of ``n_batch`` at most; ``backs``, the
        checkpoints to take after a chunk, each as positions before its end (0: at its end).

        A request's ``prompt`` takes one at each multiple of ``every`` and at the end of what is
        evaluated here (chunks end there), and one :data:`TAIL` tokens before the end (as
        llama-server does: the next prompt may part from this one in its last tokens, a chat
        template's or a tokenizer's seam). That one is read from the last decode's rollback
        snapshots when they reach it (``reach``: the target's ``n_rs_seq``; the snapshots hold
        the states after a batch's last ``reach + 1`` tokens), else a chunk ends there too."""
        save = prompt and self.active and self.store.enabled
        end = n - held_back
        stops, tail = set(), n - TAIL
        if save:
            stops.add(end)
            if self.every:
                stops.update(range(self.every - n_past % self.every, n, self.every))
        stops = {x for x in stops if 0 < x <= end}
        bounds = list(self._bounds(end, n_batch, stops))
        taken = {}
        if save and 0 < tail <= end and tail not in stops:
            stop = next(b for a, b in bounds if a < tail <= b)
            if stop - tail <= reach:  # fewer than the chunk's tokens: its last ubatch holds them
                taken[stop] = stop - tail
            else:
                stops.add(tail)
                bounds = list(self._bounds(end, n_batch, stops))
        for start, stop in bounds:
            backs = ([taken[stop]] if stop in taken else []) + ([0] if stop in stops else [])
            yield start, stop - start, backs

    @staticmethod
    def _bounds(end: int, n_batch: int, stops: set):
        start = 0
        while start < end:
            stop = min([start + n_batch, end] + [x for x in stops if x > start])
            yield start, stop
            start = stop

    def save(self, llm, back: int = 0) -> None:
        """A checkpoint of the target as it stands, or ``back`` positions before (from its
        rollback snapshots); every position evaluated is in the prompt."""
        n = llm.n_tokens - back
        self.store.save(llm._ctx.ctx, llm.input_ids[:n], llm._mtp.rows.get(n - 1), back)

    def start(self, llm, tokens: List[int]) -> None:
        """Put the target (and the draft context) at the longest reusable prefix of ``tokens``.

        In order: the state held, when it lies inside the common prefix; the state held cut back
        to the prefix, where the recurrent snapshots can do that exactly (``seq_rm`` says so, with
        the series' patch 0011); the newest checkpoint inside the prefix; else nothing (a full
        evaluation). The last prompt token is always evaluated (the binding samples from its
        logits). The binding's own prefix match then finds exactly the positions kept.
        """
        mtp = llm._mtp
        n_held = llm.n_tokens
        if mtp.fed > n_held:
            mtp.sync(n_held)
        held = llm.input_ids[:n_held]
        self.store.prune(held)
        limit = min(common_prefix(held, tokens), len(tokens) - 1)
        if limit > 0 and mtp.fed == n_held and _pos_max(llm) == n_held - 1:
            if n_held <= limit:
                return  # the live state: nothing to restore
            if llama_cpp.llama_memory_seq_rm(_memory(llm), 0, limit, -1):  # inside the snapshots
                llm.n_tokens = limit
                mtp.sync(limit)
                llm._requires_eval = True
                return
        cp = self.store.best(limit)
        if cp is not None and cp.n_tokens <= mtp.fed:  # the draft context holds its positions
            try:
                self.store.restore(llm._ctx.ctx, cp)
                ok = (llama_cpp.llama_memory_seq_rm(_memory(llm), 0, cp.n_tokens, -1)
                      and _pos_max(llm) == cp.n_tokens - 1)
            except RuntimeError:
                ok = False
            if ok:
                llm.n_tokens = cp.n_tokens
                mtp.restart_at(cp.n_tokens, cp.row)
                llm._requires_eval = True
                return
        llm.reset()  # no reuse

    def end(self, llm, sampled: List[int]) -> None:
        """A request ended: cut the target back to what it sampled (drafts evaluated past the last
        sampled token stay otherwise), where the snapshots can, so that the next request's common
        prefix reaches the live state."""
        n = common_prefix(llm.input_ids[: llm.n_tokens], sampled)
        if 0 < n < llm.n_tokens and llama_cpp.llama_memory_seq_rm(_memory(llm), 0, n, -1):
            llm.n_tokens = n
            llm._mtp.sync(n)

    def stats(self) -> dict:
        """The store's :meth:`CheckpointStore.stats`, ``every``, and ``enabled`` (this instance
        reuses prompts through checkpoints: a recurrent or hybrid target with MTP drafting)."""
        return dict(self.store.stats(), enabled=self.active and self.store.enabled, every=self.every)


class DraftingLlamaState(llama_cpp.LlamaState):
    """The binding's ``LlamaState`` plus the MTP draft context: its llama state, the positions it
    holds and the target's hidden row the next token pairs with."""

    def __init__(self, state, draft_state: bytes, draft_fed: int, draft_row: Optional[np.ndarray]):
        super().__init__(input_ids=state.input_ids, scores=state.scores, n_tokens=state.n_tokens,
                         llama_state=state.llama_state, llama_state_size=state.llama_state_size,
                         seed=state.seed)
        self.draft_state = draft_state
        self.draft_fed = draft_fed
        self.draft_row = draft_row


def save_draft_state(llm, state) -> DraftingLlamaState:
    """``state`` (the target's, from the binding's ``save_state``) with the draft context's."""
    mtp = llm._mtp
    mtp.sync(llm.n_tokens)
    dctx = llm._draft_ctx.ctx
    size = int(llama_cpp.llama_state_get_size(dctx))
    buf = (ctypes.c_uint8 * size)()
    got = int(llama_cpp.llama_state_get_data(dctx, buf, size))
    if got == 0 or got > size:
        raise RuntimeError(f"llama_state_get_data on the draft context returned {got} of {size} bytes")
    row = mtp.rows.get(mtp.fed - 1)
    return DraftingLlamaState(state, bytes(buf)[:got], mtp.fed,
                              None if row is None else np.asarray(row, dtype=np.float32).copy())


def check_draft_state(llm, state) -> None:
    """A drafting Llama takes only a state with the draft context's (a ValueError otherwise)."""
    if llm._mtp is not None and not isinstance(state, DraftingLlamaState):
        raise ValueError("this state has no MTP draft context (saved by a Llama without draft='mtp'?): "
                         "save it with a drafting Llama's save_state(), or load it into one without drafting")


def load_draft_state(llm, state: DraftingLlamaState) -> None:
    """After the binding loaded the target's part of ``state``: the draft context's part."""
    if llm._mtp is None:
        return
    blob = state.draft_state
    buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
    if int(llama_cpp.llama_state_set_data(llm._draft_ctx.ctx, buf, len(blob))) != len(blob):
        llm.reset()
        llm._mtp.restart_at(0, None)
        raise RuntimeError("failed to set the draft context's state: the model starts afresh")
    llm._mtp.restart_at(min(state.draft_fed, llm.n_tokens), state.draft_row)
