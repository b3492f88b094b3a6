"""MTP speculative decoding over two low-level contexts: the target and its MTP (NextN) head.

This is llama.cpp's ``draft-mtp`` loop (``common/speculative.cpp`` driven the way
``examples/speculative-simple`` drives it), written against the binding's ``_internals``:

* the target context outputs its NextN hidden row ``h_p`` for *every* token
  (``llama_set_embeddings_nextn(tgt, True, masked=False)``); the draft context is an
  ``LLAMA_CONTEXT_TYPE_MTP`` context over the same model, with NextN rows only for the tokens
  that ask for outputs (``masked=True``);
* the draft context is fed token ``x_p`` paired with the target's hidden row ``h_{p-1}``
  (a ``llama_batch`` carrying both ``token`` and ``embd``); the first token of a request
  gets a zero row;
* the last prompt token is held back: the prompt minus its last token is prefilled (in chunks
  of at most ``n_batch``, the draft fed chunk by chunk), and every step then drafts from
  ``(last, pending row)``, verifies ``[last, d0 .. dn-1]`` on the target in one batch, feeds
  the same batch to the draft with the target's rows shifted by one, accepts the longest
  prefix of drafts equal to the target's argmax plus the target's own next token, and removes
  the rejected positions from both contexts with ``llama_memory_seq_rm``.

A hybrid/recurrent target (qwen35) can only roll its recurrent state back with snapshots:
create its context with ``n_rs_seq >= draft_max``. The draft context wants
``ctx_type = LLAMA_CONTEXT_TYPE_MTP``, the target's ``n_ctx`` and ``n_rs_seq = 0`` (its memory
is a plain KV cache over the NextN block).

Greedy only: the verification takes the target's argmax, so the output is token-identical to
greedy decoding of the target alone.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import numpy as np

from ..native.binding import _internals, llama_cpp, llama_ext

__all__ = ["DraftStats", "MTPDrafter"]

TARGET = "target"
DRAFT = "draft"


@dataclass
class DraftStats:
    """Draft tokens proposed and accepted, and target verification steps."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0

    @property
    def acceptance(self) -> float:
        """``accepted / drafted``; 0.0 when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def add(self, other: "DraftStats") -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.steps += other.steps


class _Batch:
    """A ``llama_batch`` for one sequence, optionally carrying a Python-owned ``embd`` array.

    With ``n_embd`` the batch holds both ``token`` and ``embd`` (the pairing an MTP context
    takes); ``embd`` points at memory owned here and is detached before ``llama_batch_free``.
    """

    def __init__(self, capacity: int, seq_id: int, n_embd: int = 0) -> None:
        self.capacity = capacity
        self.n_embd = n_embd
        self.batch = llama_cpp.llama_batch_init(capacity, 0, 1)
        b = self.batch
        self.token = np.ctypeslib.as_array(b.token, shape=(capacity,))
        self.pos = np.ctypeslib.as_array(b.pos, shape=(capacity,))
        self.logits = np.ctypeslib.as_array(b.logits, shape=(capacity,))
        self.n_seq_id = np.ctypeslib.as_array(b.n_seq_id, shape=(capacity,))
        self.n_seq_id[:] = 1
        for i in range(capacity):
            b.seq_id[i][0] = seq_id
        self._embd_buf = None
        self.embd: Optional[np.ndarray] = None
        if n_embd:
            self._embd_buf = (ctypes.c_float * (capacity * n_embd))()
            b.embd = ctypes.cast(self._embd_buf, ctypes.POINTER(ctypes.c_float))
            self.embd = np.ctypeslib.as_array(self._embd_buf).reshape(capacity, n_embd)

    def fill(
        self,
        tokens: Sequence[int],
        pos0: int,
        *,
        outputs: bool,
        rows: Optional[np.ndarray] = None,
    ) -> None:
        n = len(tokens)
        if n > self.capacity:  # pragma: no cover - the callers chunk
            raise ValueError(f"{n} tokens do not fit a batch of {self.capacity}")
        self.token[:n] = tokens
        self.pos[:n] = np.arange(pos0, pos0 + n, dtype=self.pos.dtype)
        self.logits[:n] = 1 if outputs else 0
        if self.embd is not None:
            assert rows is not None and rows.shape == (n, self.n_embd)
            self.embd[:n] = rows
        self.batch.n_tokens = n

    def close(self) -> None:
        if self.batch is None:
            return
        if self._embd_buf is not None:
            # embd belongs to Python: keep llama_batch_free away from it
            self.batch.embd = ctypes.cast(None, ctypes.POINTER(ctypes.c_float))
        llama_cpp.llama_batch_free(self.batch)
        self.batch = None
        self.token = self.pos = self.logits = self.n_seq_id = self.embd = None
        self._embd_buf = None


class MTPDrafter:
    """Greedy generation on ``target`` with drafts from its MTP head in ``draft``.

    ``target``: a default-type context of a model loaded with ``load_mtp=True`` (a hybrid or
    recurrent model needs ``n_rs_seq >= draft_max`` in its context params). ``draft``: an
    ``LLAMA_CONTEXT_TYPE_MTP`` context over a model with NextN layers (usually the same model
    object), with an ``n_batch`` at least ``draft_max + 1``.

    ``draft_max``: at most this many draft tokens per verification step. ``p_min``: drafting
    stops at the first draft token whose probability is below ``p_min``, with llama.cpp's
    meaning (``--draft-p-min``): a softmax over the head's 10 best candidates. Both contexts are switched to NextN output here; ``seq_id`` is the
    sequence both use.
    """

    def __init__(
        self,
        target: _internals.LlamaContext,
        draft: _internals.LlamaContext,
        *,
        draft_max: int = 3,
        p_min: float = 0.0,
        seq_id: int = 0,
    ) -> None:
        if isinstance(draft_max, bool) or not isinstance(draft_max, int) or draft_max < 1:
            raise ValueError(f"draft_max must be an integer >= 1, got {draft_max!r}")
        try:
            p_min_f = float(p_min)
        except (TypeError, ValueError):
            raise ValueError(f"p_min must be a number in [0, 1], got {p_min!r}") from None
        if not (0.0 <= p_min_f <= 1.0):  # also rejects NaN
            raise ValueError(f"p_min must be in [0, 1], got {p_min!r}")
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < 0:
            raise ValueError(f"seq_id must be an integer >= 0, got {seq_id!r}")
        if target is draft or target.ctx is None or draft.ctx is None:
            raise ValueError("target and draft must be two distinct, open contexts")
        if _ctx_type(draft) not in (None, llama_cpp.LLAMA_CONTEXT_TYPE_MTP):
            raise ValueError(
                "the draft context is not an MTP context: create it with "
                "ctx_type=LLAMA_CONTEXT_TYPE_MTP (loading.new_context(..., mtp=True))"
            )
        if _ctx_type(target) == llama_cpp.LLAMA_CONTEXT_TYPE_MTP:
            raise ValueError("the target context is an MTP context; it must be a default one")

        tctx, dctx = target.ctx, draft.ctx
        n_seq = min(llama_cpp.llama_n_seq_max(tctx), llama_cpp.llama_n_seq_max(dctx))
        if seq_id >= n_seq:
            raise ValueError(f"seq_id {seq_id} is not below the contexts' n_seq_max ({n_seq})")
        tmodel = llama_cpp.llama_get_model(tctx)
        dmodel = llama_cpp.llama_get_model(dctx)
        if llama_cpp.llama_model_n_layer_nextn(dmodel) < 1:
            raise ValueError(
                "the draft context's model has no NextN (MTP) layers: load it with load_mtp=True"
            )
        self.n_embd = int(llama_cpp.llama_model_n_embd_out(tmodel))
        if int(llama_cpp.llama_model_n_embd_out(dmodel)) != self.n_embd:
            raise ValueError("the draft model's hidden width differs from the target's")
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(tmodel)))

        n_batch_t = int(llama_cpp.llama_n_batch(tctx))
        n_ubatch_t = int(llama_cpp.llama_n_ubatch(tctx))
        n_batch_d = int(llama_cpp.llama_n_batch(dctx))
        if draft_max + 1 > min(n_batch_t, n_batch_d):
            raise ValueError(
                f"draft_max={draft_max}: a verification batch of {draft_max + 1} tokens must fit "
                f"n_batch (target {n_batch_t}, draft {n_batch_d})"
            )
        self.rollback_states = int(llama_cpp.llama_n_rs_seq(tctx))
        if llama_cpp.llama_model_is_recurrent(tmodel) or llama_cpp.llama_model_is_hybrid(tmodel):
            # the recurrent state rolls back through per-token snapshots of the last ubatch:
            # rejected drafts (up to draft_max) must be covered, and the verification batch
            # must be a single ubatch
            if self.rollback_states < draft_max:
                raise ValueError(
                    f"the target has recurrent state: its context needs n_rs_seq >= draft_max "
                    f"({draft_max}), it has {self.rollback_states}"
                )
            if draft_max + 1 > n_ubatch_t:
                raise ValueError(
                    f"draft_max={draft_max}: the verification batch must fit one target ubatch "
                    f"(n_ubatch {n_ubatch_t})"
                )

        self.target = target
        self.draft = draft
        self.draft_max = draft_max
        self.p_min = p_min_f
        self.seq_id = seq_id
        self.n_ctx = int(min(llama_cpp.llama_n_ctx_seq(tctx), llama_cpp.llama_n_ctx_seq(dctx)))
        self.chunk = min(n_batch_t, n_batch_d)
        self.stats = DraftStats()
        self.total = DraftStats()

        llama_ext.llama_set_embeddings_nextn(tctx, True, False)  # a hidden row for every token
        llama_ext.llama_set_embeddings_nextn(dctx, True, True)  # rows for output tokens only

        self._tbatch = _Batch(self.chunk, seq_id)
        self._dbatch = _Batch(self.chunk, seq_id, self.n_embd)
        self._pending = np.zeros(self.n_embd, dtype=np.float32)

    # ----------------------------------------------------------------------------------------
    # public

    def generate(
        self,
        prompt: Sequence[int],
        n: int,
        *,
        on_token: Optional[Callable[[int], object]] = None,
        on_draft: Optional[Callable[[int, List[int]], object]] = None,
    ) -> List[int]:
        """Greedily generate exactly ``n`` tokens after ``prompt``, drafting with the MTP head.

        Both contexts' memory for ``seq_id`` is cleared first: every call is a fresh request.
        ``on_token`` is called with each new token id as soon as it is accepted;
        ``on_draft(position, drafts)`` with each step's draft before it is verified, where
        ``position`` is that of the token the draft continues (``drafts[0]`` is the MTP
        head's guess for ``position + 1``).
        """
        if self._tbatch is None:
            raise RuntimeError("this MTPDrafter is closed")
        prompt = [int(t) for t in prompt]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        if not prompt:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.n_vocab]
        if bad:
            raise ValueError(f"prompt token {bad[0]} is outside the vocabulary [0, {self.n_vocab})")
        # the prompt and every generated token but the last are decoded on the target
        if len(prompt) + max(n - 1, 0) > self.n_ctx:
            raise ValueError(
                f"{len(prompt)} prompt tokens + {n} new ones do not fit n_ctx={self.n_ctx}"
            )

        self.stats = stats = DraftStats()
        if n == 0:
            return []

        self._clear()
        self._prefill(prompt[:-1])

        out: List[int] = []
        last = prompt[-1]
        n_past = len(prompt) - 1  # position of `last`, not yet decoded anywhere
        try:
            while len(out) < n:
                # the step yields len(drafts) + 1 tokens at most: never more than asked for,
                # and the draft region must stay inside the context
                n_draft = min(self.draft_max, n - len(out) - 1, self.n_ctx - n_past - 1)
                drafts = self._draft(last, n_past, n_draft)
                if on_draft is not None:
                    on_draft(n_past, list(drafts))
                ids, pending = self._verify(last, n_past, drafts)
                k = len(ids) - 1
                stats.drafted += len(drafts)
                stats.accepted += k
                stats.steps += 1

                self._pending = pending
                n_past += k + 1
                self._seq_rm(TARGET, n_past)
                self._seq_rm(DRAFT, n_past)

                for tok in ids:
                    out.append(tok)
                    if on_token is not None:
                        on_token(tok)
                last = ids[-1]
        finally:
            self.total.add(stats)
        return out

    # the step-by-step interface (llama.MTPDraftModel drives the loop from the binding's
    # generate(): the target is decoded there, the draft context follows it here)

    def rewind_draft(self, n_keep: int, pending: Optional[np.ndarray] = None) -> None:
        """Keep positions ``< n_keep`` of the draft context; the next token fed pairs with
        ``pending`` (the target's hidden row of position ``n_keep - 1``; None: a zero row,
        which makes drafts worse, never outputs different)."""
        self._seq_rm(DRAFT, n_keep)
        self._pending = (np.zeros(self.n_embd, dtype=np.float32) if pending is None
                         else np.asarray(pending, dtype=np.float32).copy())

    def follow_target(self, tokens: Sequence[int], pos0: int) -> np.ndarray:
        """The target has just decoded ``tokens`` at ``pos0``: feed them to the draft context
        (token p with the target's row p-1) and return the target's rows for them."""
        h = self._target_rows(len(tokens))
        self._feed_draft(list(tokens), pos0, h, "prompt" if len(tokens) > 1 else "decode")
        return h

    def propose(self, last: int, pos0: int, n_draft: int) -> List[int]:
        """Up to ``n_draft`` draft tokens continuing ``last`` (at ``pos0``, not yet decoded)."""
        return self._draft(int(last), pos0, n_draft)

    def close(self) -> None:
        for b in (self._tbatch, self._dbatch):
            if b is not None:
                b.close()
        self._tbatch = self._dbatch = None

    def __enter__(self) -> "MTPDrafter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    # ----------------------------------------------------------------------------------------
    # the loop

    def _clear(self) -> None:
        for which, ctx in ((TARGET, self.target), (DRAFT, self.draft)):
            mem = llama_cpp.llama_get_memory(ctx.ctx)
            if not llama_cpp.llama_memory_seq_rm(mem, self.seq_id, -1, -1):
                raise RuntimeError(f"llama_memory_seq_rm failed to clear the {which} context")
        # a fresh request: the first token pairs with a zero row (what llama.cpp's draft-mtp
        # uses for the very first request of a sequence)
        self._pending = np.zeros(self.n_embd, dtype=np.float32)

    def _prefill(self, tokens: Sequence[int]) -> None:
        """Decode ``tokens`` at positions 0.. on the target, and the draft alongside it."""
        for start in range(0, len(tokens), self.chunk):
            chunk = tokens[start : start + self.chunk]
            self._tbatch.fill(chunk, start, outputs=False)
            self._decode(TARGET, self._tbatch, "prompt")
            h = self._target_rows(len(chunk))
            self._feed_draft(chunk, start, h, "prompt")

    def _feed_draft(self, tokens: Sequence[int], pos0: int, h: np.ndarray, phase: str) -> None:
        """Decode ``tokens`` on the draft, token p paired with the target's row p-1.

        ``h`` holds the target's rows for these same positions; the first token takes the
        pending row, and the last row of ``h`` becomes the pending one.
        """
        n = len(tokens)
        rows = np.empty((n, self.n_embd), dtype=np.float32)
        rows[0] = self._pending
        rows[1:] = h[: n - 1]
        self._dbatch.fill(tokens, pos0, outputs=False, rows=rows)
        self._decode(DRAFT, self._dbatch, phase)
        self._pending = h[n - 1].copy()

    def _draft(self, last: int, pos0: int, n_draft: int) -> List[int]:
        """Up to ``n_draft`` tokens from the MTP head, starting from (last, pending row)."""
        drafts: List[int] = []
        if n_draft <= 0:
            return drafts
        dctx = self.draft.ctx
        tok, row = last, self._pending
        for i in range(n_draft):
            self._dbatch.fill([tok], pos0 + i, outputs=True, rows=row[None, :])
            self._decode(DRAFT, self._dbatch, "drafting")
            logits = self._logits(dctx, 0, DRAFT)
            tok = int(np.argmax(logits))
            if self.p_min > 0.0 and _top_probability(logits) < self.p_min:
                break
            drafts.append(tok)
            if len(drafts) >= n_draft:
                break
            ptr = llama_ext.llama_get_embeddings_nextn_ith(dctx, 0)
            if not ptr:
                raise RuntimeError("the draft context returned no NextN row while drafting")
            row = np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy()
        # the drafting positions go; the verification batch refills them from the target's rows
        self._seq_rm(DRAFT, pos0)
        return drafts

    def _verify(self, last: int, pos0: int, drafts: List[int]):
        """Decode [last, drafts...] on the target; return (accepted ids, the new pending row)."""
        tokens = [last] + drafts
        self._tbatch.fill(tokens, pos0, outputs=True)
        self._decode(TARGET, self._tbatch, "verification")
        tctx = self.target.ctx
        h = self._target_rows(len(tokens))
        k = 0
        best = int(np.argmax(self._logits(tctx, 0, TARGET)))
        while k < len(drafts) and best == drafts[k]:
            k += 1
            best = int(np.argmax(self._logits(tctx, k, TARGET)))
        ids = drafts[:k] + [best]
        # the draft gets the whole batch, rows shifted by one; the rejected tail is cut after
        self._feed_draft(tokens, pos0, h, "verification")
        return ids, h[k].copy()

    # ----------------------------------------------------------------------------------------
    # helpers

    def _decode(self, which: str, batch: _Batch, phase: str) -> None:
        ctx = self.target if which == TARGET else self.draft
        rc = llama_cpp.llama_decode(ctx.ctx, batch.batch)
        if rc != 0:
            raise RuntimeError(
                f"llama_decode on the {which} context returned {rc} during {phase} "
                f"({batch.batch.n_tokens} tokens from position {int(batch.pos[0])})"
            )

    def _seq_rm(self, which: str, p0: int) -> None:
        ctx = self.target if which == TARGET else self.draft
        mem = llama_cpp.llama_get_memory(ctx.ctx)
        if not llama_cpp.llama_memory_seq_rm(mem, self.seq_id, p0, -1):
            hint = (
                " (a recurrent target needs n_rs_seq >= draft_max to roll back)"
                if which == TARGET
                else ""
            )
            raise RuntimeError(
                f"llama_memory_seq_rm on the {which} context failed from position {p0}{hint}"
            )

    def _target_rows(self, n: int) -> np.ndarray:
        ptr = llama_ext.llama_get_embeddings_nextn(self.target.ctx)
        if not ptr:
            raise RuntimeError("the target context returned no NextN rows")
        return np.ctypeslib.as_array(ptr, shape=(n, self.n_embd)).copy()

    def _logits(self, ctx, i: int, which: str) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(ctx, i)
        if not ptr:
            raise RuntimeError(f"the {which} context returned no logits for output {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))


def _ctx_type(ctx: _internals.LlamaContext) -> Optional[int]:
    params = getattr(ctx, "params", None)
    return None if params is None else int(getattr(params, "ctx_type", 0))


P_MIN_TOP_K = 10  # llama.cpp's draft sampler: top-k 10, then a softmax over those


def _top_probability(logits: np.ndarray) -> float:
    """The top candidate's probability as llama.cpp's draft-mtp measures it for ``p_min``:
    a softmax over the 10 largest logits (its draft sampler is ``top_k(10)``), not over the
    whole vocabulary; one partial sort, no copy of the row in float64."""
    k = min(P_MIN_TOP_K, logits.shape[0])
    top = np.partition(logits, logits.shape[0] - k)[-k:].astype(np.float64)
    return float(1.0 / np.exp(top - top.max()).sum())
