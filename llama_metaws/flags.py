"""llama.cpp's command-line flags and what they mean for our ``Llama``: one table for every command.

``generate`` and ``serve`` (and any later command that loads a model) take the same flags with
llama.cpp's names, so its command lines map one to one; :func:`llama_kwargs` turns them into
:class:`llama_metaws.Llama` keyword arguments.
"""

from __future__ import annotations

import argparse
from typing import List

from .engine.limits import AUTO_DRAFT_MAX


def parse_floats(text: str) -> List[float]:
    """llama.cpp's -ts syntax: "0.55,0.45" (or "3/1")."""
    parts = [x for x in text.replace("/", ",").split(",") if x.strip()]
    try:
        return [float(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None



def draft_max_value(text: str):
    """--draft-max: a count of tokens, or "auto" (a length chosen per step, at most AUTO_DRAFT_MAX)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count of tokens or 'auto': {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {n}")
    return n


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """llama.cpp's own flags, so its command lines map one to one."""
    p.add_argument("-m", "--model", required=True, help="GGUF model file")
    p.add_argument("-dev", "--device", help="comma-separated devices, as llama.cpp prints them (e.g. CPU,CPU)")
    p.add_argument("--rpc", metavar="SERVERS",
                   help="comma-separated ggml RPC servers, host:port (llama-metaws rpc-server); their "
                   "devices come first unless --device names devices (RPC0, RPC1, ...)")
    p.add_argument("-sm", "--split-mode", default="layer", choices=["none", "layer", "row", "tensor"])
    p.add_argument("-ts", "--tensor-split", type=parse_floats, help="fractions per device, e.g. 0.55,0.45")
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", type=int, default=None,
                   help="layers on the devices (default: all when --device or --rpc is given, else 0)")
    p.add_argument("--spec-type", default="none", choices=["none", "draft-mtp"],
                   help="speculative decoding: draft-mtp drafts with the model's own MTP layers")
    p.add_argument("--spec-draft-n-max", "--draft-max", "--draft", "--draft-n", dest="draft_max",
                   type=draft_max_value, default=3,
                   help=f"tokens drafted per step at most (default 3); auto: chosen per step from "
                        f"the recent acceptance at each depth, 0 to {AUTO_DRAFT_MAX}")
    p.add_argument("--draft-p-min", type=float, default=0.0)
    p.add_argument("--phase-aware-workspace", action="store_true",
                   help="share the target's and the draft's compute buffers (needs --spec-type draft-mtp)")
    p.add_argument("--workspace-mode", default="alias", choices=["alias", "private-meta", "unsafe-shared", "off"])
    p.add_argument("-ctxcp", "--ctx-checkpoints", type=int, default=8,
                   help="prompt-reuse checkpoints kept at most (a recurrent or hybrid target with "
                   "draft-mtp; default 8, 0: none)")
    p.add_argument("--checkpoint-every", type=int, default=512,
                   help="a checkpoint every N tokens of a long prompt, besides each prompt's end "
                   "(default 512, 0: only there)")
    p.add_argument("-np", "--parallel", type=int, default=1, help="sequences (n_seq_max)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("-b", "--batch-size", type=int, default=2048)
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--no-mmap", action="store_true")
    p.add_argument("-nkvo", "--no-kv-offload", action="store_true",
                   help="keep the KV cache in host memory (offload_kqv=False); under -sm tensor each "
                   "device works on its own KV heads of it (CPU devices only)")
    p.add_argument("-s", "--seed", type=int, default=-1)
    p.add_argument("-fa", "--flash-attn", choices=["on", "off", "auto"], default="auto",
                   help="flash attention: on, off, or auto (default): on under -sm tensor, which needs "
                   "it, else the binding's default (off)")
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """llama-server's own flags (``serve``), and the queue limit."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    p.add_argument("-a", "--alias", help="the model's name in the API (default: the file's name)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--metrics", action="store_true", help="serve Prometheus metrics at GET /metrics")
    p.add_argument("--queue-size", type=int, default=16,
                   help="requests that may wait while one runs (default 16); one more gets a 503")


def llama_kwargs(args: argparse.Namespace) -> dict:
    """Our Llama's keyword arguments from llama.cpp's flags; a ValueError for flags that conflict."""
    kw = dict(
        n_ctx=args.ctx_size, n_batch=min(args.batch_size, args.ctx_size),
        n_ubatch=min(args.ubatch_size, args.batch_size, args.ctx_size),
        split_mode=args.split_mode, tensor_split=args.tensor_split, n_seq_max=args.parallel,
        use_mmap=not args.no_mmap, offload_kqv=not args.no_kv_offload, verbose=args.verbose,
        draft="mtp" if args.spec_type == "draft-mtp" else None,
        draft_max=args.draft_max, draft_p_min=args.draft_p_min,
        phase_aware_workspace=args.phase_aware_workspace,
        workspace_mode=args.workspace_mode if args.phase_aware_workspace else "off",
        allow_unsafe_workspace=args.workspace_mode == "unsafe-shared",
        ctx_checkpoints=args.ctx_checkpoints, checkpoint_every=args.checkpoint_every,
    )
    fa = getattr(args, "flash_attn", "auto")
    if fa == "on":
        kw["flash_attn"] = True
    elif fa == "off":
        if args.split_mode == "tensor":
            raise ValueError("-fa off: -sm tensor needs flash attention; use -fa on or -fa auto")
        kw["flash_attn"] = False
    if args.device:
        kw["devices"] = [d.strip() for d in args.device.split(",") if d.strip()]
    if args.rpc:
        kw["rpc_servers"] = args.rpc
    if args.n_gpu_layers is not None:
        kw["n_gpu_layers"] = args.n_gpu_layers
    if args.threads is not None:
        kw["n_threads"] = args.threads
    if args.seed != -1:
        kw["seed"] = args.seed
    return kw
