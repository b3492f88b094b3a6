"""Does llama.cpp take a tiny model? Loaded in a child process, so that an abort is a report.

The child loads each file with its NextN layers, creates a target context and (``draft``) an
MTP context (which builds the MTP graph: its asserts fire there), and decodes a prompt greedily
on the target, checking the logits are finite. The parent raises :class:`FamilyModelError` with
llama.cpp's own error lines when any of that fails.

:func:`check_draft_model` does the same for a draft model of its own file (an MTP head split from
its model, a Gemma 4 assistant): the child loads the target and the draft as llama-server loads
``-md FILE --spec-type draft-mtp`` (the draft an MTP context of its own model, ``ctx_other`` the
target's context), decodes a prompt on the target and one drafting step on the draft.

Run as ``python -m llama_metaws_dev.testing.families.check [--no-draft] FILE...`` or
``python -m llama_metaws_dev.testing.families.check --draft-for TARGET DRAFT``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterable, List

_OK = "family-check ok: "
# llama.cpp's lines that say why a load or a context failed
_WHY = ("error", "failed", "GGML_ASSERT", "missing", "wrong", "invalid", "not implemented",
        "Traceback", "Error:")


class FamilyModelError(RuntimeError):
    """llama.cpp refused a tiny model; the message holds its own words."""


def check_model(path, *, draft: bool = True, timeout: float = 120.0) -> None:
    check_models([path], draft=draft, timeout=timeout)


def check_models(paths: Iterable, *, draft: bool = True, timeout: float = 300.0) -> None:
    """Load every file in one child process (:func:`check_model` for one)."""
    paths = [os.fspath(p) for p in paths]
    _run([*([] if draft else ["--no-draft"]), *paths], paths, timeout)


def check_draft_model(target, draft, *, timeout: float = 120.0) -> None:
    """Load ``draft`` as the draft model of ``target`` in a child process (the module docstring);
    :class:`FamilyModelError` with llama.cpp's words when it refuses either."""
    target, draft = os.fspath(target), os.fspath(draft)
    _run(["--draft-for", target, draft], [draft], timeout)


def _run(argv: List[str], paths: List[str], timeout: float) -> None:
    cmd = [sys.executable, "-m", __name__, *argv]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    done = {line[len(_OK):] for line in res.stdout.splitlines() if line.startswith(_OK)}
    if res.returncode != 0 or done != set(paths):
        failed = next((p for p in paths if p not in done), paths[-1])
        lines = (res.stderr + res.stdout).splitlines()
        why = [ln for ln in lines if any(w in ln for w in _WHY)] or lines[-15:]
        raise FamilyModelError(f"llama.cpp refused {Path(failed).name} (exit {res.returncode}):\n"
                               + "\n".join(why[-20:]))


def _check(path: str, draft: bool) -> None:
    import numpy as np

    from llama_metaws.native.binding import _internals, llama_cpp, set_verbose
    from llama_metaws.native.params import set_fields

    set_verbose(True)
    mparams = llama_cpp.llama_model_default_params()
    set_fields(mparams, dict(load_mtp=True))
    model = _internals.LlamaModel(path_model=path, params=mparams, verbose=True)

    def context(**fields):
        cparams = llama_cpp.llama_context_default_params()
        set_fields(cparams, dict(n_ctx=128, n_batch=16, n_ubatch=16, **fields))
        return _internals.LlamaContext(model=model, params=cparams, verbose=True)

    if draft:  # building the MTP graph is where its asserts fire
        context(ctx_type=llama_cpp.LLAMA_CONTEXT_TYPE_MTP).close()
    ctx = context()
    n_vocab = llama_cpp.llama_vocab_n_tokens(model.vocab)
    batch = _internals.LlamaBatch(n_tokens=4, embd=0, n_seq_max=1)
    tokens = [1, 2, 3, 4]
    for step in range(3):  # the prompt, then two greedy tokens
        batch.set_batch(tokens if step == 0 else tokens[-1:], n_past=0 if step == 0 else len(tokens) - 1,
                        logits_all=False)
        rc = llama_cpp.llama_decode(ctx.ctx, batch.batch)
        if rc != 0:
            raise RuntimeError(f"{path}: llama_decode returned {rc}")
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx.ctx, -1), shape=(n_vocab,))
        if not np.isfinite(logits).all():
            raise RuntimeError(f"{path}: the target's logits are not finite")
        tokens.append(int(np.argmax(logits)))
    batch.close()
    ctx.close()
    model.close()
    print(f"tokens {tokens}")
    print(_OK + path, flush=True)


