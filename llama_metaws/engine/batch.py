"""``Batch``: a ``llama_batch`` over several sequences, whose arrays Python owns.

A step's target batch carries the prompt chunks of the slots that are starting and the
``[sampled, drafts...]`` of the slots that are generating, each slot's tokens together and in
order (llama.cpp's ubatch split and the MTP catch-up read them so). The draft context's batches
carry a hidden row (``embd``) next to each token (the pairing an MTP context takes).

The arrays are numpy's, and the ``llama_batch`` points into them: filling a segment is a few
slice assignments, never a Python loop over tokens, and ``llama_batch_free`` is never called
(nothing of it was allocated by llama.cpp).
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import numpy as np

from ..native.binding import llama_cpp
from ..native.params import set_fields

__all__ = ["Batch"]


def _ptr(a: np.ndarray, ctype):
    return a.ctypes.data_as(ctypes.POINTER(ctype))


class Batch:
    """Up to ``capacity`` tokens of any sequences; with ``n_embd``, a hidden row per token too."""

    def __init__(self, capacity: int, n_embd: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"a batch holds at least one token, not {capacity}")
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.seq = np.zeros(capacity, dtype=np.int32)       # one sequence per token
        self.logits = np.zeros(capacity, dtype=np.int8)     # 1: an output row
        self._n_seq_id = np.ones(capacity, dtype=np.int32)
        # seq_id[i] points at seq[i]: the whole column is one numpy array
        base = self.seq.ctypes.data
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)(
            *[ctypes.cast(base + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(capacity)])
        self.embd: Optional[np.ndarray] = np.zeros((capacity, n_embd), dtype=np.float32) if n_embd else None
        self.batch = llama_cpp.llama_batch()
        set_fields(self.batch, dict(
            n_tokens=0, token=_ptr(self.token, ctypes.c_int32), pos=_ptr(self.pos, ctypes.c_int32),
            n_seq_id=_ptr(self._n_seq_id, ctypes.c_int32),
            seq_id=ctypes.cast(self._seq_ptrs, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32))),
            logits=_ptr(self.logits, ctypes.c_int8),
            embd=_ptr(self.embd, ctypes.c_float) if self.embd is not None else None))
        self.n = 0

    def clear(self) -> None:
        self.n = 0
        self.batch.n_tokens = 0

    @property
    def room(self) -> int:
        return self.capacity - self.n

    def add(self, tokens: Sequence[int], pos0: int, seq_id: int, outputs, rows: Optional[np.ndarray] = None) -> int:
        """Append ``tokens`` of sequence ``seq_id`` at positions ``pos0..``; ``outputs``: True
        (every row), False (none), "last", or a sequence of flags; ``rows``: their hidden rows
        (a batch made with ``n_embd``). Returns the batch index of the first token."""
        n, i = len(tokens), self.n
        if n > self.capacity - i:
            raise ValueError(f"{n} tokens do not fit the {self.capacity - i} places left in the batch")
        j = i + n
        self.token[i:j] = tokens
        self.pos[i:j] = np.arange(pos0, pos0 + n, dtype=np.int32)
        self.seq[i:j] = seq_id
        if outputs == "last":
            self.logits[i:j] = 0
            self.logits[j - 1] = 1
        elif isinstance(outputs, bool):
            self.logits[i:j] = 1 if outputs else 0
        else:
            self.logits[i:j] = np.asarray(outputs, dtype=np.int8)
        if self.embd is not None:
            if rows is None or len(rows) != n:
                raise ValueError("a batch with hidden rows needs one row per token")
            self.embd[i:j] = rows
        self.n = j
        self.batch.n_tokens = j
        return i

    @property
    def n_outputs(self) -> int:
        return int(self.logits[: self.n].sum())
