"""A rejected draft taken back out of the target: a cut, the rollback snapshots, or a checkpoint.

A target without recurrent state cuts its KV cache anywhere (``llama_memory_seq_rm``). A recurrent
or hybrid one folds every token into its state, and cuts back only as far as its rollback
snapshots reach (``n_rs_seq`` positions into the last decode; patch 0011 makes ``seq_rm`` say so).
llama.cpp clamps ``n_rs_seq`` to 0 for the archs that have none (``llm_arch_supports_rs_rollback``
in ``src/llama-arch.cpp``: qwen3next among the MTP families, mamba, jamba, falcon-h1, ... for a
binding draft model). There, and for any draft longer than the snapshots reach, llama-server and
``llama-speculative-simple`` verify with *speculative checkpoints* ("speculative decoding will use
checkpoints"): the sequence's recurrent state is copied to host memory before the verification
batch; on a partial accept it is put back, the KV cut to its position, and the tokens kept are
decoded again (llama-server's *replay*).

So does the engine (:func:`save` before the step's target decode, :func:`roll_back` after the
verdicts). The state is the partial one that prompt reuse's checkpoints hold
(:func:`~.checkpoints.state_back`, :func:`~.checkpoints.write_state`, restored the way
:meth:`~.core.Engine.restore_target` restores those). The replay is the slot's next segment,
``[replayed..., last]``, with an output row at ``last`` only (:attr:`~.slots.Slot.replay`; what
the replayed tokens gave is already emitted), and, as llama-server's replay step, it verifies no
draft: a draft there would need a checkpoint taken before the replayed tokens, so a rejection in
it would replay them again, and a run of partial accepts would replay ever more. The draft context
(plain KV: llama.cpp gives MTP contexts no recurrent memory) is cut as usual. The counts are
llama-server's: the draft as drafted, and the tokens of it accepted.
"""

from __future__ import annotations

from typing import List

from .checkpoints import state_back
from .execute import DecodeError, Verdict
from .schedule import Segment

__all__ = ["checkpointed", "save", "roll_back"]


def checkpointed(engine, seg: Segment) -> bool:
    """The segment verifies a draft longer than the target's snapshots reach (recurrent state)."""
    return engine.recurrent and seg.kind == "decode" and seg.n - seg.replay - 1 > engine.n_rs_seq


def save(engine, segments: List[Segment]) -> None:
    """Before the step's target decode: the recurrent state of each slot whose draft needs a
    checkpoint (:func:`checkpointed`), kept on its segment (an empty sequence's is ``b""``)."""
    clock = engine.costs.clock
    t0, n = clock(), 0
    for seg in segments:
        if checkpointed(engine, seg):
            state = state_back(engine.target.ctx, 0, seg.slot.seq_id) if seg.pos0 > 0 else b""
            if state is None:
                raise DecodeError(f"no recurrent state to checkpoint on sequence {seg.slot.seq_id}")
            seg.checkpoint = state
            n += 1
    if n:
        engine.costs.save.add(n, clock() - t0)


def roll_back(engine, verdicts: List[Verdict]) -> None:
    """Remove the positions a verdict did not keep (rejected drafts) from both contexts: a cut
    (the snapshots' on a recurrent target), or the checkpoint put back, the draft context cut,
    and the tokens kept left to replay (``Verdict.replay``)."""
    clock = engine.costs.clock
    t0, n = clock(), 0
    for v in verdicts:
        seg = v.segment
        if seg.kind != "decode" or v.n >= seg.pos0 + seg.n:
            continue
        seq = seg.slot.seq_id
        if seg.checkpoint is None:
            if not engine.seq_rm(seq, v.n):
                raise DecodeError(f"llama_memory_seq_rm failed from position {v.n} on sequence {seq} "
                                  f"(a recurrent target's snapshots reach {engine.n_rs_seq} positions)")
            continue
        if not (engine.restore_target(seq, seg.checkpoint, seg.pos0) and engine.seq_rm_draft(seq, v.n)):
            raise DecodeError(f"the speculative checkpoint of sequence {seq} at position {seg.pos0} "
                              f"could not be restored")
        v.replay = v.n - seg.pos0
        n += 1
    if n:
        engine.costs.restore.add(n, clock() - t0)
