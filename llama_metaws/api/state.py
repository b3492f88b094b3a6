"""``Llama.save_state`` / ``load_state``: the binding's state, plus the MTP draft context's.

The binding's :class:`llama_cpp.LlamaState` holds the target context's whole state and its
single sequence (``input_ids``, ``n_tokens``: the engine's slot 0). A drafting ``Llama`` saves a
:class:`DraftingLlamaState`: that, plus the draft context's state and the target's hidden row the
next token pairs with. Both run on the engine's thread while no request runs
(:meth:`~llama_metaws.engine.core.Engine.exclusive`); loading replaces every sequence of the
contexts, so the other slots start afresh. (One slot written to a file and put back,
llama-server's slot actions, is :mod:`.engine.slot_files`, through ``Llama.save_slot`` and kin.)
"""

from __future__ import annotations

import ctypes
from typing import Optional

import numpy as np

from ..native.binding import llama_cpp

__all__ = ["DraftingLlamaState", "save", "check", "load"]


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


def save(llm, binding_save) -> llama_cpp.LlamaState:
    """``binding_save()`` (the binding's ``save_state``), with the draft context's state."""
    state = binding_save()
    if llm._draft_ctx is None:
        return state
    dctx = llm._draft_ctx.ctx
    size = int(llama_cpp.llama_state_get_size(dctx))
    buf = (ctypes.c_uint8 * size)()
    got = int(llama_cpp.llama_state_get_data(dctx, buf, size))
    if got == 0 or got > size:
        raise RuntimeError(f"llama_state_get_data on the draft context returned {got} of {size} bytes")
    slot = llm._engine.slots[0]
    row = None if slot.pending is None else np.asarray(slot.pending, dtype=np.float32).copy()
    return DraftingLlamaState(state, bytes(buf)[:got], slot.n, row)


def check(llm, state) -> None:
    """A drafting Llama takes only a state with the draft context's (a ValueError otherwise)."""
    if llm._draft_ctx is not None and not isinstance(state, DraftingLlamaState):
        raise ValueError("this state has no MTP draft context (saved by a Llama without draft='mtp'?): "
                         "save it with a drafting Llama's save_state(), or load it into one without drafting")


def load(llm, state) -> None:
    """Put ``state`` back: the target's whole state and slot 0's tokens (the binding's
    ``load_state``), and with drafting the draft context's; the other slots are emptied."""
    engine = llm._engine
    n = int(state.n_tokens)
    rows = min(n, llm.scores.shape[0], len(state.scores))
    llm.scores[:rows, :] = state.scores[:rows]
    rest = llm.scores[rows:, :]
    rest[rest > 0] = 0.0
    llm._seed = state.seed
    llm._requires_eval = True
    buf = (ctypes.c_uint8 * state.llama_state_size).from_buffer_copy(state.llama_state)
    slot = engine.slots[0]
    if llama_cpp.llama_state_set_data(llm._ctx.ctx, buf, state.llama_state_size) != state.llama_state_size:
        for s in engine.slots:
            engine.clear_sequence(s)
        raise RuntimeError("Failed to set llama state data")
    ids = np.asarray(state.input_ids, dtype=np.intc)
    m = min(len(ids), len(slot.tokens))
    slot.tokens[:m] = ids[:m]
    for other in engine.slots[1:]:
        other.forget()  # their sequences came back as they were saved: nothing known of them
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm._ctx.ctx), other.seq_id, -1, -1)
    slot.rows.clear()
    slot.checkpoints.clear()
    if llm._draft_ctx is None:
        slot.keep(n, None)
        return
    blob = state.draft_state
    dbuf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
    if int(llama_cpp.llama_state_set_data(llm._draft_ctx.ctx, dbuf, len(blob))) != len(blob):
        engine.clear_sequence(slot)
        raise RuntimeError("failed to set the draft context's state: the model starts afresh")
    for other in engine.slots[1:]:
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(llm._draft_ctx.ctx), other.seq_id, -1, -1)
    if state.draft_fed < n:  # the draft context holds fewer positions: the target goes back with it
        engine.seq_rm(0, state.draft_fed)
        n = state.draft_fed
    slot.keep(n, state.draft_row)

