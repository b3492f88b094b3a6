"""llama.cpp's command-line flags and what they mean for our ``Llama``: one table for every command.

``generate`` and ``serve`` (and any later command that loads a model) take the same flags with
llama.cpp's names, so its command lines map one to one; :func:`llama_kwargs` turns them into
:class:`llama_metaws.Llama` keyword arguments.
"""

from __future__ import annotations

import argparse
from typing import List

from .engine import synthetic
from .engine.limits import AUTO_DRAFT_MAX


def parse_floats(text: str) -> List[float]:
    """llama.cpp's -ts syntax: "0.55,0.45" (or "3/1")."""
    parts = [x for x in text.replace("/", ",").split(",") if x.strip()]
    try:
        return [float(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None



# llama.cpp's KV cache types (-ctk/-ctv) as ggml's type ids (ggml.h's enum ggml_type: stable ABI)
KV_CACHE_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20,
                  "q5_0": 6, "q5_1": 7}


def kv_cache_type(text: str) -> str:
    name = text.strip().lower()
    if name not in KV_CACHE_TYPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a KV cache type; allowed: {', '.join(KV_CACHE_TYPES)}")
    return name


def byte_size(text: str) -> int:
    """A byte count, with an optional K, M or G suffix (binary: 16M is 16 MiB)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        n = int(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 16M)") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return n


class _Refused(argparse.Action):
    """A llama-server flag that means nothing here: an error that says why, naming the flag."""

    def __init__(self, option_strings, dest, reason: str = "", **kwargs):
        self.reason = reason
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.reason}")


# llama-server's flags this server refuses, and why
REFUSED_SERVER_FLAGS = {
    ("--props",): "POST /props changes nothing here: GET /props is always served",
    ("--lora", "--lora-scaled", "--control-vector"): "adapters are not supported by llama-metaws serve",
    ("--mmproj", "-mm"): "no multimodal projector: this server serves text models",
    ("--embedding", "--embeddings", "--reranking", "--rerank"): "this server generates text; it has no "
    "embedding or reranking endpoints",
    ("-nocb", "--no-cont-batching"): "the engine always batches every running request into one step "
    "(continuous batching); serve -np 1 runs one request at a time",
}


def _checked(parse):
    """An argparse type from a parser that raises ValueError with its message."""
    def value(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return value


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
                   help=f"tokens drafted per step at most (default 3); auto: chosen per step and slot, "
                        f"0 to {AUTO_DRAFT_MAX}, for the most tokens per second from each depth's "
                        f"recent acceptance and the step costs (measured at load, or a curve saved by an "
                        f"earlier run and checked, then as it runs)")
    p.add_argument("--draft-p-min", type=float, default=0.0)
    p.add_argument("--spec-synth-rates", metavar="P0,P1,...", type=_checked(synthetic.parse_rates), default=None,
                   help="benchmarking only: accept draft token i at random, with unconditional rate Pi (one "
                   "per draft position, non-increasing), instead of by its match with the target; the "
                   "output is not valid")
    p.add_argument("--spec-synth-len", metavar="L", type=_checked(synthetic.parse_length), default=None,
                   help="benchmarking only: synthetic acceptance at a mean acceptance length L, the target's "
                   "token included (1 to the draft length + 1; geometric rates)")
    p.add_argument("--phase-aware-workspace", action="store_true",
                   help="share the target's and the draft's compute buffers (needs --spec-type draft-mtp)")
    p.add_argument("--workspace-mode", default="alias", choices=["alias", "private-meta", "unsafe-shared", "off"])
    p.add_argument("-ctxcp", "--ctx-checkpoints", type=int, default=8,
                   help="prompt-reuse checkpoints kept at most (a recurrent or hybrid target with "
                   "draft-mtp; default 8, 0: none)")
    p.add_argument("--checkpoint-every", type=int, default=512,
                   help="a checkpoint every N tokens of a long prompt, besides each prompt's end "
                   "(default 512, 0: only there)")
    p.add_argument("-np", "--parallel", type=int, default=1,
                   help="slots: requests served at once, each a sequence of the contexts (n_seq_max)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("-b", "--batch-size", type=int, default=2048)
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="threads for generation (default: the binding's, half the cores)")
    p.add_argument("-tb", "--threads-batch", type=int, default=None,
                   help="threads for batches and prompts (default: -t's value where -t is given, as "
                   "llama-server's; else the binding's, every core)")
    p.add_argument("--no-mmap", action="store_true")
    p.add_argument("-nkvo", "--no-kv-offload", action="store_true",
                   help="keep the KV cache in host memory (offload_kqv=False); under -sm tensor each "
                   "device works on its own KV heads of it (CPU devices only)")
    p.add_argument("-s", "--seed", type=int, default=-1)
    p.add_argument("-ctk", "--cache-type-k", type=kv_cache_type, default=None,
                   help=f"KV cache type for K ({', '.join(KV_CACHE_TYPES)}; default f16)")
    p.add_argument("-ctv", "--cache-type-v", type=kv_cache_type, default=None,
                   help="KV cache type for V (as -ctk; a quantized V needs flash attention)")
    p.add_argument("-kvu", "--kv-unified", dest="kv_unified", action="store_true", default=False,
                   help="one KV buffer for every sequence: with -np N each may use the whole context")
    p.add_argument("-no-kvu", "--no-kv-unified", dest="kv_unified", action="store_false",
                   help="a KV buffer per sequence (the default): with -np N each has a context of -c / N")
    p.add_argument("-fa", "--flash-attn", choices=["on", "off", "auto"], default="auto",
                   help="flash attention: on, off, or auto (default): on under -sm tensor, which needs "
                   "it, else the binding's default (off)")
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """llama-server's own flags (``serve``), and the queue limit."""
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on, or several comma-separated (e.g. 127.0.0.1,::1; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    p.add_argument("-a", "--alias", help="the model's names in the API, comma-separated: /v1/models lists them "
                   "as its aliases, its id (and the name answers carry) the first in sorted order "
                   "(default: the file's name)")
    p.add_argument("--tags", help="the model's tags, comma-separated (informational: /v1/models lists them)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--cors-origins", default="*", metavar="ORIGINS",
                   help="allowed origins for CORS (default *: with credentials, the request's Origin is "
                   "echoed); localhost: the Origin echoed only when it is localhost; else sent as given")
    p.add_argument("--cors-methods", default="GET, POST, DELETE, OPTIONS", metavar="METHODS",
                   help="allowed methods for CORS (default: GET, POST, DELETE, OPTIONS)")
    p.add_argument("--cors-headers", default="*", metavar="HEADERS", help="allowed headers for CORS (default *)")
    p.add_argument("--cors-credentials", dest="cors_credentials", action="store_true", default=True,
                   help="allow credentials for CORS (the default)")
    p.add_argument("--no-cors-credentials", dest="cors_credentials", action="store_false",
                   help="do not allow credentials for CORS")
    p.add_argument("--metrics", action="store_true", help="serve Prometheus metrics at GET /metrics")
    p.add_argument("--queue-size", type=int, default=16,
                   help="requests that may wait while -np run (default 16); one more gets a 503")
    p.add_argument("-cb", "--cont-batching", action="store_true", default=True,
                   help="accepted: continuous batching is how the engine runs (every running request in "
                   "each step, new ones joining as slots free)")
    p.add_argument("--temp", "--temperature", dest="temp", type=float, default=None,
                   help="the temperature of requests that do not give one (default: each API's, 0.8)")
    p.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int, default=None,
                   help="the tokens to generate for requests that do not say (-1: up to the context; "
                   "default: each API's, 16 on /v1/completions)")
    p.add_argument("--jinja", dest="jinja", action="store_true", default=True,
                   help="render chat templates with llama.cpp's Jinja (the default)")
    p.add_argument("--no-jinja", dest="jinja", action="store_false",
                   help="render with llama.cpp's built-in templates instead (--chat-template NAME); no tools")
    p.add_argument("--chat-template", metavar="JINJA_TEMPLATE",
                   help="the chat template: Jinja text, or chatml; with --no-jinja any of llama.cpp's "
                   "built-in names (default: the model's)")
    p.add_argument("--chat-template-file", metavar="FILE", help="the chat template's Jinja text from a file")
    p.add_argument("--slot-save-path", metavar="DIR",
                   help="serve POST /slots/{id}?action=save|restore|erase, the files in DIR (the whole "
                   "slot: the target's and the draft's sequences, the checkpoints)")
    p.add_argument("--spm-infill", action="store_true",
                   help="/infill: the suffix before the prefix (Suffix/Prefix/Middle), for models that "
                   "were trained so")
    p.add_argument("--context-shift", dest="context_shift", action="store_true", default=False,
                   help="a generation that fills its slot's context goes on: the BOS is kept and half of the "
                   "tokens after it dropped, as llama-server shifts them (off, with a warning, for a model "
                   "whose memory cannot shift, e.g. qwen35's M-RoPE attention)")
    p.add_argument("--no-context-shift", dest="context_shift", action="store_false",
                   help="a generation that fills its slot's context ends there (the default)")
    p.add_argument("--chat-template-kwargs", metavar="STRING", type=_json_object, default=None,
                   help="more parameters for the template, a JSON object, e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--reasoning-format", default="deepseek", choices=["none", "auto", "deepseek", "deepseek-legacy"],
                   help="thinking in the answer: none (left in content), deepseek or auto (message.reasoning_content), "
                   "deepseek-legacy (also kept in content while streaming); default deepseek, as llama-server")
    p.add_argument("-rea", "--reasoning", default="auto", choices=["on", "off", "auto"],
                   help="thinking in chats: on, off, or auto (the default: as the template supports it)")
    p.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="token budget for thinking: -1 for unrestricted (the default), 0 for an immediate end, N")
    p.add_argument("--reasoning-budget-message", default="", metavar="MESSAGE",
                   help="injected before the end-of-thinking tag when the budget is exhausted (default: none)")
    p.add_argument("--prefill-assistant", dest="prefill_assistant", action="store_true", default=True,
                   help="a chat whose last message is the assistant's continues that message (the default)")
    p.add_argument("--no-prefill-assistant", dest="prefill_assistant", action="store_false",
                   help="a last assistant message is a whole message: the answer is a new one")
    p.add_argument("--slots", dest="slots", action="store_true", default=True,
                   help="serve GET /slots (the default)")
    p.add_argument("--no-slots", dest="slots", action="store_false", help="do not serve GET /slots")
    p.add_argument("--ui", "--webui", dest="ui", action="store_true", default=True,
                   help="serve a chat page at / (the default; it needs no API key, the API does)")
    p.add_argument("--no-ui", "--no-webui", dest="ui", action="store_false", help="serve no page at / (404)")
    p.add_argument("--max-body-size", type=byte_size, default=16 << 20, metavar="BYTES",
                   help="the largest request body accepted (default 16M); a larger one gets a 413")
    for names, reason in REFUSED_SERVER_FLAGS.items():
        p.add_argument(*names, action=_Refused, nargs="*", reason=reason, help=argparse.SUPPRESS)


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object is expected")
    return value


