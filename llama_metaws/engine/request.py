"""``Request``: one generation on the engine, and everything about it.

A front-end (``Llama.create_completion``, ``Llama.generate``, the server) makes a request with a
prompt of tokens and its sampling, hands it to :meth:`Engine.submit
<llama_metaws.engine.core.Engine.submit>` and reads :meth:`Request.outputs` on its own thread:
each item is what one engine step gave the request (its new tokens, and with them the logits rows
they were sampled from when asked for), the last one saying why it ended. Everything about a
request lives here (vLLM's request object, taken for its separation): its state on the engine,
its draft statistics and its timings. :meth:`Request.cancel` may be called from any thread; the
engine frees the request's slot at its next step.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np

from .samplers import SamplingParams

__all__ = ["DraftStats", "Output", "PromptProgress", "Request", "timings_of"]

_ids = itertools.count(1)
#: a throttled request's tokens generated ahead of its reader at most (one step's)
AHEAD = 1


@dataclasses.dataclass
class DraftStats:
    """Draft tokens proposed and accepted, verification steps (a step that drafted), and
    ``lengths``: the draft length each decode step asked for -> how many steps (0: a plain
    decode step; with ``draft_max="auto"`` the policy's choice); ``shadows``: the shadow drafts
    (``draft_max="auto"``'s scouts drafted on the side of a plain step, not verified: not in
    ``drafted``); ``restored``: the verifications whose rejected tokens a speculative checkpoint
    took back (a recurrent target without snapshots that reach: engine.rollback)."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    shadows: int = 0
    restored: int = 0
    lengths: Dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def acceptance(self) -> float:
        """``accepted / drafted``; 0.0 when nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def plain_steps_share(self) -> float:
        """The share of decode steps that drafted nothing; 0.0 before any."""
        steps = sum(self.lengths.values())
        return self.lengths.get(0, 0) / steps if steps else 0.0

    def add(self, other: "DraftStats") -> None:
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.steps += other.steps
        self.shadows += other.shadows
        self.restored += other.restored
        for k, v in other.lengths.items():
            self.lengths[k] = self.lengths.get(k, 0) + v

    def chose(self, length: int) -> None:
        """A decode step ran with a draft of ``length`` asked for."""
        self.lengths[length] = self.lengths.get(length, 0) + 1


@dataclasses.dataclass
class Output:
    """What one engine step gave a request."""

    tokens: List[int]
    rows: Optional[List[np.ndarray]] = None      # the logits row each token was sampled from
    prompt_rows: Optional[np.ndarray] = None     # the prompt's logits rows (echo with logprobs)
    finish: Optional[str] = None                 # "stop" | "length" | "cancelled" once it ended
    error: Optional[BaseException] = None


@dataclasses.dataclass(frozen=True)
class PromptProgress:
    """Where a request's prompt stands, as llama-server reports it (``prompt_progress``): a report
    once the request is on its slot (``processed == cache``: nothing evaluated yet) and one after
    each batch of its prompt, the last with ``processed == total``. ``prompt_n`` and
    ``prompt_ms``: the prompt tokens evaluated so far and the time since the slot took the
    request (0 before the first batch), the prompt figures of llama-server's ``timings``."""

    total: int       # the prompt's tokens
    cache: int       # kept from what the slot held
    processed: int   # held after this batch (cache included)
    time_ms: float   # since the slot took the request
    prompt_n: int
    prompt_ms: float


class Request:
    """One generation: ``prompt`` (token ids) continued with ``sampling``.

    ``max_tokens``: tokens to generate at most (None: until the sequence's context is full).
    ``stopping_criteria``: the binding's callables ``f(input_ids, logits) -> bool``, called with
    each sampled token's history and logits row; True ends the request before that token
    (finish ``"stop"``). ``logits_rows``: return each token's logits row (logprobs);
    ``prompt_rows``: also every prompt position's but the last (echo with logprobs; its last row is
    the first token's). ``draft``: let the engine draft for it (with a drafting engine).
    ``stop_at_eog``: an end-of-generation token ends it with ``"stop"`` and is not returned
    (False: it is returned like any other, as the binding's ``generate`` does). ``throttle``: the
    engine generates at most :data:`AHEAD` tokens more than the reader took (:meth:`consumed`),
    for a request with no ``max_tokens`` read one token at a time. ``cache_prompt``:
    llama-server's: reuse the prefix of the prompt the slot holds (False: evaluate all of it).
    ``stop``: strings (bytes) that end the request once its text holds one (finish ``"stop"``,
    the token that completed it returned); the front-end cuts the text there. ``slot``: run on
    that slot (llama-server's ``id_slot``), waiting while it is busy. ``on_progress``: called with a
    :class:`PromptProgress` on the engine's thread once the request is on a slot and after each
    batch of its prompt; it must return at once (hand the report to another thread), and one that
    raises is not called again. ``n_keep`` / ``n_discard``:
    llama-server's, for a context shift (an engine with ``context_shift``): the prompt tokens kept
    (-1: all of it; a BOS is kept besides) and the tokens dropped after them (0: half the rest).
    """

    def __init__(self, prompt: Sequence[int], sampling: Optional[SamplingParams] = None, *,
                 max_tokens: Optional[int] = None, stopping_criteria: Optional[Callable] = None,
                 logits_rows: bool = False, prompt_rows: bool = False, draft: bool = True,
                 stop_at_eog: bool = True, throttle: bool = False, cache_prompt: bool = True,
                 stop: Sequence[bytes] = (), slot: Optional[int] = None, n_keep: int = 0,
                 n_discard: int = 0, on_progress: Optional[Callable[[PromptProgress], None]] = None) -> None:
        self.id = next(_ids)
        self.prompt = [int(t) for t in prompt]
        if not self.prompt:
            raise ValueError("the prompt is empty: a request needs at least one token")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 0):
            raise ValueError(f"max_tokens must be an integer >= 0 or None, got {max_tokens!r}")
        self.sampling = sampling or SamplingParams()
        self.max_tokens = max_tokens
        self.stopping_criteria = stopping_criteria
        self.logits_rows = logits_rows
        self.prompt_rows = prompt_rows
        self.draft = draft
        self.stop_at_eog = stop_at_eog
        self.cache_prompt = cache_prompt    # reuse what the slot holds of the prompt
        self.stop = [s for s in stop if s]  # stop strings: the engine ends the request at one
        self.wanted_slot = slot             # run on this slot only (waiting for it); None: any
        self.n_keep, self.n_discard = int(n_keep), int(n_discard)  # a context shift's (llama-server's)
        self.text = b""                     # the generated tokens' pieces (only with stop strings)
        self.throttle = throttle            # run at most AHEAD tokens ahead of what was consumed
        self.n_consumed = 0
        self.on_consumed: Optional[Callable[[], None]] = None  # set by the engine: wakes it
        self.on_progress = on_progress
        # the engine's side (its thread only)
        self.generated: List[int] = []
        self.eog = False                    # it ended at an end-of-generation token (not returned)
        self.truncated = False              # its slot's context filled: shifted, or ended there
        self.shifted = 0                    # positions context shifts took out of its slot
        self.finish: Optional[str] = None
        self.error: Optional[BaseException] = None
        self.slot: Optional[int] = None
        self.stats = DraftStats()           # with the draft lengths its steps asked for
        self.cache_n = 0                    # prompt tokens kept from earlier requests
        self.prompt_n = 0                   # prompt tokens evaluated
        self.t_submit = time.perf_counter()
        self.t_start: Optional[float] = None    # on a slot, the prompt's evaluation begins
        self.t_encoded: Optional[float] = None  # the prompt but its held-back token decoded (drafting)
        self.t_first: Optional[float] = None
        self.t_end: Optional[float] = None
        # any thread
        self.cancelled: Optional[str] = None
        self._queue: "queue.SimpleQueue[Output]" = queue.SimpleQueue()
        self._done = threading.Event()

    # any thread ------------------------------------------------------------------------------

    def cancel(self, reason: str = "cancelled", wait: Optional[float] = None) -> None:
        """End the request at the engine's next step (a plain flag: callable from anywhere);
        ``wait``: until it ended (its slot is free), at most that many seconds."""
        if self.cancelled is None:
            self.cancelled = reason
        if wait is not None and not self._done.is_set():
            wake = self.on_consumed
            if wake is not None:
                wake()
            self._done.wait(wait)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def outputs(self, timeout: Optional[float] = None) -> Iterator[Output]:
        """The request's outputs as the engine makes them; the last has ``finish`` set. An error
        of the engine for this request is raised here."""
        while True:
            try:
                out = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id}: no output within {timeout} s") from None
            if out.error is not None:
                raise out.error
            yield out
            if out.finish is not None:
                return

    def consumed(self, n: int) -> None:
        """The reader took ``n`` more tokens (a throttled request runs ahead of it by :data:`AHEAD`)."""
        self.n_consumed += n
        wake = self.on_consumed
        if wake is not None:
            wake()

    @property
    def held_back(self) -> bool:
        """A throttled request far enough ahead of its reader: the engine waits for it."""
        return self.throttle and len(self.generated) - self.n_consumed >= AHEAD

    def wait(self, timeout: Optional[float] = None) -> List[int]:
        """Block until the request ends; its generated tokens."""
        for _ in self.outputs(timeout):
            pass
        return list(self.generated)

    # the engine's thread ----------------------------------------------------------------------

    def emit(self, out: Output) -> None:
        if out.finish is not None or out.error is not None:
            self.t_end = time.perf_counter()
            self._done.set()
        self._queue.put(out)

    def report_progress(self, processed: int) -> None:
        """Hand ``on_progress`` where the prompt stands: ``processed`` of its tokens held."""
        tell = self.on_progress
        if tell is None or self.t_start is None:
            return
        elapsed_ms = (time.perf_counter() - self.t_start) * 1e3
        try:
            tell(PromptProgress(total=len(self.prompt), cache=self.cache_n, processed=processed, time_ms=elapsed_ms,
                                prompt_n=self.prompt_n, prompt_ms=elapsed_ms if self.prompt_n else 0.0))
        except Exception:  # noqa: BLE001 - the front-end's listener failed, not the request
            self.on_progress = None

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.finish = "error"
        self.emit(Output([], error=error))

    @property
    def remaining(self) -> Optional[int]:
        """Tokens the request may still take (None: unbounded)."""
        return None if self.max_tokens is None else self.max_tokens - len(self.generated)

    def timings(self) -> dict:
        return timings_of(self)


