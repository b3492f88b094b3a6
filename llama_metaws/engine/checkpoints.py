"""Context checkpoints: the recurrent state of a target at chosen positions, in host memory.

A recurrent or hybrid target (qwen35) cannot cut its state back to an arbitrary position: the
state folds in every token, and its rollback snapshots (``n_rs_seq``) reach only into the last
decode (with the series' patch 0011 ``llama_memory_seq_rm`` says so by returning false). So
prompt reuse keeps, as llama-server does with ``--ctx-checkpoints``, copies of the recurrent
part of the state (what ``llama_state_seq_get_data_ext`` writes with
``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``, taken through patch 0024's call, :func:`state_back`)
at the end of each prompt and every ``checkpoint_min_step`` tokens of a long one (llama-server's
``-cms``: its mid-prompt checkpoints at least that far apart; 0, no minimum: one at the end of
every chunk of the prompt the engine evaluates). A later request
restores the newest checkpoint inside the prefix it shares with the tokens held, cuts the
attention KV after it and evaluates only the rest. A checkpoint is also taken 4 tokens before the
end of each prompt, as llama-server does, for a next prompt that parts from this one in its last
tokens (the same prompt again, a template's or a tokenizer's seam). Where the target's rollback
snapshots reach that far back (``n_rs_seq >= 3``: ``draft_max`` 3 or more), that one is read from
them after the prompt's last batch (the series' patch 0024, :func:`state_back`); else the prompt's
batches end there too, which costs one more small batch.

A target with a sliding-window KV cache that is not full-size (Gemma 3: ``n_swa`` > 0 and
``swa_full`` off, llama-server's default) is treated as llama-server treats it: its prompt's
batches end :data:`TAIL` and ``TAIL + n_ubatch`` tokens before the prompt's end, with a checkpoint
(the window cache's cells, the same partial state) at each; a later request keeps a prefix only
where one of them lies inside it, and evaluates the whole prompt again otherwise (llama-server's
"forcing full prompt re-processing"; a plain cut only once the window has moved past every
position the cache still holds). Since the batches of a prompt end at the same places fresh or
after a restore, a prompt that parts from what its slot held in its first tokens, or the same
prompt again, gives the tokens a fresh slot gives: llama.cpp's CPU kernels are not
batch-invariant (the rows of a 47-token batch differ from the same rows in a 56-token one by up
to half a logit on Gemma 3 270M), so a cut anywhere else would make the answer depend on what the
slot held before (docs/real-gguf.md).

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

__all__ = ["Checkpoint", "CheckpointStore", "PrefixReuse", "DEFAULT_CTX_CHECKPOINTS",
           "DEFAULT_CHECKPOINT_MIN_STEP", "DEFAULT_CHECKPOINT_BYTES", "common_prefix", "state_back", "write_state"]

#: checkpoints kept at most per slot (llama-server's ``-ctxcp`` default)
DEFAULT_CTX_CHECKPOINTS = 32
#: the mid-prompt checkpoints this many tokens apart (llama-server's ``-cms`` default; 0: no minimum)
DEFAULT_CHECKPOINT_MIN_STEP = 8192
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


def write_state(ctx, state: bytes, seq_id: int = 0) -> None:
    """Put ``state`` (what :func:`state_back` read) back as sequence ``seq_id``'s recurrent state in
    ``ctx`` (``llama_state_seq_set_data_ext`` with ``PARTIAL_ONLY``; the attention KV is left
    alone)."""
    buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
    got = int(llama_cpp.llama_state_seq_set_data_ext(ctx, buf, len(state), seq_id, PARTIAL))
    if got != len(state):
        raise RuntimeError(f"llama_state_seq_set_data_ext read {got} of {len(state)} bytes")


def state_now(ctx, seq_id: int = 0) -> Optional[bytes]:
    """The partial state of sequence ``seq_id`` as it stands (``llama_state_seq_get_data_ext``
    with ``PARTIAL_ONLY``: a sliding-window cache's cells); None when it is empty."""
    size = int(llama_cpp.llama_state_seq_get_size_ext(ctx, seq_id, PARTIAL))
    if size == 0:
        return None
    buf = (ctypes.c_uint8 * size)()
    got = int(llama_cpp.llama_state_seq_get_data_ext(ctx, buf, size, seq_id, PARTIAL))
    return bytes(buf[:got]) if got else None


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
        if state is None and back == 0:  # a memory without rollback snapshots (a sliding-window cache)
            state = state_now(ctx, self.seq_id)
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


class PrefixReuse:
    """Prompt reuse per slot: what a request keeps of what its slot holds, and where its prompt's
    checkpoints are taken.

    ``recurrent``: the target has recurrent state (hybrid or recurrent: qwen35), so a cut needs
    its rollback snapshots (``reach``: its ``n_rs_seq``) or a checkpoint; other targets cut their
    KV anywhere, but one with a sliding-window cache that is not full-size (``n_swa``: its window,
    0 for none or a full-size one) as llama-server does (the module's docstring; ``n_ubatch``,
    ``n_batch``: the target's). Besides a checkpoint at each prompt's end and :data:`TAIL` tokens
    before it, ``checkpoint_min_step`` spaces those inside a long prompt: one every that many
    positions, so at least that far apart (llama-server's ``-cms``); 0, no minimum: one at the end
    of every chunk of the prompt a step evaluates (not for a window cache, whose prompts end their
    batches where llama-server's do).
    """

    def __init__(self, *, recurrent: bool, reach: int, checkpoint_min_step: int = DEFAULT_CHECKPOINT_MIN_STEP,
                 n_swa: int = 0, n_ubatch: int = 0, n_batch: int = 0) -> None:
        if isinstance(checkpoint_min_step, bool) or not isinstance(checkpoint_min_step, int) or checkpoint_min_step < 0:
            raise ValueError(f"checkpoint_min_step must be an integer >= 0 (0: no minimum), got {checkpoint_min_step!r}")
        self.recurrent = recurrent
        self.reach = reach
        self.min_step = checkpoint_min_step
        self.n_swa = n_swa
        self.n_ubatch = n_ubatch
        self.n_batch = n_batch

    @property
    def checkpointed(self) -> bool:
        """A prefix is kept through checkpoints (a recurrent target, or a window cache)."""
        return self.recurrent or self.n_swa > 0

    def _window_cut(self, engine, seq: int, limit: int) -> bool:
        """A window cache may be cut at ``limit`` without a checkpoint: llama-server's test, the
        oldest position it holds lies before the window of ``limit`` (never for a sequence
        shorter than the window)."""
        return engine.seq_pos_min(seq) < max(0, limit - self.n_swa)

    def start(self, engine, slot, prompt: Sequence[int], *, fresh: bool = False) -> int:
        """Cut the slot's sequence to the longest reusable prefix of ``prompt`` (on both contexts);
        return the positions kept. In order: the state held, when it lies inside the common
        prefix; a cut (a recurrent target: where its snapshots restore it exactly, patch 0011;
        a window cache: only past its window, as llama-server); the newest checkpoint inside the
        prefix; else nothing. The last prompt token is always
        evaluated (sampled from, or drafted from and decoded with its draft). ``fresh``: keep
        nothing."""
        held = slot.held()
        limit = 0 if fresh else min(common_prefix(held, prompt), len(prompt) - 1)
        seq = slot.seq_id
        window = self.n_swa > 0 and limit > 0 and not self._window_cut(engine, seq, limit)
        if limit >= slot.n > 0 and not window:
            return slot.n  # the live state: nothing to cut
        if limit > 0 and not window and engine.seq_rm(seq, limit):  # both contexts; false where a snapshot cannot
            slot.keep(limit, slot.row(limit - 1))
            return limit
        if self.checkpointed and limit > 0:
            store = slot.checkpoints
            store.prune(held)
            cp = store.best(limit)
            if cp is not None:
                try:
                    ok = engine.restore_target(seq, cp.state, cp.n_tokens)
                except RuntimeError:
                    ok = False
                store.restored += ok
                if ok and engine.seq_rm_draft(seq, cp.n_tokens):
                    slot.keep(cp.n_tokens, cp.row)
                    return cp.n_tokens
        engine.clear_sequence(slot)
        return 0

    def stops(self, slot, n_past: int, end: int, prompt_len: int) -> None:
        """Set the slot's checkpoint stops for evaluating its prompt from ``n_past`` to ``end``:
        a chunk ends at every multiple of ``min_step`` and at ``end``, each taking a checkpoint
        there (``min_step`` 0: every chunk's end takes one, ``slot.chunk_checkpoints``); the one
        :data:`TAIL` tokens before the prompt's end is read back from the last chunk's rollback
        snapshots where they reach it, else a chunk ends there too."""
        slot.stops, slot.tail, slot.chunk_checkpoints = {}, None, False
        if not (self.checkpointed and slot.checkpoints.enabled):
            return
        if not self.recurrent:  # a window cache: llama-server's batch ends, a checkpoint at each
            ends = [prompt_len - min(self.n_batch, n) for n in (TAIL + self.n_ubatch, TAIL)]
            slot.stops = {p: [0] for p in ends if n_past < p < end}
            return
        stops = {end: [0]}
        step = self.min_step
        if step:
            for p in range(step - n_past % step + n_past, end, step):
                stops.setdefault(p, [0])
        else:
            slot.chunk_checkpoints = True
        tail = prompt_len - TAIL
        if n_past < tail < end and tail not in stops:
            if end - tail <= self.reach:
                slot.tail = tail  # read back from the last chunk's snapshots (schedule._prompt_chunk)
            else:
                stops[tail] = [0]
        slot.stops = stops

    def save(self, ctx, slot, tokens: Sequence[int], rows, i_end: int, back: int) -> None:
        """A checkpoint of the slot's sequence after ``tokens``, read ``back`` positions before the
        last decode's end (``i_end``: that position's index in the batch; ``rows``: the batch's
        hidden rows, for the draft's pairing)."""
        row = None if rows is None else rows[i_end - back]
        cp = slot.checkpoints.save(ctx, tokens, row, back)
        if cp is not None and cp.row is not None:
            slot.rows[cp.n_tokens - 1] = cp.row
