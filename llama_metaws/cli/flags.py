"""llama.cpp's command-line flags and what they mean for our ``Llama``: one table for every command.

``generate`` and ``serve`` (and any later command that loads a model) take the same flags with
llama.cpp's names, values and defaults (llama-server's, for serve: ``-ngl auto``, ``-c 0``, ``-np -1``,
``-fa auto``, ``--fit on``, ...), so its command lines map one to one; :func:`llama_kwargs` turns
them into :class:`llama_metaws.Llama` keyword arguments. llama-server's other flags are in
:data:`llama_metaws.cli.server_flags.TABLE`: :func:`add_table_flags` registers those a parser does not
define as refused (an error naming the flag, why and what to do instead) or as taken without
effect, and :func:`llama_metaws.cli.server_flags.env_arguments` reads their ``LLAMA_ARG_*`` variables.
"""

from __future__ import annotations

import argparse
from typing import List

from . import server_flags
from ..engine import synthetic
from ..engine.limits import AUTO_DRAFT_MAX


class FlagParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line naming the flag (no usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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
# llama.h's enum llama_load_mode, enum llama_lazy_mode; ggml.h's ggml_numa_strategy; llama.h's rope scaling
LOAD_MODES = {"auto": -1, "none": 0, "mmap": 1, "mlock": 2, "mmap+mlock": 3, "dio": 4}
LAZY_MODES = {"off": 0, "auto": 1, "on": 2}
NUMA = {"distribute": 1, "isolate": 2, "numactl": 3}
ROPE_SCALING = {"none": 0, "linear": 1, "yarn": 2}
#: llama-server's -np -1: this many slots, with a unified KV (tools/server/server.cpp)
AUTO_PARALLEL = 4
#: workspace modes the command line takes; unsafe-shared only through ``llama-metaws-dev repro``
CLI_WORKSPACE_MODES = ("alias", "private-meta")


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


def _choice(names, what: str):
    """An argparse type taking one of ``names`` (a mapping or a sequence)."""
    def value(text: str):
        if text not in names:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}; one of {', '.join(names)}")
        return text
    return value


def _tri_state(allowed: str):
    """llama.cpp's on/off/auto spellings (common/arg.cpp's is_truthy, is_falsey, is_autoy)."""
    def value(text: str) -> str:
        t = text.strip().lower()
        if t in server_flags.TRUTHY:
            return "on"
        if t in server_flags.FALSEY:
            return "off"
        if "auto" in allowed and t in server_flags.AUTOY:
            return "auto"
        raise argparse.ArgumentTypeError(f"unknown value {text!r}; {allowed}")
    return value


def _only(flag: str):
    """A value of a llama-server flag serve takes for some values only (its table row's)."""
    row = server_flags.BY_SPELLING[flag]

    def value(text: str) -> str:
        if text.strip() not in row.allowed:
            raise argparse.ArgumentTypeError(f"{text!r} is refused: {row.note}")
        return text.strip()
    return value


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None


def gpu_layers(text: str):
    """-ngl: a count, 'auto' (fitted: --fit) or 'all'."""
    if text in ("auto", "all"):
        return text
    n = _int(text, "a count of layers, 'auto' or 'all'")
    return "all" if n < 0 else n  # llama.cpp: a negative count is every layer


def n_parallel(text: str) -> int:
    """-np: slots, or -1 (auto: 4 with a unified KV); 0 is llama-server's 'invalid value'."""
    n = _int(text, "a count of slots")
    if n == 0 or n < -1:
        raise argparse.ArgumentTypeError(f"invalid value for n_parallel: {n} (a count of slots, or -1: auto)")
    return n


