"""What the contexts are sized for: the longest draft, and the output rows each context reserves.

llama.cpp sizes a context's worst-case graph and its host output buffer for ``n_outputs_max``
rows of logits (``llama_context_params.n_outputs_max``; 0 = ``n_batch``: every row of a ubatch,
``n_ubatch x n_vocab x 4`` bytes). A server never reads that many. llama-server sets, for
``n_parallel`` sequences drafting up to ``n_draft`` tokens (``server_output_limits`` and
``common_speculative_get_output_limits`` in the vendored tree):

- the target: ``n_parallel x (1 + n_draft)`` rows, ``1 + n_draft`` per sequence (each
  sequence's sampled token and its draft are verified in one batch); without drafting
  ``n_parallel`` rows, one per sequence;
- the MTP draft context: ``n_parallel`` rows, one per sequence (each draft step reads one row);

both at least 1 and at most ``n_batch``. :func:`output_limits` derives the same figures for a
:class:`~llama_metaws.Llama`, the planner and the vram harness; with ``logits_all`` the target
keeps every row (0), as the binding does. A batch that asks for more rows than its context's
limit is refused by llama.cpp (patch 0025: ``llama_decode`` returns -1, no abort).

Pure Python (no native import), so the command line can read it before anything loads.
"""

from __future__ import annotations

import dataclasses

#: draft_max="auto": the longest draft the adaptive length may reach (the contexts are sized for it)
AUTO_DRAFT_MAX = 6


@dataclasses.dataclass(frozen=True)
class OutputLimit:
    """One context's ``n_outputs_max`` and ``n_outputs_max_per_seq`` (0: llama.cpp's default,
    ``n_batch``)."""

    total: int
    per_seq: int

    def fields(self) -> dict:
        """The ``llama_context_params`` fields."""
        return {"n_outputs_max": self.total, "n_outputs_max_per_seq": self.per_seq}

    def rows(self, n_batch: int) -> int:
        """The rows a batch may ask for at most."""
        return n_batch if self.total == 0 else min(self.total, n_batch)


@dataclasses.dataclass(frozen=True)
class OutputLimits:
    target: OutputLimit
    draft: OutputLimit   # the MTP draft context's (unused without drafting)


def output_limits(n_seq_max: int, draft_max: int, n_batch: int, *, logits_all: bool = False) -> OutputLimits:
    """llama-server's output rows for ``n_seq_max`` sequences drafting up to ``draft_max`` tokens
    each (0: no drafting); ``logits_all``: the target keeps every row (``n_outputs_max`` 0)."""
    for name, value, low in (("n_seq_max", n_seq_max, 1), ("draft_max", draft_max, 0), ("n_batch", n_batch, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    per_seq = min(n_batch, 1 + draft_max)
    target = OutputLimit(0, 0) if logits_all else OutputLimit(max(1, min(n_batch, n_seq_max * per_seq)),
                                                              max(1, per_seq))
    draft = OutputLimit(max(1, min(n_batch, n_seq_max)), 1)
    return OutputLimits(target, draft)


__all__ = ["AUTO_DRAFT_MAX", "OutputLimit", "OutputLimits", "output_limits", "check_draft_max"]


def check_draft_max(draft_max, n_batch: int, *, n_rs_seq=None, n_ubatch: int = 0, fit: str = "n_batch") -> None:
    """Raise ValueError unless a draft of ``draft_max`` tokens can be verified: an integer >= 1
    whose verification batch (``draft_max + 1`` tokens) fits ``n_batch`` (the least of the sizes
    named by ``fit``). A target with recurrent state (``n_rs_seq``, else None) rolls a draft its
    snapshots reach (``n_rs_seq`` tokens) back through them, and must then verify it in one ubatch
    (``n_ubatch``); a longer draft is verified with a speculative checkpoint (llama.cpp's, where an
    arch has no snapshots and ``n_rs_seq`` is clamped to 0: engine.rollback)."""
    if isinstance(draft_max, bool) or not isinstance(draft_max, int) or draft_max < 1:
        raise ValueError(f"draft_max must be an integer >= 1, got {draft_max!r}")
    if draft_max + 1 > n_batch:
        raise ValueError(f"draft_max={draft_max}: a verification batch of {draft_max + 1} tokens must fit {fit}")
    reach = min(n_rs_seq or 0, draft_max)
    if reach and reach + 1 > n_ubatch:
        raise ValueError(f"draft_max={draft_max}: a verification batch of {reach + 1} tokens that the target's "
                         f"rollback snapshots undo (n_rs_seq {n_rs_seq}) must fit one target ubatch "
                         f"(n_ubatch {n_ubatch})")
