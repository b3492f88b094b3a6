"""What llama.cpp itself reserves for the same job, with llama-server's output limits.

The anchor our held compute is set beside (``make demo``, ``bench/bench_memory.py``, the tests of
:mod:`llama_metaws.engine.limits`): the target and MTP draft contexts llama-server would make,
created with llama.cpp's own ``llama_init_from_model`` on a loaded :class:`~llama_metaws.Llama`'s
model and with its context parameters, but for the fields llama-server sets itself. Those are
written out here as llama-server writes them (``server_output_limits`` and
``common_speculative_get_output_limits`` in the vendored ``tools/server/server-context.cpp`` and
``common/speculative.cpp``), on purpose apart from our own derivation
(:func:`llama_metaws.engine.contexts.context_fields`), so that the comparison can fail.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

__all__ = ["ServerLimits", "server_limits", "Reservation", "llama_server_reservation"]


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    target: Dict[str, int]   # llama_context_params fields of the target
    draft: Dict[str, int]    # ... of the MTP draft context


def server_limits(n_parallel: int, n_draft: int, n_batch: int) -> ServerLimits:
    """llama-server's output rows for ``-np n_parallel`` and drafts of up to ``n_draft`` tokens
    (0: no speculative decoding): the target ``min(n_batch, n_parallel x (1 + n_draft))``, per
    sequence ``min(n_batch, 1 + n_draft)``, both at least 1; the MTP context ``n_parallel``, one
    per sequence, no rollback snapshots."""
    per_seq = 1 + max(0, n_draft)
    target = dict(n_outputs_max=max(1, min(n_batch, n_parallel * per_seq)),
                  n_outputs_max_per_seq=max(1, min(n_batch, per_seq)), n_seq_max=n_parallel,
                  n_rs_seq=n_draft)
    draft = dict(n_outputs_max=n_parallel, n_outputs_max_per_seq=1, n_seq_max=n_parallel, n_rs_seq=0)
    return ServerLimits(target, draft)


@dataclasses.dataclass
class Reservation:
    """Compute bytes per buffer type name, of each context llama-server would make."""

    target: Dict[str, int]
    draft: Dict[str, int]

    @property
    def held(self) -> int:
        """What llama-server holds: both contexts' compute, each private."""
        return sum(self.target.values()) + sum(self.draft.values())


def _compute_by_type(ctx) -> Dict[str, int]:
    from ..engine.buffers import compute_buffers

    out: Dict[str, int] = {}
    seen = set()
    for b in compute_buffers(ctx):
        if b.buft not in seen:  # backends of one buffer type share one buffer
            seen.add(b.buft)
            out[b.buffer_type] = out.get(b.buffer_type, 0) + b.size
    return out


def llama_server_reservation(llm, *, n_draft: Optional[int] = None) -> Reservation:
    """The compute llama.cpp reserves for ``llm``'s job with llama-server's limits: a target (and,
    when ``llm`` drafts, an MTP draft) context made by ``llama_init_from_model`` on ``llm``'s model,
    with ``llm``'s context parameters but llama-server's own fields. ``n_draft``: the draft length
    llama-server is given (default: ``llm``'s ``draft_max``; 0 without drafting)."""
    from ..engine.contexts import draft_context_params
    from ..native.binding import llama_cpp
    from ..native.params import set_fields

    drafting = getattr(llm, "_draft_ctx", None) is not None
    if n_draft is None:
        n_draft = llm._draft_max if drafting else 0
    n_parallel = int(llama_cpp.llama_n_seq_max(llm._ctx.ctx))
    limits = server_limits(n_parallel, n_draft, int(llama_cpp.llama_n_batch(llm._ctx.ctx)))
    tp = type(llm.context_params).from_buffer_copy(llm.context_params)
    set_fields(tp, limits.target)
    made = []
    try:
        made.append(llama_cpp.llama_init_from_model(llm._model.model, tp))
        if not made[-1]:
            raise RuntimeError("llama.cpp could not create the target context with llama-server's limits")
        target = _compute_by_type(made[-1])
        draft: Dict[str, int] = {}
        if drafting:
            dp = draft_context_params(tp, dict(limits.draft, ctx_type=llama_cpp.LLAMA_CONTEXT_TYPE_MTP))
            made.append(llama_cpp.llama_init_from_model(llm._model.model, dp))
            if not made[-1]:
                raise RuntimeError("llama.cpp could not create the MTP context with llama-server's limits")
            draft = _compute_by_type(made[-1])
        return Reservation(target, draft)
    finally:
        for ctx in made:
            if ctx:
                llama_cpp.llama_free(ctx)


#: the demo's real-vocabulary model: Qwen's vocabulary on a small trunk (written in seconds)
REAL_VOCAB_SHAPE = dict(n_embd=256, n_layer=4, n_ff=512, agreement=0.8, dtype="q8_0")


@dataclasses.dataclass
class SideBySide:
    """Compute bytes held, ours against llama.cpp's own reservation for the same job."""

    n_vocab: int
    llama_cpp: Reservation            # llama-server's contexts: both private
    workspace_load: int               # ours with the shared workspace, after load
    workspace_request: int            # ... after one request (decode-sized)
    private: int                      # ours without the workspace

    def lines(self) -> list:
        mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
        ref = self.llama_cpp.held
        t, d = sum(self.llama_cpp.target.values()), sum(self.llama_cpp.draft.values())
        return [f"  llama.cpp with llama-server's output limits: target {mib(t)} + MTP draft {mib(d)} = {mib(ref)}",
                f"  llama-metaws, shared workspace (alias): {mib(self.workspace_load)} after load "
                f"({self.workspace_load / ref:.2f}x), {mib(self.workspace_request)} after a request "
                f"({self.workspace_request / ref:.2f}x)",
                f"  llama-metaws, no workspace: {mib(self.private)} ({self.private / ref:.2f}x)"]


def held_side_by_side(model_path: str, *, n_seq_max: int = 2, draft_max: int = 3, n_ctx: int = 4096,
                      n_ubatch: int = 512, prompt: str = "0 1 2 3", max_tokens: int = 8, **kw) -> SideBySide:
    """Our drafting ``Llama`` with and without the shared workspace, beside the contexts
    llama-server would make for the same ``-np n_seq_max -ub n_ubatch -c n_ctx --spec-type draft-mtp``
    with ``--spec-draft-n-max draft_max`` (:func:`llama_server_reservation`)."""
    from ..api.llama import Llama

    args = dict(draft="mtp", draft_max=draft_max, n_seq_max=n_seq_max, n_ctx=n_ctx, n_batch=n_ubatch,
                n_ubatch=n_ubatch, verbose=False, **kw)
    with Llama(model_path, phase_aware_workspace=True, **args) as llm:
        ref = llama_server_reservation(llm)
        n_vocab = llm.n_vocab()
        load = llm._workspace.allocated()
        llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0)
        after = llm._workspace.allocated()
    with Llama(model_path, phase_aware_workspace=False, **args) as llm:
        private = sum(_compute_by_type(llm._ctx).values()) + sum(_compute_by_type(llm._draft_ctx).values())
    return SideBySide(n_vocab, ref, load, after, private)