def mib_list(text: str) -> List[int]:
    """-fitt: MiB per device, comma-separated (one value: every device)."""
    try:
        values = [int(x) for x in text.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of MiB counts: {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"not a list of MiB counts >= 0: {text!r}")
    return values


def override_kv(text: str) -> dict:
    """--override-kv KEY=TYPE:VALUE,... (types int, float, bool, str) as the binding's kv_overrides."""
    out = {}
    for item in [x for x in text.split(",") if x.strip()]:
        key, sep, rest = item.partition("=")
        kind, sep2, raw = rest.partition(":")
        if not (sep and sep2 and key):
            raise argparse.ArgumentTypeError(f"{item!r}: expected KEY=TYPE:VALUE (TYPE int, float, bool or str)")
        try:
            out[key] = {"int": int, "float": float, "str": str,
                        "bool": lambda v: {"true": True, "false": False}[v.lower()]}[kind](raw)
        except (KeyError, ValueError):
            raise argparse.ArgumentTypeError(f"{item!r}: TYPE is int, float, bool or str, and VALUE one") from None
    return out


def workspace_mode(text: str) -> str:
    if text == "unsafe-shared":
        raise argparse.ArgumentTypeError(
            "unsafe-shared shares meta buffers without an alias and aborts the process with GGML_ASSERT(tensor) "
            "under tensor split; it exists to reproduce that: run `llama-metaws-dev repro --mode unsafe-shared`")
    if text not in CLI_WORKSPACE_MODES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a workspace mode; one of {', '.join(CLI_WORKSPACE_MODES)}")
    return text


class _Refused(argparse.Action):
    """A flag this command refuses: an error that names it and says why."""

    def __init__(self, option_strings, dest, reason: str = "", **kwargs):
        self.reason = reason
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.reason}")


class _Ignored(argparse.Action):
    """A llama-server flag taken without effect here (its value, if any, read and dropped)."""

    def __call__(self, parser, namespace, values, option_string=None):
        pass


