"""``Slot``: one sequence of the contexts, and the request it serves.

A slot is llama-server's: sequence ``seq_id`` of the target and of the MTP draft context, the
tokens those hold (``tokens[:n]``, kept after a request ends so that the next one can reuse its
prefix), and while it serves a request, that request's sampler, its place in the prompt, the
token sampled but not yet decoded (``last``) and the draft proposed after it. A slot is a small
state machine:

- ``IDLE``: no request; the sequence keeps what the last request left;
- ``PROMPT``: the prompt is evaluated chunk by chunk from ``cursor`` (without drafting its last
  token is evaluated with an output row and sampled; with drafting it is held back as ``last``,
  as llama.cpp's draft-mtp does);
- ``GENERATING``: each step decodes ``[last, drafts...]`` and samples every row of it (after a
  restored speculative checkpoint, :mod:`.rollback`, behind the tokens it replays).

The draft context holds the same positions as the target (``n``), fed with the target's hidden
rows; ``pending`` is the target's row of position ``n - 1``, which the next token fed to the draft
context pairs with (None: a zero row, which makes drafts worse, never outputs different). After
plain decode steps it may lag behind by a few tokens (``lag``: each with the row it pairs with),
fed in one batch before the slot's next draft, at the end of its request, or once it holds
:data:`~.execute.LAG_MAX`.
"""

from __future__ import annotations

import enum
from typing import Dict, List, Optional

import numpy as np

from .checkpoints import CheckpointStore
from .request import Request
from .samplers import SlotSampler

__all__ = ["Slot", "SlotState"]


class SlotState(enum.Enum):
    IDLE = "idle"
    PROMPT = "processing prompt"
    GENERATING = "generating"


class Slot:
    """Sequence ``seq_id`` of both contexts, ``n_ctx`` positions at most."""

    def __init__(self, seq_id: int, n_ctx: int, n_embd: int, checkpoints: CheckpointStore) -> None:
        self.seq_id = seq_id
        self.n_ctx = n_ctx
        self.n_embd = n_embd
        self.tokens = np.zeros(n_ctx, dtype=np.intc)   # the tokens at positions 0 .. n-1
        self.n = 0                                      # positions the target (and draft) hold
        self.pending: Optional[np.ndarray] = None       # the target's row of position n - 1
        self.rows: Dict[int, np.ndarray] = {}           # position -> the target's row (checkpoint rows)
        self.recent: Dict[int, np.ndarray] = {}         # position -> row, of the last step's positions
        self.checkpoints = checkpoints
        self.state = SlotState.IDLE
        self.request: Optional[Request] = None
        self.sampler: Optional[SlotSampler] = None
        self.cursor = 0                  # PROMPT: the next prompt position to evaluate
        self.prompt_end = 0              # PROMPT: evaluate up to here (len(prompt) or one less)
        self.stops: Dict[int, List[int]] = {}  # PROMPT: chunk ends -> checkpoints to take there
        self.tail: Optional[int] = None  # PROMPT: the tail checkpoint's position, read back at the end
        self.replay = 0                  # the last positions of n the target gave back (a restored
        #                                  speculative checkpoint): decoded again before last
        self.chunk_checkpoints = False   # PROMPT: a checkpoint at every chunk's end (-cms 0)
        self.last: Optional[int] = None  # GENERATING: the token at position n, not yet decoded
        self.drafts: List[int] = []      # GENERATING: proposed for positions n + 1 ..
        self.asked = 0                   # GENERATING: the draft length asked for them
        self.needs_draft = False         # GENERATING: no draft yet (a prompt held already): draft first
        self.length = None               # the request's adaptive draft length (draft_max="auto")
        self.synth_rng = None            # synthetic acceptance: the request's random generator
        self.prompt_rows: List[np.ndarray] = []  # echo with logprobs: the prompt's rows so far
        self.step_tokens: List[int] = []  # sampled earlier in the step being run
        self.lag: List[tuple] = []       # (token, pos, row): decoded on the target, not yet on the draft context
        self.last_used = 0               # when it last ended a request (the engine's step count)

    @property
    def busy(self) -> bool:
        return self.state is not SlotState.IDLE

    def held(self) -> np.ndarray:
        return self.tokens[: self.n]

    def history(self) -> np.ndarray:
        """The tokens before the one being sampled: the prompt and what was generated so far."""
        r = self.request
        if r is None:
            return self.held().copy()
        return np.asarray(r.prompt + r.generated + self.step_tokens, dtype=np.intc)

    def row(self, pos: int) -> Optional[np.ndarray]:
        """The target's hidden row of ``pos`` where it is known (a checkpoint's, the last step's)."""
        got = self.recent.get(pos)
        return got if got is not None else self.rows.get(pos)

    def keep(self, n: int, row: Optional[np.ndarray]) -> None:
        """The sequence now holds its first ``n`` positions; ``row`` is position ``n - 1``'s."""
        self.n = n
        self.pending = row
        self.rows = {p: r for p, r in self.rows.items() if p < n}
        self.recent = {p: r for p, r in self.recent.items() if p < n}

    def shifted(self, n_keep: int, n_discard: int) -> None:
        """A context shift took positions ``n_keep .. n_keep + n_discard - 1`` out of both contexts
        and moved the later ones back: the tokens and rows follow, the checkpoints go."""
        n, cut = self.n, n_keep + n_discard
        self.tokens[n_keep : n - n_discard] = self.tokens[cut:n].copy()

        def moved(rows: Dict[int, np.ndarray]) -> Dict[int, np.ndarray]:
            return {p if p < n_keep else p - n_discard: r for p, r in rows.items() if p < n_keep or p >= cut}

        self.rows, self.recent = moved(self.rows), moved(self.recent)
        self.n = n - n_discard
        self.checkpoints.clear()

    def take_lag(self):
        """The tokens the draft context lags behind by, as ``(tokens, pos0, rows)`` (None: none),
        for the caller to feed now; the lag is empty after."""
        if not self.lag:
            return None
        lag, self.lag = self.lag, []
        return [t for t, _, _ in lag], lag[0][1], np.stack([r for _, _, r in lag])

    def forget(self) -> None:
        """Nothing held (the caller removed the sequence from both contexts)."""
        self.lag = []
        self.replay = 0
        self.keep(0, None)
        self.rows.clear()
        self.recent.clear()
        self.checkpoints.clear()

    def release(self) -> Optional[Request]:
        """The request is done: back to IDLE, keeping what the sequence holds."""
        r, self.request = self.request, None
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None
        self.state = SlotState.IDLE
        self.last, self.drafts, self.asked, self.length, self.synth_rng = None, [], 0, None, None
        self.needs_draft = False
        self.stops, self.tail, self.prompt_rows, self.chunk_checkpoints = {}, None, [], False
        return r

    def describe(self) -> dict:
        """What ``GET /slots`` shows of the slot."""
        r = self.request
        return {"id": self.seq_id, "state": self.state.value, "is_processing": self.busy,
                "n_ctx": self.n_ctx, "n_past": self.n, "id_task": r.id if r is not None else -1,
                "n_prompt_tokens": len(r.prompt) if r is not None else 0,
                "n_decoded": len(r.generated) if r is not None else 0}