def chat_options(args: argparse.Namespace):
    """llama.cpp's chat layer's server-wide options from llama-server's flags."""
    import json

    from .chat_layer import ChatOptions

    kwargs = {k: json.dumps(v) for k, v in (getattr(args, "chat_template_kwargs", None) or {}).items()}
    reasoning = {"on": 1, "off": 0, "auto": -1}[getattr(args, "reasoning", "auto")]
    if reasoning != -1:  # as llama-server's --reasoning on/off sets enable_thinking
        kwargs["enable_thinking"] = "true" if reasoning else "false"
    return ChatOptions(reasoning_format=getattr(args, "reasoning_format", "deepseek"), reasoning=reasoning,
                       chat_template_kwargs=kwargs, use_jinja=getattr(args, "jinja", True),
                       reasoning_budget=getattr(args, "reasoning_budget", -1),
                       reasoning_budget_message=getattr(args, "reasoning_budget_message", ""),
                       prefill_assistant=getattr(args, "prefill_assistant", True))


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
        ctx_checkpoints=args.ctx_checkpoints, checkpoint_min_step=args.checkpoint_every,
        draft_synth_rates=args.spec_synth_rates, draft_synth_len=args.spec_synth_len,
    )
    if getattr(args, "context_shift", False):
        kw["context_shift"] = True
    if getattr(args, "kv_unified", False):
        kw["kv_unified"] = True
    for flag, key in (("cache_type_k", "type_k"), ("cache_type_v", "type_v")):
        if getattr(args, flag, None) is not None:
            kw[key] = KV_CACHE_TYPES[getattr(args, flag)]
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
    # llama-server's -tb falls back to -t: a server given -t 1 and pinned to one core ran each
    # batch on as many threads as there are cores (the binding's n_threads_batch default), a
    # thread spinning at ggml's barriers for a core that the other held
    threads_batch = getattr(args, "threads_batch", None)
    if threads_batch is None:
        threads_batch = args.threads
    if threads_batch is not None:
        kw["n_threads_batch"] = threads_batch
    if args.seed != -1:
        kw["seed"] = args.seed
    return kw