def _checked(parse):
    """An argparse type from a parser that raises ValueError with its message."""
    def value(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return value


def draft_max_value(text: str):
    """--spec-draft-n-max: a count of tokens, or "auto" (a length chosen per step, at most AUTO_DRAFT_MAX)."""
    if text.strip().lower() == "auto":
        return "auto"
    n = _int(text, "a count of tokens or 'auto'")
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {n}")
    return n


def add_model_flags(p: argparse.ArgumentParser, *, server: bool = True) -> None:
    """llama.cpp's own flags, so its command lines map one to one. ``server``: llama-server's
    defaults (``-np -1``); else llama.cpp's common ones (``-np 1``)."""
    g = p.add_argument_group("model and context (llama.cpp's flags and defaults)")
    g.add_argument("-m", "--model", required=True, help="GGUF model file")
    g.add_argument("-dev", "--device", help="comma-separated devices, as llama.cpp prints them (e.g. CPU,CPU; "
                   "none: the CPU alone)")
    g.add_argument("--list-devices", action=_ListDevices, help="print the devices and exit")
    g.add_argument("--rpc", metavar="SERVERS",
                   help="comma-separated ggml RPC servers, host:port (llama-metaws rpc-server); their "
                   "devices come first unless --device names devices (RPC0, RPC1, ...)")
    g.add_argument("-sm", "--split-mode", default="layer", choices=["none", "layer", "row", "tensor"])
    g.add_argument("-ts", "--tensor-split", type=parse_floats, help="fractions per device, e.g. 0.55,0.45")
    g.add_argument("-mg", "--main-gpu", type=int, default=None, metavar="INDEX",
                   help="the device for the model with -sm none, or for results and KV with -sm row")
    g.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="n_gpu_layers", type=gpu_layers, default="auto",
                   metavar="N", help="layers on the devices: a count, 'all', or 'auto' (the default: what fits the "
                   "free device memory, by llama.cpp's own fit, see --fit; on a CPU-only build every layer, on "
                   "the CPU)")
    g.add_argument("-fit", "--fit", type=_tri_state("on or off"), default="on", metavar="[on|off]",
                   help="fit what is left at llama.cpp's defaults (-ngl auto, -c 0) to the free device memory, "
                   "with llama.cpp's common_fit_params, the MTP draft context included (default on)")
    g.add_argument("-fitt", "--fit-target", type=mib_list, default=None, metavar="MiB0,MiB1,...",
                   help="MiB --fit leaves free on each device (one value: every device; default 1024)")
    g.add_argument("-fitc", "--fit-ctx", type=int, default=4096, metavar="N",
                   help="the least context --fit may cut -c 0 down to (default 4096)")
    g.add_argument("--spec-type", default="none", type=_only("--spec-type"), metavar="TYPE",
                   help="speculative decoding: none, or draft-mtp (drafts with the model's own MTP layers, or "
                   "with -md's)")
    g.add_argument("--spec-draft-model", "-md", "--model-draft", dest="draft_model", default=None, metavar="FNAME",
                   help="a draft model of its own file, loaded as an MTP context beside the target and placed as "
                   "it is: an MTP head (mtp-*.gguf, convert_hf_to_gguf.py --mtp) or a Gemma 4 assistant "
                   "(gemma4-assistant); it drafts with --spec-type draft-mtp, the type given or inferred from the "
                   "file (docs/drafting.md)")
    g.add_argument("--spec-draft-n-max", dest="draft_max", type=draft_max_value, default=3, metavar="N",
                   help=f"tokens drafted per step at most (default 3); auto: chosen per step and slot, "
                        f"0 to {AUTO_DRAFT_MAX}, for the most tokens per second from each depth's "
                        f"recent acceptance and the step costs (measured at load, or a curve saved by an "
                        f"earlier run and checked, then as it runs)")
    g.add_argument("--spec-draft-n-min", type=_only("--spec-draft-n-min"), default="0", metavar="N",
                   help="0 only: a step drafts 0 to --spec-draft-n-max tokens")
    g.add_argument("--spec-draft-p-min", "--draft-p-min", dest="draft_p_min", type=float, default=0.0, metavar="P",
                   help="stop a draft at the first token the MTP head gives less probability (default 0)")
    g.add_argument("--spec-synth-rates", metavar="P0,P1,...", type=_checked(synthetic.parse_rates), default=None,
                   help="benchmarking only: accept draft token i at random, with unconditional rate Pi (one "
                   "per draft position, non-increasing), instead of by its match with the target; the "
                   "output is not valid")
    g.add_argument("--spec-synth-len", metavar="L", type=_checked(synthetic.parse_length), default=None,
                   help="benchmarking only: synthetic acceptance at a mean acceptance length L, the target's "
                   "token included (1 to the draft length + 1; geometric rates)")
    w = p.add_argument_group("the phase-aware workspace (ours)")
    w.add_argument("--phase-aware-workspace", dest="phase_aware_workspace", action="store_true", default=None,
                   help="share the target's and the MTP draft's compute buffers: on by default wherever a draft "
                   "context exists (--spec-type draft-mtp); this flag says so explicitly")
    w.add_argument("--no-phase-aware-workspace", dest="phase_aware_workspace", action="store_false",
                   help="give the target and the draft private compute buffers")
    w.add_argument("--workspace-mode", type=workspace_mode, default=None, metavar="MODE",
                   help="how the workspace shares meta (tensor-split) buffers: alias (the default: the draft "
                   "computes through an alias of the target's buffer) or private-meta (meta buffers stay "
                   "private, the others shared)")
    c = p.add_argument_group("slots and memory")
    c.add_argument("-np", "--parallel", type=n_parallel, default=-1 if server else 1, metavar="N",
                   help="slots: requests served at once, each a sequence of the contexts (n_seq_max); "
                   + ("-1 (the default): auto, 4 slots with a unified KV, as llama-server" if server else
                      "default 1"))
    c.add_argument("-c", "--ctx-size", type=int, default=None, metavar="N",
                   help="context size (default 0: the model's training context, which --fit may cut down to "
                   "--fit-ctx where memory is short; an explicit 0 keeps all of it)")
    c.add_argument("-b", "--batch-size", type=int, default=2048, metavar="N")
    c.add_argument("-ub", "--ubatch-size", type=int, default=512, metavar="N")
    c.add_argument("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints", dest="ctx_checkpoints", type=int, default=32,
                   metavar="N", help="prompt-reuse checkpoints kept per slot at most (a recurrent or hybrid "
                   "target; default 32, 0: none)")
    c.add_argument("-cms", "--checkpoint-min-step", type=_nonnegative("checkpoint-min-step"), default=8192,
                   metavar="N", help="the checkpoints inside a long prompt this many tokens apart: one every N "
                   "tokens (default 8192; 0: no minimum, one at the end of every prompt chunk); each prompt's "
                   "end always takes one")
    c.add_argument("--checkpoint-every", action=_Refused, nargs="?", help=argparse.SUPPRESS,
                   reason="renamed: -cms/--checkpoint-min-step N, llama-server's name (default 8192)")
    c.add_argument("-kvu", "--kv-unified", dest="kv_unified", action="store_true", default=None,
                   help="one KV buffer for every sequence: with -np N each may use the whole context (default: "
                   "on with -np auto)")
    c.add_argument("-no-kvu", "--no-kv-unified", dest="kv_unified", action="store_false",
                   help="a KV buffer per sequence: with -np N each has a context of -c / N")
    c.add_argument("--swa-full", action="store_true", default=False,
                   help="a full-size sliding-window KV cache (Gemma 3): more memory, and a prompt's prefix is "
                   "kept wherever it parts from what its slot held; the default, as llama-server's, keeps a "
                   "window's worth and keeps a prefix only at a checkpoint (docs/real-gguf.md)")
    c.add_argument("-ctk", "--cache-type-k", type=kv_cache_type, default=None,
                   help=f"KV cache type for K ({', '.join(KV_CACHE_TYPES)}; default f16)")
    c.add_argument("-ctv", "--cache-type-v", type=kv_cache_type, default=None,
                   help="KV cache type for V (as -ctk; a quantized V needs flash attention)")
    c.add_argument("-kvo", "--kv-offload", dest="kv_offload", action="store_true", default=True,
                   help="the KV cache on the devices (the default)")
    c.add_argument("-nkvo", "--no-kv-offload", dest="kv_offload", action="store_false",
                   help="keep the KV cache in host memory (offload_kqv=False); under -sm tensor each "
                   "device works on its own KV heads of it (CPU devices only)")
    c.add_argument("-fa", "--flash-attn", type=_tri_state("on, off or auto"), default="auto", metavar="[on|off|auto]",
                   help="flash attention: on, off, or auto (the default: on wherever the devices support it, as "
                   "llama.cpp decides)")
    c.add_argument("-lm", "--load-mode", type=_choice(LOAD_MODES, "a load mode"), default="auto", metavar="MODE",
                   help=f"how the weights load: {', '.join(LOAD_MODES)} (default auto: mmap unless a device "
                   "does not support it)")
    c.add_argument("--no-mmap", dest="load_mode", action="store_const", const="none",
                   help="ours, from older llama.cpp: -lm none")
    c.add_argument("-lzm", "--lazy-mode", type=_choice(LAZY_MODES, "a lazy mode"), default=None, metavar="MODE",
                   help="on-demand reading of marked tensors: on, auto (llama.cpp's default) or off")
    c.add_argument("--numa", type=_choice(NUMA, "a NUMA strategy"), default=None, metavar="TYPE",
                   help=f"NUMA placement: {', '.join(NUMA)}")
    c.add_argument("--repack", dest="repack", action="store_true", default=None,
                   help="weight repacking (llama.cpp's default)")
    c.add_argument("-nr", "--no-repack", dest="repack", action="store_false", help="no weight repacking")
    c.add_argument("--no-host", action="store_true", default=None, help="bypass the host buffer for extra buffers")
    c.add_argument("--op-offload", dest="op_offload", action="store_true", default=None,
                   help="offload host tensor operations to the device (llama.cpp's default)")
    c.add_argument("--no-op-offload", dest="op_offload", action="store_false")
    c.add_argument("--check-tensors", action="store_true", default=None, help="check the weights for invalid values")
    c.add_argument("--override-kv", type=override_kv, action="append", default=None, metavar="KEY=TYPE:VALUE,...",
                   help="override model metadata (TYPE int, float, bool or str)")
    c.add_argument("--keep", type=_only("--keep"), default="0", metavar="N",
                   help="0 only: a context shift keeps the BOS")
    c.add_argument("--perf", dest="perf", action="store_true", default=False,
                   help="llama.cpp's internal performance timings")
    c.add_argument("--no-perf", dest="perf", action="store_false", help="none of them (the default)")
    r = p.add_argument_group("RoPE and YaRN (llama.cpp's flags; default: the model's)")
    r.add_argument("--rope-scaling", type=_choice(ROPE_SCALING, "a RoPE scaling"), default=None,
                   metavar="{none,linear,yarn}")
    r.add_argument("--rope-scale", type=float, default=None, metavar="N",
                   help="context scaling factor: --rope-freq-scale 1/N")
    for name in ("--rope-freq-base", "--rope-freq-scale", "--yarn-ext-factor", "--yarn-attn-factor",
                 "--yarn-beta-slow", "--yarn-beta-fast"):
        r.add_argument(name, type=float, default=None, metavar="N")
    r.add_argument("--yarn-orig-ctx", type=int, default=None, metavar="N")
    t = p.add_argument_group("threads and the rest")
    t.add_argument("-t", "--threads", type=int, default=None,
                   help="threads for generation (default: the binding's, half the logical cores, about the "
                   "physical ones; llama.cpp's -1 counts them itself)")
    t.add_argument("-tb", "--threads-batch", type=int, default=None,
                   help="threads for batches and prompts (default: -t's value where -t is given, as "
                   "llama-server's; else the binding's, every core)")
    t.add_argument("-s", "--seed", type=int, default=-1)
    t.add_argument("-v", "--verbose", "--log-verbose", dest="verbose", action="store_true",
                   help="show llama.cpp's log")


