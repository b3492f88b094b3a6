"""Context shift (llama-server's ``--context-shift``): a generating slot whose context is full goes on.

When a generating slot holds ``n_ctx - 1`` positions or more, llama-server (``pre_decode``) keeps
its first ``n_keep`` tokens (the request's ``n_keep``, 0 by default, -1 for the whole prompt; one
more where the vocabulary adds a BOS; at most ``n_ctx - 4``), removes the ``n_discard`` after
them (half of the rest by default) from the target's and the draft context's memory
(``llama_memory_seq_rm``), moves the positions after those back by as many
(``llama_memory_seq_add``) and goes on; the answer says ``truncated``. :func:`shift` does the same.

What that does to a memory (llama.cpp's ``src/llama-kv-cache.cpp``, ``llama-memory-recurrent.cpp``,
``llama-memory-hybrid.cpp``):

* attention KV: the cells of the range go, the later cells' positions move and their keys are
  rotated again at the next decode (a K-shift). Only where ``llama_memory_can_shift`` says so:
  not with M-RoPE (qwen35's and the VL models' multi-section positions) and not for step35;
* recurrent state holds no cell per position, only the state after the sequence's last token:
  removing a range before that token leaves it as it is (it still carries what it read of the
  removed tokens) and the shift moves its position; a recurrent memory can always shift, a
  hybrid one (qwen3next, qwen35, ...) as its attention can.

llama-server turns context shift off, with a warning, for a target whose memory cannot shift
(and then ends a generation that fills the slot, ``truncated``); so does the engine
(:func:`supported`). After a shift the slot's token list loses the removed tokens (as
llama-server's cache does, so prompt reuse compares against what the contexts hold), the hidden
rows kept for cut-backs move with their positions, and the slot's checkpoints are dropped
(llama-server clears them: a state saved before the shift belongs to positions that no longer hold
the same tokens).
"""

from __future__ import annotations

from ..native.binding import llama_cpp

__all__ = ["supported", "shift", "UNSUPPORTED"]

UNSUPPORTED = ("context shift is not supported by this model's memory (llama_memory_can_shift is false: "
               "e.g. M-RoPE attention, as qwen35's), it will be disabled: a generation that fills its slot's "
               "context ends there (truncated), as llama-server does")


def _memories(engine):
    return [llama_cpp.llama_get_memory(c.ctx) for c in (engine.target, engine.draft) if c is not None]


def supported(engine) -> bool:
    """The target's memory (and the MTP draft context's) can shift positions."""
    return all(bool(llama_cpp.llama_memory_can_shift(m)) for m in _memories(engine))


def shift(engine, slot) -> int:
    """Shift the context of ``slot`` (generating, its context full) as llama-server does; the
    tokens removed."""
    r = slot.request
    n = slot.n
    n_keep = len(r.prompt) if r.n_keep < 0 else r.n_keep
    if llama_cpp.llama_vocab_get_add_bos(engine.vocab):
        n_keep += 1
    n_keep = max(0, min(slot.n_ctx - 4, n_keep))
    n_left = n - n_keep
    n_discard = r.n_discard if r.n_discard else n_left // 2
    # llama-server clamps to [0, n_left - 1]; at least one, or the slot stays full
    n_discard = min(max(n_discard, 1), max(0, n_left - 1))
    if n_discard <= 0:
        return 0
    for mem in _memories(engine):
        if not llama_cpp.llama_memory_seq_rm(mem, slot.seq_id, n_keep, n_keep + n_discard):
            raise RuntimeError(f"context shift: llama_memory_seq_rm failed for positions {n_keep} to "
                               f"{n_keep + n_discard} of sequence {slot.seq_id}")
        llama_cpp.llama_memory_seq_add(mem, slot.seq_id, n_keep + n_discard, n, -n_discard)
    slot.shifted(n_keep, n_discard)
    r.truncated = True
    r.shifted += n_discard
    return n_discard
