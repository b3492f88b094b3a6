"""Does llama.cpp take a tiny model? Loaded in a child process, so that an abort is a report.

The child loads each file with its NextN layers, creates a target context and (``draft``) an
MTP context (which builds the MTP graph: its asserts fire there), and decodes a prompt greedily
on the target, checking the logits are finite. The parent raises :class:`FamilyModelError` with
llama.cpp's own error lines when any of that fails.

Run as ``python -m llama_metaws.testing.families.check [--no-draft] FILE...``.
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
    cmd = [sys.executable, "-m", __name__, *([] if draft else ["--no-draft"]), *paths]
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

    from ...native.binding import _internals, llama_cpp, set_verbose
    from ...native.params import set_fields

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


def main(argv: List[str]) -> int:
    draft = "--no-draft" not in argv
    for path in (a for a in argv if a != "--no-draft"):
        _check(path, draft)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
