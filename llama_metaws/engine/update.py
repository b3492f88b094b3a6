"""A step's results are applied here: slots move on, requests get their tokens or end.

:func:`update` is the last of a step's three phases (after :mod:`.schedule` and :mod:`.execute`).
It changes Python state only: what each slot holds, its next token and draft, the request's
tokens, statistics and timings; it hands each request what the step gave it (a prompt's progress
first, to its listener) and frees the slots whose request ended (their sequences stay, for the
next request's prefix).
"""

from __future__ import annotations

import time
from typing import List

import numpy as np

from .execute import Verdict
from .request import Output
from .schedule import StepPlan
from .slots import SlotState

__all__ = ["update"]


def update(engine, plan: StepPlan, verdicts: List[Verdict]) -> None:
    now = time.perf_counter()
    for v in verdicts:
        seg = v.segment
        slot, r = seg.slot, seg.slot.request
        if r is None:  # failed or ended while the step ran
            continue
        if v.shadow:  # a scout drafted on the side (execute), judged as the next tokens come
            r.stats.shadows += 1
            engine.total.shadows += 1
        if seg.kind == "draft":  # drafted from a prompt held already: decoded with the draft next step
            slot.needs_draft = False
            slot.drafts, slot.asked = list(v.drafts), v.draft_len or 0
            r.report_progress(len(r.prompt))  # its held-back last token goes with this draft
            continue
        kept = v.n - seg.pos0  # the segment's tokens now held
        if kept > 0:
            slot.tokens[seg.pos0 : v.n] = seg.tokens[:kept]
        slot.keep(v.n, v.pending)
        if seg.kind == "decode":
            slot.replay = v.replay
            if v.replay:
                r.stats.restored += 1
                engine.total.restored += 1
        if v.recent:
            slot.recent = v.recent
        if seg.kind == "prompt":
            slot.cursor = seg.pos0 + seg.n
            r.prompt_n += seg.n
            if v.prompt_rows is not None:
                slot.prompt_rows.append(v.prompt_rows)
            if seg.ends_prompt and not v.tokens and v.finish is None:  # the last token is held back
                r.t_encoded = now
            # after each batch (the held-back last token counted: it is decoded with the first draft)
            r.report_progress(len(r.prompt) if seg.ends_prompt else slot.cursor)
        else:
            if r.t_first is None:  # the held-back prompt token is evaluated with the first draft
                r.prompt_n += 1
            if v.verdict_known and v.drafted:
                r.stats.drafted += v.drafted
                r.stats.accepted += v.accepted
                r.stats.steps += 1
                engine.total.drafted += v.drafted
                engine.total.accepted += v.accepted
                engine.total.steps += 1
        if seg.kind == "decode":  # the draft length this step ran with, as it was asked for
            r.stats.chose(slot.asked)
            engine.total.chose(slot.asked)
        if v.tokens:
            if r.t_first is None:
                r.t_first = now
            r.generated.extend(v.tokens)
        prompt_rows = None
        if slot.prompt_rows and (v.tokens or v.finish is not None):
            prompt_rows = np.concatenate(slot.prompt_rows)
            slot.prompt_rows = []
        if v.finish is not None:
            slot.prompt_rows = []
            engine.finish(slot, v.finish, v.tokens, v.rows, prompt_rows)
            continue
        if v.tokens:
            r.emit(Output(list(v.tokens), rows=v.rows, prompt_rows=prompt_rows))
        if v.last is not None:
            slot.state = SlotState.GENERATING
            slot.last, slot.drafts, slot.asked = v.last, list(v.drafts), v.draft_len or 0