def _nonnegative(name: str):
    def value(text: str) -> int:
        n = _int(text, "an integer")
        if n < 0:
            raise argparse.ArgumentTypeError(f"{name} must be non-negative, got {n}")
        return n
    return value


class _ListDevices(argparse.Action):
    """--list-devices: print ggml's devices and exit, as llama-server."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from ..engine.devices import list_devices

        print("Available devices:")
        for d in list_devices():
            print(f"  {d.name}: {d.description} ({d.memory_total >> 20} MiB, {d.memory_free >> 20} MiB free)")
        parser.exit(0)


class _Version(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version

        try:
            ours = version("llama-metaws")
        except PackageNotFoundError:
            ours = "(not installed)"
        print(f"llama-metaws {ours}; llama.cpp as llama-cpp-python 0.3.36 vendors it, with patches/series")
        parser.exit(0)


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """llama-server's own flags (``serve``), and the queue limit."""
    p.add_argument("--usage", action="help", help="show this help message and exit (as -h)")
    p.add_argument("--version", action=_Version, help="print the version and exit")
    s = p.add_argument_group("server (llama-server's flags and defaults)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on, or several comma-separated (e.g. 127.0.0.1,::1; default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    s.add_argument("--reuse-port", action="store_true", help="let several sockets bind the same port (SO_REUSEPORT)")
    s.add_argument("-a", "--alias", help="the model's names in the API, comma-separated: /v1/models lists them "
                   "as its aliases, its id (and the name answers carry) the first in sorted order "
                   "(default: the file's name)")
    s.add_argument("--tags", help="the model's tags, comma-separated (informational: /v1/models lists them)")
    s.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health; several "
                   "keys comma-separated")
    s.add_argument("--api-key-file", metavar="FNAME",
                   help="API keys from a file, one per line (a line starting with # is a comment)")
    s.add_argument("--cors-origins", default="*", metavar="ORIGINS",
                   help="allowed origins for CORS (default *: with credentials, the request's Origin is "
                   "echoed); localhost: the Origin echoed only when it is localhost; else sent as given")
    s.add_argument("--cors-methods", default="GET, POST, DELETE, OPTIONS", metavar="METHODS",
                   help="allowed methods for CORS (default: GET, POST, DELETE, OPTIONS)")
    s.add_argument("--cors-headers", default="*", metavar="HEADERS", help="allowed headers for CORS (default *)")
    s.add_argument("--cors-credentials", dest="cors_credentials", action="store_true", default=True,
                   help="allow credentials for CORS (the default)")
    s.add_argument("--no-cors-credentials", dest="cors_credentials", action="store_false",
                   help="do not allow credentials for CORS")
    s.add_argument("--metrics", action="store_true", help="serve Prometheus metrics at GET /metrics")
    s.add_argument("--queue-size", type=int, default=16,
                   help="ours: requests that may wait while -np run (default 16); one more gets a 503")
    s.add_argument("--max-body-size", type=byte_size, default=16 << 20, metavar="BYTES",
                   help="ours: the largest request body accepted (default 16M); a larger one gets a 413")
    s.add_argument("-cb", "--cont-batching", action="store_true", default=True,
                   help="accepted: continuous batching is how the engine runs (every running request in "
                   "each step, new ones joining as slots free)")
    s.add_argument("--temp", "--temperature", dest="temp", type=float, default=None,
                   help="the temperature of requests that do not give one (default: each API's, 0.8)")
    s.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int, default=None,
                   help="the tokens to generate for requests that do not say (-1: up to the context; "
                   "default: each API's, 16 on /v1/completions, as a request that sets nothing expects of its "
                   "API; llama-server's -1 would make those unlimited)")
    s.add_argument("--cache-prompt", dest="cache_prompt", action="store_true", default=True,
                   help="requests reuse what their slot holds unless they say cache_prompt: false (the default)")
    s.add_argument("--no-cache-prompt", dest="cache_prompt", action="store_false",
                   help="requests evaluate their whole prompt unless they say cache_prompt: true")
    s.add_argument("--cache-reuse", type=_only("--cache-reuse"), default="0",
                   metavar="N", help="0 only: prompts are reused as prefixes")
    s.add_argument("-cram", "--cache-ram", type=_only("-cram"), default="0",
                   metavar="N", help="0 only: no host-memory prompt cache")
    s.add_argument("--sse-ping-interval", type=_only("--sse-ping-interval"), default="-1", metavar="N",
                   help="-1 only: no pings")
    s.add_argument("--sleep-idle-seconds", type=_only("--sleep-idle-seconds"), default="-1", metavar="SECONDS",
                   help="-1 only: the model stays loaded")
    s.add_argument("--jinja", dest="jinja", action="store_true", default=True,
                   help="render chat templates with llama.cpp's Jinja (the default)")
    s.add_argument("--no-jinja", dest="jinja", action="store_false",
                   help="render with llama.cpp's built-in templates instead (--chat-template NAME); no tools")
    s.add_argument("--chat-template", metavar="JINJA_TEMPLATE",
                   help="the chat template: Jinja text, or chatml; with --no-jinja any of llama.cpp's "
                   "built-in names (default: the model's)")
    s.add_argument("--chat-template-file", metavar="FILE", help="the chat template's Jinja text from a file")
    s.add_argument("--slot-save-path", metavar="DIR",
                   help="serve POST /slots/{id}?action=save|restore|erase, the files in DIR (the whole "
                   "slot: the target's and the draft's sequences, the checkpoints)")
    s.add_argument("--spm-infill", action="store_true",
                   help="/infill: the suffix before the prefix (Suffix/Prefix/Middle), for models that "
                   "were trained so")
    s.add_argument("--context-shift", dest="context_shift", action="store_true", default=False,
                   help="a generation that fills its slot's context goes on: the BOS is kept and half of the "
                   "tokens after it dropped, as llama-server shifts them (off, with a warning, for a model "
                   "whose memory cannot shift, e.g. qwen35's M-RoPE attention)")
    s.add_argument("--no-context-shift", dest="context_shift", action="store_false",
                   help="a generation that fills its slot's context ends there (the default)")
    s.add_argument("--chat-template-kwargs", metavar="STRING", type=_json_object, default=None,
                   help="more parameters for the template, a JSON object, e.g. '{\"enable_thinking\": false}'")
    s.add_argument("--reasoning-format", default="deepseek", choices=["none", "auto", "deepseek", "deepseek-legacy"],
                   help="thinking in the answer: none (left in content), deepseek or auto (message.reasoning_content), "
                   "deepseek-legacy (also kept in content while streaming); default deepseek, as llama-server")
    s.add_argument("-rea", "--reasoning", default="auto", type=_tri_state("on, off or auto"), metavar="[on|off|auto]",
                   help="thinking in chats: on, off, or auto (the default: as the template supports it)")
    s.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="token budget for thinking: -1 for unrestricted (the default), 0 for an immediate end, N")
    s.add_argument("--reasoning-budget-message", default="", metavar="MESSAGE",
                   help="injected before the end-of-thinking tag when the budget is exhausted (default: none)")
    s.add_argument("--prefill-assistant", dest="prefill_assistant", action="store_true", default=True,
                   help="a chat whose last message is the assistant's continues that message (the default)")
    s.add_argument("--no-prefill-assistant", dest="prefill_assistant", action="store_false",
                   help="a last assistant message is a whole message: the answer is a new one")
    s.add_argument("--slots", dest="slots", action="store_true", default=True,
                   help="serve GET /slots (the default)")
    s.add_argument("--no-slots", dest="slots", action="store_false", help="do not serve GET /slots")
    s.add_argument("--ui", "--webui", dest="ui", action="store_true", default=True,
                   help="serve a chat page at / (the default; it needs no API key, the API does)")
    s.add_argument("--no-ui", "--no-webui", dest="ui", action="store_false", help="serve no page at / (404)")


