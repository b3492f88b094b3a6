"""``llama-metaws-dev``: the developers' commands, apart from the user's ``llama-metaws``.

* ``gpu-kit``: the GPU run kit, the folder a machine with an NVIDIA GPU and no network runs
  (:mod:`.gpukit`);
* ``repro``: the ``GGML_ASSERT(tensor)`` abort of a meta buffer shared by two contexts, and the
  borrower alias that fixes it, each case in its own process (:mod:`.repro`);
* ``series-check``: each patch of the series applied in turn, built, and ``test-alloc`` run after
  each (:mod:`.series`);
* ``build-tools``: llama.cpp's own tools (llama-server, llama-speculative-simple, llama-bench,
  llama-batched-bench) from the same patched tree, for the benches (:mod:`.tools_build`; the
  same as ``llama-metaws build --tools``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def _cmd_gpu_kit(args: argparse.Namespace) -> int:
    from . import gpukit

    return gpukit.run_from_args(args)


def _cmd_repro(args: argparse.Namespace) -> int:
    from .repro import LEVELS, MODES, as_expected, format_line, run_cases

    levels = [args.level] if args.level else list(LEVELS)
    modes = [args.mode] if args.mode else list(MODES)
    devices = [d.strip() for d in args.device.split(",") if d.strip()] if args.device else None
    records = run_cases(levels, modes, model_path=args.model, devices=devices,
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(records, indent=2))
    else:
        for r in records:
            print(format_line(r))
    return 0 if all(as_expected(r) for r in records) else 1


def _cmd_series_check(args: argparse.Namespace) -> int:
    from . import series

    return series.main(["--work", str(args.work)] if args.work else [])


def _cmd_build_tools(args: argparse.Namespace) -> int:
    from llama_metaws.cli import main as user_main

    return user_main(["build", "--tools"] + (["--force"] if args.force else []))


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llama-metaws-dev", allow_abbrev=False,
                                description="llama-metaws's developer commands (the user's are llama-metaws's; "
                                "docs/development.md).")
    sub = p.add_subparsers(dest="command", required=True)

    gk = sub.add_parser("gpu-kit", allow_abbrev=False,
                        help="prepare here the folder a machine with an NVIDIA GPU and no network runs",
                        description="Write the GPU run kit: the patched llama.cpp trimmed for a CPU+CUDA "
                        "build, CPython 3.12 manylinux wheels of every dependency and of llama-metaws (and "
                        "this developer package), the tiny models and run.sh (install offline, build for CUDA "
                        "sm_90, the CUDA subset of the suite, llama-metaws vram --nvidia; results under $OUT). "
                        "--dry-run then runs run.sh --cpu from the kit alone, with no network, into a fresh venv.")
    from .gpukit import add_arguments as _gpukit_arguments

    _gpukit_arguments(gk)
    gk.set_defaults(func=_cmd_gpu_kit)

    r = sub.add_parser("repro", help="reproduce GGML_ASSERT(tensor) of a shared meta buffer, and the fix",
                       description="Run each case in its own subprocess: the ggml level (a two-device "
                       "CPU meta backend, owner/borrower/owner in one shared buffer) and the llama level "
                       "(the tiny MTP model under tensor split over CPU,CPU, or --device, with the workspace and MTP "
                       "drafting), for the modes unsafe-shared (expected to abort with "
                       "GGML_ASSERT(tensor)), private-meta and alias (expected to pass). Exit status 0 "
                       "when every case behaved as expected.")
    r.add_argument("--level", choices=["ggml", "llama"], help="only this level")
    r.add_argument("--mode", choices=["unsafe-shared", "private-meta", "alias"], help="only this mode")
    r.add_argument("-m", "--model", help="GGUF model with nextn layers for the llama level (default: tiny)")
    r.add_argument("-dev", "--device", help="the llama level's tensor split, e.g. CUDA0,CUDA0 (default: "
                   "LLAMA_METAWS_TEST_DEVICES cycled to two, else CPU,CPU)")
    r.add_argument("--json", action="store_true",
                   help="print a JSON list of {level, mode, result, message} instead of lines")
    r.set_defaults(func=_cmd_repro)

    sc = sub.add_parser("series-check", help="each patch applied in turn, built, test-alloc after each",
                        description="Apply patches/series one patch at a time to the vendored llama.cpp, build "
                        "the libraries after each and run llama.cpp's test-alloc; last, ggml-base built with "
                        "ggml's defaults must export no allocation-failure injector.")
    sc.add_argument("--work", help="where the tree and the build directories live (default: build/series-check)")
    sc.set_defaults(func=_cmd_series_check)

    bt = sub.add_parser("build-tools", help="llama.cpp's tools from the same patched tree (for the benches)",
                        description="Build llama-server, llama-speculative-simple, llama-bench and "
                        "llama-batched-bench from the library's patched tree, cached under a key of their own "
                        "(paths in the manifest): llama-metaws build --tools.")
    bt.add_argument("--force", action="store_true", help="rebuild even when the tools are cached")
    bt.set_defaults(func=_cmd_build_tools)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = make_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