def timings_of(r: Request) -> dict:
    """A request's figures (see :meth:`llama_metaws.Llama.timings`).

    Without drafting the prompt phase ends with the first token and the decode phase counts the
    tokens after it; with drafting (``t_encoded`` set) the phases are llama-speculative-simple's:
    the prompt but its held-back last token, then every step after it.
    """
    t0 = r.t_start if r.t_start is not None else r.t_submit
    t_end = r.t_end if r.t_end is not None else time.perf_counter()
    t_first = t_end if r.t_first is None else r.t_first
    predicted_n = len(r.generated) + int(r.eog)  # every token sampled, as llama-server counts them
    if r.t_encoded is None:
        n_prompt_phase, t_split, n_decode = r.prompt_n, t_first, max(predicted_n - 1, 0)
    else:
        n_prompt_phase, t_split, n_decode = max(r.prompt_n - 1, 0), r.t_encoded, predicted_n
    prompt_s, predicted_s = t_split - t0, t_end - t_split
    return {
        "prompt_tokens": len(r.prompt),
        "cache_n": r.cache_n,
        "prompt_n": r.prompt_n,
        "prompt_ms": prompt_s * 1e3,
        "prompt_tokens_per_s": n_prompt_phase / prompt_s if n_prompt_phase and prompt_s > 0 else 0.0,
        "ttft_ms": (t_first - t0) * 1e3,
        "queue_ms": (t0 - r.t_submit) * 1e3,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_s * 1e3,
        "decode_tokens": n_decode,
        "decode_tokens_per_s": n_decode / predicted_s if n_decode and predicted_s > 0 else 0.0,
        "draft_n": r.stats.drafted,
        "draft_n_accepted": r.stats.accepted,
        "draft_lengths": {int(k): int(v) for k, v in sorted(r.stats.lengths.items())},
        "plain_steps_share": r.stats.plain_steps_share,
        "shadow_drafts": r.stats.shadows,
    }