def add_table_flags(p: argparse.ArgumentParser) -> None:
    """llama-server's flags ``p`` does not define: refused (an error naming the flag, why and what to
    do instead) or taken without effect, by :data:`server_flags.TABLE`. Call it last."""
    known = set(p._option_string_actions)
    for flag in server_flags.TABLE:
        for spelling in flag.spellings:
            if spelling in known:
                continue
            status = flag.status_of(spelling)
            nargs = 1 if flag.value and spelling in flag.names else 0
            if status == server_flags.NOOP:
                p.add_argument(spelling, action=_Ignored, nargs=nargs, dest="_ignored", help=argparse.SUPPRESS)
            elif status in (server_flags.REFUSED, server_flags.REMOVED):
                p.add_argument(spelling, action=_Refused, nargs="*", dest="_refused", help=argparse.SUPPRESS,
                               reason=flag.note_of(spelling))
            known.add(spelling)
    p.epilog = ("llama-server's other flags are taken without effect or refused with the reason, and each "
                "flag llama-server has a LLAMA_ARG_* variable for reads it (the command line wins): see "
                "docs/server-flags.md.")


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

    from ..api.chat_layer import ChatOptions

    kwargs = {k: json.dumps(v) for k, v in (getattr(args, "chat_template_kwargs", None) or {}).items()}
    reasoning = {"on": 1, "off": 0, "auto": -1}[getattr(args, "reasoning", "auto")]
    if reasoning != -1:  # as llama-server's --reasoning on/off sets enable_thinking
        kwargs["enable_thinking"] = "true" if reasoning else "false"
    return ChatOptions(reasoning_format=getattr(args, "reasoning_format", "deepseek"), reasoning=reasoning,
                       chat_template_kwargs=kwargs, use_jinja=getattr(args, "jinja", True),
                       reasoning_budget=getattr(args, "reasoning_budget", -1),
                       reasoning_budget_message=getattr(args, "reasoning_budget_message", ""),
                       prefill_assistant=getattr(args, "prefill_assistant", True))


