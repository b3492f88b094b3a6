"""A step is decided here: what each slot contributes to the target's batch.

:func:`schedule` is the first of a step's three phases (then :mod:`.execute`, then :mod:`.update`),
as in vLLM; it decides and runs no decode. It ends the requests that were cancelled, shifts the
context of a generating slot that filled it (with context shift, :mod:`.shift`), puts waiting
requests on idle slots (the slot whose held tokens share the longest prefix with the prompt, where
the prompt is reused from), and gives every busy slot its segment of the batch, as llama-server's
``update_slots`` builds its one batch per iteration:

- a generating slot: ``[last, drafts...]``, every row sampled (after a restored speculative
  checkpoint, :mod:`.rollback`: ``[replayed..., last]``, the last row sampled);
- a slot in its prompt: the next chunk, no output rows but the prompt's last (sampled at once
  without drafting; with drafting the last token is held back and decoded with the first draft),
  every row with ``prompt_rows`` (echo with logprobs), chunks ending where a checkpoint is taken.

Generating slots come first (their tokens are few and latency-bound), prompt chunks fill what is
left of ``n_batch`` tokens and of the target's output rows (``n_outputs_max``).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

from .checkpoints import common_prefix
from .request import Request
from .slots import Slot, SlotState

__all__ = ["Segment", "StepPlan", "schedule", "choose_slot", "n_graphs", "ubatch_sizes"]


@dataclasses.dataclass
class Segment:
    """One slot's tokens in the step's target batch."""

    slot: Slot
    kind: str                 # "prompt" | "decode"
    tokens: List[int]
    pos0: int
    outputs: object           # False | True | "last" | a flag per token
    ends_prompt: bool = False
    backs: List[int] = dataclasses.field(default_factory=list)  # checkpoints to take after it
    i0: int = 0               # its first index in the batch (set by execute)
    replay: int = 0           # decode: tokens decoded again before last (a restored checkpoint's)
    checkpoint: Optional[bytes] = None  # decode: the state before it, where a rejection restores it

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def n_outputs(self) -> int:
        if isinstance(self.outputs, list):
            return sum(self.outputs)
        return self.n if self.outputs is True else (1 if self.outputs == "last" else 0)


@dataclasses.dataclass
class StepPlan:
    segments: List[Segment]
    admitted: List[Slot]
    draft_only: List[Slot] = dataclasses.field(default_factory=list)  # only draft, from a held prompt
    graphs: int = 0  # the target's graphs for the segments (execute counts them: Engine.graphs)

    @property
    def empty(self) -> bool:
        return not self.segments and not self.draft_only


def choose_slot(slots: Sequence[Slot], prompt: Sequence[int]) -> Optional[Slot]:
    """The idle slot to serve ``prompt`` (None when none is idle): the one holding the longest
    prefix of it (llama-server's prompt similarity); among equals an empty slot, else the one
    used least recently, so that what the others hold stays for their next turn."""
    best, best_key = None, None
    for s in slots:
        if s.busy:
            continue
        key = (common_prefix(s.held(), prompt) if s.n else 0, s.n == 0, -s.last_used)
        if best_key is None or key > best_key:
            best, best_key = s, key
    return best


def schedule(engine) -> StepPlan:
    """Decide the next step (see the module docstring)."""
    for slot in engine.slots:
        if slot.busy and slot.request.cancelled is not None:
            engine.finish(slot, "cancelled")
    # other threads queue requests while this runs: read a copy, take off what leaves, in order
    waiting, exclusive_pending = engine.queued()
    cancelled = [r for r in waiting if r.cancelled is not None]
    taken: List[Request] = []
    admitted = []
    for r in ([] if exclusive_pending else waiting):
        if r.cancelled is not None:
            continue
        if r.wanted_slot is not None:  # llama-server's id_slot: that slot, once it is free
            wanted = engine.slots[r.wanted_slot] if r.wanted_slot < len(engine.slots) else None
            slot = wanted if wanted is not None and not wanted.busy else None
        else:
            slot = choose_slot(engine.slots, r.prompt)
        if slot is None:
            break
        taken.append(r)
        if engine.admit(slot, r):
            admitted.append(slot)
    engine.dequeue(cancelled + taken)
    for r in cancelled:
        engine.drop(r)

    for slot in engine.slots:  # llama-server's pre_decode: a full context shifts (--context-shift)
        if engine.context_shift and slot.state is SlotState.GENERATING and slot.n + 1 >= slot.n_ctx:
            engine.shift_context(slot)
    n_batch, n_out = engine.n_batch, engine.n_outputs_max
    segments: List[Segment] = []
    draft_only = [s for s in engine.slots if s.state is SlotState.GENERATING and s.needs_draft]
    for slot in engine.slots:
        if slot.state is SlotState.GENERATING and not slot.needs_draft and not slot.request.held_back:
            toks = [slot.last] + list(slot.drafts)
            pos0, outputs = slot.n, True
            if slot.replay:
                pos0 = slot.n - slot.replay
                outputs = [False] * slot.replay + [True] * len(toks)
                toks = [int(t) for t in slot.tokens[pos0 : slot.n]] + toks
            seg = Segment(slot, "decode", toks, pos0, outputs, replay=slot.replay)
            segments.append(seg)
            n_batch -= seg.n
            n_out -= seg.n_outputs
    for slot in engine.slots:
        if slot.state is not SlotState.PROMPT or n_batch <= 0:
            continue
        seg = _prompt_chunk(slot, n_batch, n_out)
        if seg is not None:
            segments.append(seg)
            n_batch -= seg.n
            n_out -= seg.n_outputs
    segments.sort(key=lambda s: s.slot.seq_id)  # each sequence's tokens together, in order
    return StepPlan(segments, admitted, draft_only)


def _prompt_chunk(slot: Slot, room: int, outputs_room: int) -> Optional[Segment]:
    r = slot.request
    start, end = slot.cursor, slot.prompt_end
    every_row = r.prompt_rows
    if every_row:
        room = min(room, outputs_room)
    if room <= 0:
        return None
    stop = min([start + room, end] + [p for p in slot.stops if p > start])
    tail = slot.tail  # a checkpoint TAIL tokens before the prompt's end, read back from the snapshots
    if tail is not None and start < tail < stop < end:
        stop = tail  # a chunk ending between it and the end would leave it out of the last one
    ends = stop == end
    sampled_here = ends and end == len(r.prompt)  # no held-back token: the last row is sampled now
    if every_row:
        outputs = True
    elif sampled_here:
        if outputs_room < 1:
            return None
        outputs = "last"
    else:
        outputs = False
    backs = list(slot.stops.get(stop, []))
    if tail is not None:
        if stop == tail:
            backs.append(0)
        elif ends and start < tail:  # the state after position tail - 1 is in this chunk's snapshots
            backs.insert(0, end - tail)
    if slot.chunk_checkpoints and 0 not in backs:  # -cms 0: one at every chunk's end
        backs.append(0)
    return Segment(slot, "prompt", [int(t) for t in r.prompt[start:stop]], start, outputs, ends_prompt=ends,
                   backs=backs)


def n_graphs(segments: Sequence[Segment], n_ubatch: int, *, sequential: bool, keep_tail: int,
             split_equal: bool) -> int:
    """The graphs (ubatches) llama.cpp computes for a batch of these segments (:func:`ubatch_sizes`)."""
    return len(ubatch_sizes([(s.slot.seq_id, s.n) for s in segments], n_ubatch, sequential=sequential,
                            keep_tail=keep_tail, split_equal=split_equal))


def ubatch_sizes(counts: Sequence[Tuple[int, int]], n_ubatch: int, *, sequential: bool, keep_tail: int,
                 split_equal: bool) -> List[int]:
    """The tokens of each graph (ubatch) llama.cpp computes for a batch of ``counts``, ``(seq_id,
    tokens)`` in batch order, by its own split: ``split_equal`` (hybrid and recurrent memories; a
    KV cache with a stream per sequence) takes the same number of tokens of every sequence into a
    ubatch, sequences in increasing order when ``sequential`` (non-unified KV), and keeps each
    sequence's last ``keep_tail`` tokens in one ubatch; otherwise ``split_simple`` cuts the batch
    every ``n_ubatch`` tokens. So a recurrent target's step where one of two slots drafts a token
    is two graphs (2 tokens, then 1), where one where both do is one (4 tokens)."""
    counts = [(q, n) for q, n in counts if n]
    if not counts:
        return []
    if not split_equal:
        total = sum(n for _, n in counts)
        return [min(n_ubatch, total - i) for i in range(0, total, n_ubatch)]
    seqs = [q for q, _ in counts]
    left = dict(counts)
    sizes: List[int] = []
    while any(left.values()):
        group = []
        last = None
        for q in seqs:
            if not left[q]:
                continue
            if sequential and group and q != last + 1:
                continue
            group.append(q)
            last = q
        take = 0
        while all(left[q] > take for q in group) and (take + 1) * len(group) <= n_ubatch:
            take += 1
        take = max(take, 1)
        if keep_tail:
            keep = []
            for q in group:
                rem = left[q] - take
                if rem != 0 and rem < keep_tail:
                    break
                keep.append(q)
            if not keep:
                q = group[0]
                if take + (left[q] - take) <= n_ubatch:
                    take = left[q]
                else:
                    take = left[q] - keep_tail
                keep = [q]
            group = keep
        sizes.append(sum(min(take, left[q]) for q in group))
        for q in group:
            left[q] -= min(take, left[q])
    return sizes
