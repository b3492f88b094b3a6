"""``llama-metaws vram``: its flags and its run; ``python -m llama_metaws.tools.vram --child`` for one configuration."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import List, Optional

from .harness import (DEFAULT_CONFIGURATIONS, DEFAULT_DEVICES, DEFAULT_PROMPT, Configuration, as_expected,
                      child_main, find_configuration, run_configurations)
from .hostkv import format_host_kv, run_host_kv
from .report import format_table, plot
from .sampler import DEFAULT_INTERVAL
from .sources import MissingExtraError, import_pynvml


def _config_arg(text: str) -> Configuration:
    try:
        return find_configuration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``llama-metaws vram``'s flags (llama.cpp's names where it has them)."""
    p.add_argument("-m", "--model", help="GGUF model with NextN (MTP) layers (default: the tiny agreement "
                   "model, written into a temporary directory)")
    p.add_argument("-dev", "--device", default=",".join(DEFAULT_DEVICES),
                   help="comma-separated devices, as llama.cpp prints them (default CPU,CPU)")
    p.add_argument("-np", "--parallel", type=int, default=2, help="sequences, n_seq_max (default 2)")
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="context size (default 512)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=64, help="physical batch size (default 64)")
    p.add_argument("-b", "--batch-size", type=int, default=None,
                   help="logical batch size (default: enough for the prompt and the generated tokens)")
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help="prompt text")
    p.add_argument("-n", "--n-predict", type=int, default=32, help="tokens per request (default 32)")
    p.add_argument("--requests", type=int, default=2, help="requests per configuration (default 2)")
    p.add_argument("--draft-max", type=int, default=3)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL,
                   help="seconds between samples of the background thread (default 0.2)")
    p.add_argument("--config", action="append", type=_config_arg, metavar="NAME",
                   help="run only this configuration (repeatable; a slug such as alias-tensor works too): "
                   + ", ".join(repr(c.name) for c in DEFAULT_CONFIGURATIONS))
    p.add_argument("--json", action="store_true", help="print the records as JSON instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="plot memory over time per device (the plot extra)")
    p.add_argument("--nvidia", action="store_true", help="sample NVIDIA GPUs with pynvml as well (the nvidia extra)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per configuration (default 600)")
    p.add_argument("--host-kv", action="store_true",
                   help="host-resident KV instead: the KV caches in host memory (-nkvo) under tensor "
                   "split with draft-mtp and the alias workspace, three requests (short, near -c/-np, short "
                   "follow-up), bytes per buffer type of target KV, draft KV and recurrent state")
    return p


def _host_kv(args: argparse.Namespace, devices: List[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="llama-metaws-vram-model-") as tmp:
        model = args.model
        if model is None:
            from ...demo.model import make_tiny_mtp_model

            model = os.fspath(make_tiny_mtp_model(os.path.join(tmp, "tiny-mtp-agreement-0.8.gguf"), agreement=0.8))
        record = run_host_kv(model=model, devices=devices, prompt=args.prompt, n_ctx=args.ctx_size,
                             n_ubatch=args.ubatch_size, n_predict=args.n_predict, draft_max=args.draft_max,
                             n_seq_max=args.parallel, threads=args.threads, timeout=args.timeout)
    print(json.dumps(record, indent=1) if args.json else format_host_kv(record))
    return 0 if record["result"] == "ok" else 1


def run_from_args(args: argparse.Namespace) -> int:
    """Run the chosen configurations; 0 when each behaved as expected, 1 otherwise, 2 on bad input."""
    devices = [d.strip() for d in args.device.split(",") if d.strip()]
    for name, value, low in (("-np", args.parallel, 1), ("-c", args.ctx_size, 1), ("-ub", args.ubatch_size, 1),
                             ("-n", args.n_predict, 1), ("--requests", args.requests, 1)):
        if value < low:
            print(f"llama-metaws vram: {name} must be >= {low}", file=sys.stderr)
            return 2
    if not args.interval > 0:
        print("llama-metaws vram: --interval must be > 0", file=sys.stderr)
        return 2
    if args.model and not os.path.isfile(args.model):
        print(f"llama-metaws vram: no model file {args.model}", file=sys.stderr)
        return 2
    if args.nvidia:
        try:
            import_pynvml()
        except MissingExtraError as e:
            print(f"llama-metaws vram: {e}", file=sys.stderr)
            return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("llama-metaws vram: --plot needs matplotlib: install the plot extra "
                  "(pip install 'llama-metaws[plot]')", file=sys.stderr)
            return 2
    if args.host_kv:
        return _host_kv(args, devices)
    records = run_configurations(
        args.config, model=args.model, devices=devices, prompt=args.prompt, n_predict=args.n_predict,
        interval=args.interval, n_seq_max=args.parallel, n_ctx=args.ctx_size, n_ubatch=args.ubatch_size,
        n_batch=args.batch_size, draft_max=args.draft_max, requests=args.requests, nvidia=args.nvidia,
        threads=args.threads, timeout=args.timeout)
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        print(format_table(records))
    if args.plot:
        print(f"plot: {plot(records, args.plot)}", file=sys.stderr)
    return 0 if all(as_expected(r) for r in records) else 1


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        if len(argv) != 2:
            print("usage: python -m llama_metaws.tools.vram --child EVENTS_FILE  (a request as JSON on stdin)",
                  file=sys.stderr)
            return 2
        return child_main(argv[1])
    p = argparse.ArgumentParser(
        prog="llama-metaws vram",
        description="Run each configuration (no workspace, unsafe-shared, private-meta, alias under "
        "tensor split; alias under layer split) in its own process, sample memory per device, and "
        "print configuration, result, tokens/s, draft acceptance and peak per device.")
    add_arguments(p)
    return run_from_args(p.parse_args(argv))