def _workspace(args: argparse.Namespace, draft: bool) -> dict:
    """The workspace's keyword arguments: on wherever a draft context exists, unless turned off; a
    workspace flag without a draft context is an error that says why."""
    on, mode = args.phase_aware_workspace, args.workspace_mode
    if not draft and (on is not None or mode is not None):
        flag = "--workspace-mode" if mode is not None else \
            "--phase-aware-workspace" if on else "--no-phase-aware-workspace"
        raise ValueError(f"{flag}: the workspace is shared by the target and its MTP draft context, and without "
                         "--spec-type draft-mtp there is no draft context: add --spec-type draft-mtp, or drop "
                         f"{flag}")
    if on is False and mode is not None:
        raise ValueError(f"--workspace-mode {mode} with --no-phase-aware-workspace: there is no workspace to "
                         "give a mode; drop one of them")
    return dict(phase_aware_workspace=on is not False, workspace_mode=mode or "alias")


def llama_kwargs(args: argparse.Namespace) -> dict:
    """Our Llama's keyword arguments from llama.cpp's flags; a ValueError for flags that conflict."""
    from ..engine import fit

    auto_np = args.parallel == -1
    n_seq = AUTO_PARALLEL if auto_np else args.parallel
    kv_unified = args.kv_unified if args.kv_unified is not None else auto_np
    # -c: unset is 0 fitted down to --fit-ctx where memory is short; an explicit 0 keeps the whole
    # training context (llama-server sets its fit's least context to UINT32_MAX then)
    n_ctx = args.ctx_size if args.ctx_size is not None else 0
    if n_ctx < 0:
        raise ValueError(f"-c {n_ctx}: a context size is 0 (the model's) or more")
    fit_min_ctx = fit.FULL_CONTEXT if args.ctx_size == 0 else args.fit_ctx
    n_batch = min(args.batch_size, n_ctx) if n_ctx else args.batch_size
    # -md without --spec-type: draft-mtp is inferred from the file when the model loads (Llama)
    draft = args.spec_type == "draft-mtp" or args.draft_model is not None
    kw = dict(
        n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(args.ubatch_size, n_batch),
        split_mode=args.split_mode, tensor_split=args.tensor_split, n_seq_max=n_seq,
        offload_kqv=args.kv_offload, verbose=args.verbose,
        draft="mtp" if args.spec_type == "draft-mtp" else None,
        draft_max=args.draft_max, draft_p_min=args.draft_p_min,
        ctx_checkpoints=args.ctx_checkpoints, checkpoint_min_step=args.checkpoint_min_step,
        draft_synth_rates=args.spec_synth_rates, draft_synth_len=args.spec_synth_len,
        n_gpu_layers=args.n_gpu_layers, fit_params=args.fit == "on", fit_min_ctx=fit_min_ctx,
        load_mode=LOAD_MODES[args.load_mode], no_perf=not args.perf, **_workspace(args, draft),
    )
    if args.draft_model is not None:
        kw["draft_model"] = args.draft_model  # a path (a str): a file, not one of the binding's draft objects
    if args.fit_target is not None:
        kw["fit_target_mib"] = args.fit_target if len(args.fit_target) > 1 else args.fit_target[0]
    if getattr(args, "context_shift", False):
        kw["context_shift"] = True
    if kv_unified:
        kw["kv_unified"] = True
    for flag, key in (("cache_type_k", "type_k"), ("cache_type_v", "type_v")):
        if getattr(args, flag, None) is not None:
            kw[key] = KV_CACHE_TYPES[getattr(args, flag)]
    fa = args.flash_attn
    if fa == "off" and args.split_mode == "tensor":
        raise ValueError("-fa off: -sm tensor needs flash attention; use -fa on or -fa auto")
    kw["flash_attn"] = {"on": True, "off": False, "auto": "auto"}[fa]
    if args.device:
        names = [d.strip() for d in args.device.split(",") if d.strip()]
        kw["devices"] = ["CPU"] if names == ["none"] else names  # none: no offload, the CPU alone
    if args.rpc:
        kw["rpc_servers"] = args.rpc
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
    # llama.cpp's params given on the command line (left out: llama.cpp's / the binding's defaults)
    kw["swa_full"] = bool(args.swa_full)  # llama-server's default (off), not the binding's (on)
    optional = dict(main_gpu=args.main_gpu, op_offload=args.op_offload,
                    check_tensors=args.check_tensors, no_host=args.no_host, use_extra_bufts=args.repack,
                    lazy_mode=LAZY_MODES.get(args.lazy_mode), numa=NUMA.get(args.numa),
                    rope_scaling_type=ROPE_SCALING.get(args.rope_scaling), rope_freq_base=args.rope_freq_base,
                    rope_freq_scale=(1.0 / args.rope_scale if args.rope_scale else args.rope_freq_scale),
                    yarn_orig_ctx=args.yarn_orig_ctx, yarn_ext_factor=args.yarn_ext_factor,
                    yarn_attn_factor=args.yarn_attn_factor, yarn_beta_slow=args.yarn_beta_slow,
                    yarn_beta_fast=args.yarn_beta_fast)
    kw.update({k: v for k, v in optional.items() if v is not None})
    if args.override_kv:
        kw["kv_overrides"] = {k: v for d in args.override_kv for k, v in d.items()}
    return kw