def _check_draft(target: str, draft: str) -> None:
    import numpy as np

    from llama_metaws.engine.batch import Batch
    from llama_metaws.native.binding import _internals, llama_cpp, llama_ext, set_verbose
    from llama_metaws.native.params import set_fields

    set_verbose(True)

    def model(path, load_mtp):
        mparams = llama_cpp.llama_model_default_params()
        set_fields(mparams, dict(load_mtp=load_mtp))
        return _internals.LlamaModel(path_model=path, params=mparams, verbose=True)

    def context(m, **fields):
        cparams = llama_cpp.llama_context_default_params()
        set_fields(cparams, dict(n_ctx=128, n_batch=16, n_ubatch=16, **fields))
        return _internals.LlamaContext(model=m, params=cparams, verbose=True)

    tmodel, dmodel = model(target, False), model(draft, True)
    tctx = context(tmodel)
    dctx = context(dmodel, ctx_type=llama_cpp.LLAMA_CONTEXT_TYPE_MTP, ctx_other=tctx.ctx)
    llama_ext.llama_set_embeddings_nextn(tctx.ctx, True, False)
    llama_ext.llama_set_embeddings_nextn(dctx.ctx, True, True)
    n_embd = int(llama_cpp.llama_model_n_embd_out(tmodel.model))
    n_vocab = llama_cpp.llama_vocab_n_tokens(tmodel.vocab)
    tokens = [1, 2, 3, 4]
    b = Batch(8)
    b.add(tokens, 0, 0, "last")
    if llama_cpp.llama_decode(tctx.ctx, b.batch) != 0:
        raise RuntimeError(f"{target}: llama_decode returned non-zero on the target")
    rows = np.ctypeslib.as_array(llama_ext.llama_get_embeddings_nextn(tctx.ctx), shape=(len(tokens), n_embd)).copy()
    last = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(tctx.ctx, -1), shape=(n_vocab,))))
    d = Batch(8, n_embd)
    # a head of its own memory is fed the prompt first (token p with the target's row p - 1); one
    # that reads the target's KV is not; then one drafting step from (last, the last row)
    if llama_ext.llama_get_ctx_other(dctx.ctx) != tctx.ctx:
        d.add(tokens, 0, 0, False, np.concatenate([np.zeros((1, n_embd), np.float32), rows[:-1]]))
    d.add([last], len(tokens), 0, True, rows[-1:])
    if llama_cpp.llama_decode(dctx.ctx, d.batch) != 0:
        raise RuntimeError(f"{draft}: llama_decode returned non-zero on the draft context")
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(dctx.ctx, -1), shape=(n_vocab,))
    if not np.isfinite(logits).all():
        raise RuntimeError(f"{draft}: the draft's logits are not finite")
    for obj in (dctx, tctx, dmodel, tmodel):
        obj.close()
    print(f"draft {int(np.argmax(logits))} after {tokens + [last]}")
    print(_OK + draft, flush=True)


def main(argv: List[str]) -> int:
    if argv[:1] == ["--draft-for"]:
        _check_draft(argv[1], argv[2])
        return 0
    draft = "--no-draft" not in argv
    for path in (a for a in argv if a != "--no-draft"):
        _check(path, draft)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
