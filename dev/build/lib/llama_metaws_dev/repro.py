"""Reproduce the GGML_ASSERT(tensor) crash of a shared meta compute buffer, and its fix.

Each case runs in its own subprocess (an abort is the expected outcome of some):

- ``ggml`` level, a two-device CPU meta backend: the owner computes; the borrower allocates and
  computes in the same shared buffer; the owner computes again on its reused graph.
- ``llama`` level, the tiny qwen35 MTP model under tensor split over two CPU devices (or the
  devices given: ``--device CUDA0,CUDA0``, else ``LLAMA_METAWS_TEST_DEVICES``) with the
  phase-aware workspace and MTP drafting: greedy generation, compared token by token with the
  same split without drafting.

``unsafe-shared`` must die with ``GGML_ASSERT(tensor)``; ``alias`` and ``private-meta`` must
pass. ``run_cases()`` returns one record per case; ``llama-metaws-dev repro`` prints them.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

from llama_metaws.tools.children import run_child

LEVELS = ("ggml", "llama")
MODES = ("unsafe-shared", "private-meta", "alias")
EXPECTED = {"unsafe-shared": "assert", "private-meta": "ok", "alias": "ok"}

PROMPT = [9, 4, 17, 33, 2, 61, 8, 100, 27, 5]
N_PREDICT = 16


def _case_ggml(mode: str) -> str:
    from llama_metaws.native.shim import check_error, ffi, lib

    sharing = {"alias": lib.GGML_GALLOCR_META_ALIAS, "private-meta": lib.GGML_GALLOCR_META_PRIVATE,
               "unsafe-shared": lib.GGML_GALLOCR_META_UNSAFE}[mode]
    gens = ffi.new("uint64_t[2]")
    check_error(lib.lmws_repro_meta_shared(sharing, 2, gens))
    return f"owner computed twice on one graph (generation {gens[0]} both times)"


def _case_llama(mode: str, model_path: str, devices: Sequence[str]) -> str:
    from llama_metaws.engine.contexts import greedy_tokens, load_model, new_context
    from llama_metaws.engine.core import Engine
    from llama_metaws.engine.workspace import Workspace

    draft_max = 3
    model = load_model(model_path, devices=list(devices), split_mode="tensor", load_mtp=True)
    try:
        plain = new_context(model, n_ctx=256, n_batch=64, n_rs_seq=1)
        reference = greedy_tokens(plain, PROMPT, N_PREDICT)
        plain.close()

        target = new_context(model, n_ctx=256, n_batch=64, n_rs_seq=draft_max)
        draft = new_context(model, n_ctx=256, n_batch=64, mtp=True)
        ws = Workspace(target, draft, mode=mode, n_decode_tokens=draft_max + 1,
                       allow_unsafe=mode == "unsafe-shared")
        with Engine(target, draft, draft_max=draft_max) as drafter:  # what Llama and serve run
            out = drafter.complete(PROMPT, N_PREDICT, stop_at_eog=False)
        if out != reference:
            raise AssertionError(f"drafted output {out} differs from no drafting {reference}")
        saved = sum(e.borrower_need for e in ws.stats() if e.shared)
        ws.close()
        draft.close()
        target.close()
        return (f"{N_PREDICT} tokens identical to no drafting, acceptance "
                f"{drafter.total.acceptance:.2f}, draft compute shared: {saved} B")
    finally:
        model.close()


def _child(level: str, mode: str, model_path: Optional[str], devices: Sequence[str]) -> int:
    """Run one case in this process; print its message; exit 0 on success."""
    import llama_metaws  # noqa: F401  (the patched build, before llama_cpp)

    try:
        if level == "ggml":
            message = _case_ggml(mode)
        else:
            message = _case_llama(mode, model_path, devices)
    except Exception as e:  # a clean failure: reported, not an abort
        print(f"FAILED: {type(e).__name__}: {e}", flush=True)
        return 1
    print(message, flush=True)
    return 0


def default_devices() -> List[str]:
    """The llama level's devices: ``LLAMA_METAWS_TEST_DEVICES`` cycled to two, else CPU,CPU."""
    from .testing import split_devices

    return split_devices(2)


def run_case(level: str, mode: str, *, model_path: Optional[str] = None, timeout: float = 300,
             devices: Optional[Sequence[str]] = None) -> Dict[str, str]:
    """One case in a subprocess: ``{level, mode, result ("ok" | "assert" | "error"), message}``.

    ``devices``: the llama level's tensor split (default :func:`default_devices`); the ggml
    level always builds its meta device over two CPU devices."""
    if level not in LEVELS or mode not in MODES:
        raise ValueError(f"unknown case {level}/{mode}: levels {LEVELS}, modes {MODES}")
    cmd = [sys.executable, "-m", "llama_metaws_dev.repro", "--child", level, mode,
           "--device", ",".join(devices or default_devices())]
    if model_path:
        cmd += ["--model", os.fspath(model_path)]
    result, message = run_child(cmd, timeout=timeout).verdict()
    return {"level": level, "mode": mode, "result": result, "message": message}


def run_cases(levels: Sequence[str] = LEVELS, modes: Sequence[str] = MODES,
              model_path: Optional[str] = None, progress=None,
              devices: Optional[Sequence[str]] = None) -> List[Dict[str, str]]:
    """Every (level, mode) case, each in its own subprocess."""
    with tempfile.TemporaryDirectory() as tmp:
        if "llama" in levels and model_path is None:
            from llama_metaws.demo.model import make_tiny_mtp_model

            model_path = os.fspath(make_tiny_mtp_model(os.path.join(tmp, "tiny-mtp.gguf"), agreement=0.8))
        records = []
        for level in levels:
            for mode in modes:
                if progress:
                    progress(f"running {level}/{mode} ...")
                records.append(run_case(level, mode, model_path=model_path, devices=devices))
        return records


def as_expected(record: Dict[str, str]) -> bool:
    return record["result"] == EXPECTED[record["mode"]]


def _main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m llama_metaws_dev.repro")
    p.add_argument("--child", nargs=2, metavar=("LEVEL", "MODE"), required=True)
    p.add_argument("--model")
    p.add_argument("--device", default="CPU,CPU")
    args = p.parse_args(argv)
    return _child(args.child[0], args.child[1], args.model, [d for d in args.device.split(",") if d])


def format_line(r: Dict[str, str]) -> str:
    mark = "as expected" if as_expected(r) else f"UNEXPECTED (expected {EXPECTED[r['mode']]})"
    return f"{r['level']:<6} {r['mode']:<14} {r['result']:<7} {mark}: {r['message']}"


if __name__ == "__main__":
    raise SystemExit(_main())
