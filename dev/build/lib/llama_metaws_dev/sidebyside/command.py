"""``python -m llama_metaws_dev.sidebyside``: the real-shape step's flags and its run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

from .report import format_text
from .shapes import SHAPES
from .step import ROWS, Settings, run_step


def parser() -> argparse.ArgumentParser:
    d = Settings(work=Path("."), out=Path("."), devices=[], shape=SHAPES["small"])
    p = argparse.ArgumentParser(
        prog="python -m llama_metaws_dev.sidebyside",
        description="The GPU run kit's real-shape step: a qwen35 MTP model at a real width and vocabulary, "
        "written into --work, then each configuration in its own process (ours: alias and private meta "
        "buffers under tensor split, no drafting, layer split; llama-server: draft-mtp and no drafting) "
        "at the same synthetic acceptance, within --budget seconds. Exit 0 when every row ran ok.")
    p.add_argument("--work", type=Path, required=True, help="the kit's work folder (the model is kept in WORK/models)")
    p.add_argument("--out", type=Path, required=True, help="the record file (JSON), rewritten after every row")
    p.add_argument("-dev", "--device", required=True, help="comma-separated devices of the split (CUDA0,CUDA0: "
                   "one GPU listed twice)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.6-27b",
                   help="the model's width, FFN and vocabulary (default qwen3.6-27b; small: the CPU dry run's)")
    p.add_argument("--layers", type=int, default=None,
                   help="trunk layers, a multiple of 4 (default: as many as the budget and the memory allow)")
    p.add_argument("--dtype", choices=("q8_0", "f16"), default=d.dtype)
    p.add_argument("--acceptance", type=float, default=d.acceptance,
                   help=f"the synthetic draft acceptance (default {d.acceptance}, what the upstream pull request "
                   "this project is built from measured; docs/gpu-kit.md): "
                   "--spec-synth-len 1 + acceptance x draft-max on both servers")
    p.add_argument("--draft-max", type=int, default=d.draft_max)
    p.add_argument("-n", "--n-predict", type=int, default=d.n_predict)
    p.add_argument("--requests", type=int, default=d.requests, help="measured requests per row")
    p.add_argument("--warmup", type=int, default=d.warmup, help="requests per row run first, not measured")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    p.add_argument("-c", "--ctx-size", type=int, default=d.n_ctx)
    p.add_argument("-ub", "--ubatch-size", type=int, default=d.n_ubatch)
    p.add_argument("-np", "--parallel", type=int, default=d.n_parallel)
    p.add_argument("--budget", type=float, default=d.budget_s, help="seconds the step may take; rows that "
                   "would start past it are cut (reported, the earlier rows kept)")
    p.add_argument("--nvidia", action="store_true", help="sample NVIDIA GPUs with pynvml (the nvidia extra)")
    p.add_argument("--server", type=Path, help="llama-server (default: the one llama-metaws build --tools made)")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--row", action="append", choices=[r.name for r in ROWS], metavar="NAME",
                   help="run only this row (repeatable): " + ", ".join(repr(r.name) for r in ROWS))
    p.add_argument("--json", action="store_true", help="print the record document instead of the table")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    if args.layers is not None and (args.layers < 4 or args.layers % 4):
        print("sidebyside: --layers must be a positive multiple of 4", file=sys.stderr)
        return 2
    if not 0.0 <= args.acceptance <= 1.0:
        print("sidebyside: --acceptance must be within [0, 1]", file=sys.stderr)
        return 2
    for name, value in (("--draft-max", args.draft_max), ("-n", args.n_predict), ("--requests", args.requests),
                        ("--prompt-tokens", args.prompt_tokens), ("-c", args.ctx_size), ("-ub", args.ubatch_size),
                        ("-np", args.parallel)):
        if value < 1:
            print(f"sidebyside: {name} must be >= 1", file=sys.stderr)
            return 2
    devices = [d.strip() for d in args.device.split(",") if d.strip()]
    settings = Settings(work=args.work, out=args.out, devices=devices, shape=SHAPES[args.shape], n_layer=args.layers,
                        dtype=args.dtype, acceptance=args.acceptance, draft_max=args.draft_max,
                        n_predict=args.n_predict, requests=args.requests, warmup=max(0, args.warmup),
                        prompt_tokens=args.prompt_tokens, n_ctx=args.ctx_size, n_ubatch=args.ubatch_size,
                        n_parallel=args.parallel, budget_s=args.budget, nvidia=args.nvidia, server=args.server,
                        threads=args.threads, rows=args.row)
    doc = run_step(settings)
    print(json.dumps(doc, indent=1) if args.json else format_text(doc))
    return 0 if doc.get("ok") else 1
