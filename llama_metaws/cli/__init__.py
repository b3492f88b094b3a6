"""``llama-metaws``, the user's command line: build the patched llama.cpp, list devices, run the
demo, plan memory, compare the workspace modes' memory, generate, serve, and serve this host's
devices over ggml's RPC.

llama.cpp's flags for ``serve`` and ``generate`` (:mod:`.flags`) and llama-server's option table
(:mod:`.server_flags`) live beside it. The developers' commands (the GPU run kit, the assert's
reproduction, the series check, llama.cpp's tools) are ``llama-metaws-dev``'s, in the developer
package ``dev/`` that the wheel leaves out.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional



def _cmd_build(args: argparse.Namespace) -> int:
    from ..native import build, manifest

    tools_build = _tools_build() if args.tools else None
    if args.tools and tools_build is None:
        print("llama-metaws build --tools: llama.cpp's tools are built by the developer package "
              "(pip install -e dev/ in a checkout: make setup does)", file=sys.stderr)
        return 2

    try:
        bundled = _bundled_build(build, manifest)
        if bundled is not None and not (args.force or args.tools):
            if bundled.root.name == build.BuildInputs.collect().key():
                print(f"llama-metaws: this installation carries build {bundled.root.name} "
                      f"({bundled.root}), made when it was installed: nothing to build", file=sys.stderr)
                print(bundled.root)
                return 0
            print(f"llama-metaws: the installed package carries build {bundled.root.name}; these "
                  "inputs (CMAKE_ARGS) make another, built into the cache and used from now on",
                  file=sys.stderr)
        tools = None
        if args.tools:  # one CMake tree for both where the library is not built yet
            lib, tools = tools_build.build_with_tools(build.BuildInputs.collect(), force=args.force)
            b = build.Build(lib.root, build.build_shim(lib))
        else:
            b = build.build(force=args.force)
        print(f"llama-metaws: manifest {manifest.write_manifest(b, tools=tools)}", file=sys.stderr)
    except build.BuildError as e:
        print(f"llama-metaws build: {e}", file=sys.stderr)
        return 1
    except PermissionError as e:  # an installed package in a read-only site-packages
        print(f"llama-metaws build: cannot write the run-time manifest ({e}): set "
              f"{manifest.MANIFEST_ENV} to a writable file, here and where the package runs", file=sys.stderr)
        return 1
    print(b.root)
    if args.tools:
        for path in (tools_build.find_tools() or {}).values():
            print(path)
    return 0


def _tools_build():
    """The developer package's tools build (``llama_metaws_dev.tools_build``), if installed."""
    try:
        from llama_metaws_dev import tools_build
    except ImportError:
        return None
    return tools_build


def _bundled_build(build, manifest):
    """The build ``pip install`` bundled into this installed package, while the manifest names it."""
    try:
        b = manifest.read_manifest()
    except build.BuildError:
        return None
    return b if b.bundled else None


def _print_devices() -> None:
    from ..engine.devices import list_devices

    print("devices:")
    for d in list_devices():
        mib = d.memory_total / 2**20
        print(f"  {d.name:<8} {d.type:<5} {mib:10.0f} MiB  {d.description}")


def _cmd_devices(args: argparse.Namespace) -> int:
    if args.rpc:
        from ..engine import rpc

        try:
            rpc.connect(args.rpc)  # the servers' devices join the registry
        except ValueError as e:
            print(f"llama-metaws devices: {e}", file=sys.stderr)
            return 2
    _print_devices()
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run

    return run(args, print_devices=_print_devices)


def _cmd_vram(args: argparse.Namespace) -> int:
    from ..tools import vram

    return vram.run_from_args(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    from ..tools import plan

    return plan.run_from_args(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    from . import flags
    from ..api.llama import Llama

    try:
        llm = Llama(args.model, **flags.llama_kwargs(args))
    except ValueError as e:
        print(f"llama-metaws generate: {e}", file=sys.stderr)
        return 2
    try:
        sampling = dict(max_tokens=args.n_predict, temperature=args.temp, top_k=args.top_k, top_p=args.top_p)
        if args.seed != -1:
            sampling["seed"] = args.seed
        for chunk in llm.create_completion(args.prompt, stream=True, **sampling):
            print(chunk["choices"][0]["text"], end="", flush=True)
        print()
        t = llm.timings()
        st = llm.draft_stats.last
        print(f"prompt {t['prompt_tokens']} tokens, {t['prompt_tokens_per_s']:.1f} t/s; "
              f"decode {t['decode_tokens']} tokens, {t['decode_tokens_per_s']:.1f} t/s", file=sys.stderr)
        if llm.drafting:
            print(f"draft: {st.drafted} drafted, {st.accepted} accepted ({st.acceptance:.1%})", file=sys.stderr)
        for e in llm.workspace_stats():
            print(f"workspace {e.buffer_type}: allocated {e.allocated:,} B (target needs {e.owner_need:,}, "
                  f"draft {e.borrower_need:,}), shared={e.shared}, alias={e.alias}, "
                  f"grows {e.n_grow}, shrinks {e.n_shrink}", file=sys.stderr)
    finally:
        llm.close()
    return 0


def _cmd_rpc_server(args: argparse.Namespace) -> int:
    from ..engine import rpc

    devices = [d.strip() for d in args.device.split(",") if d.strip()] if args.device else None
    try:
        return rpc.serve(args.host, args.port, args.threads, devices, args.cache)
    except ValueError as e:
        print(f"llama-metaws rpc-server: {e}", file=sys.stderr)
        return 2


def _cmd_serve(args: argparse.Namespace) -> int:
    from ..server import serve

    return serve(args)


def make_parser() -> argparse.ArgumentParser:
    from . import flags  # here, not at import: `python -m llama_metaws.cli.server_flags` runs alone
    p = flags.FlagParser(
        prog="llama-metaws",
        description="MTP speculative decoding for llama-cpp-python with a phase-aware "
        "compute workspace (docs/command-line.md; the developers' commands: llama-metaws-dev).",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=flags.FlagParser)
    p.allow_abbrev = False

    b = sub.add_parser("build", help="fetch, patch and build llama.cpp and the cffi shim (cached)",
                       description="Fetch the pinned llama-cpp-python sdist, apply patches/series, "
                       "build with CMake (CMAKE_ARGS passed through; the binding's -DLLAMA_BUILD and "
                       "-DLLAVA_BUILD left out) and the cffi shim. An unchanged set of inputs returns at "
                       "once; a package installed from the sdist carries the build pip made, and other "
                       "CMAKE_ARGS build into the cache, used from then on.")
    b.add_argument("--force", action="store_true", help="rebuild even when the build is cached")
    b.add_argument("--tools", action="store_true",
                   help="also build llama.cpp's llama-speculative-simple, llama-bench, llama-server "
                   "and llama-batched-bench from the same patched tree (cached under a key of their "
                   "own; paths in the manifest), for the benches: needs the developer package (dev/)")
    b.set_defaults(func=_cmd_build)

    d = sub.add_parser("devices", help="list ggml's devices")
    d.add_argument("--rpc", metavar="SERVERS", help="also the devices of these RPC servers (host:port,...)")
    d.set_defaults(func=_cmd_devices)

    m = sub.add_parser("demo", help="the main job on the embedded default model",
                       description="List the devices, complete a prompt with the tiny MTP model under "
                       "tensor split with MTP drafting and the workspace, then compare the workspace modes "
                       "(no workspace, unsafe-shared, private-meta, alias; alias under layer split), each "
                       "configuration in its own process, and print memory per device, tokens/s and draft "
                       "acceptance (and a plot of memory over time when matplotlib is installed).")
    m.add_argument("-m", "--model", help="GGUF model with nextn layers (default: the tiny one)")
    m.add_argument("--device", "-dev", default="CPU,CPU",
                   help="comma-separated device names, as llama.cpp prints them (default CPU,CPU)")
    m.add_argument("-p", "--prompt", default="hello world")
    m.add_argument("-n", "--n-predict", type=int, default=16)
    m.add_argument("--plot", default="vram.png", help="where the plot goes (default vram.png)")
    m.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")
    m.set_defaults(func=_cmd_demo)

    vr = sub.add_parser("vram", allow_abbrev=False,
                        help="the workspace modes compared: memory per device over load and requests",
                        description="Run each configuration in its own process, sample memory per device "
                        "(exact ggml compute bytes; pynvml with --nvidia), print configuration, result, "
                        "tokens/s, draft acceptance and peak per device.")
    from ..tools.vram import add_arguments as _vram_arguments

    _vram_arguments(vr)
    vr.set_defaults(func=_cmd_vram)

    pl = sub.add_parser("plan", allow_abbrev=False,
                        help="predict memory per device from a GGUF header or a config.json",
                        description="Ask llama.cpp (a no_alloc model on CPU stand-ins, the target and "
                        "MTP draft contexts on it) for weights, KV, recurrent state and compute per "
                        "device, and the compute held under the workspace modes off, private-meta "
                        "and alias. Reads no weights.")
    from ..tools.plan import add_arguments as _plan_arguments

    _plan_arguments(pl)
    pl.set_defaults(func=_cmd_plan)
    g = sub.add_parser("generate", allow_abbrev=False,
                       help="generate text with llama.cpp's flags (MTP drafting, tensor split, workspace)",
                       description="Complete a prompt with the patched Llama. Flags follow llama.cpp, e.g. "
                       "-m MODEL --device CPU,CPU -sm tensor -ts 0.55,0.45 --spec-type draft-mtp "
                       "-np 2 -c 4096 -ub 512 -p PROMPT -n 64 (the workspace is on with the draft context; "
                       "--no-phase-aware-workspace: off). The text goes to "
                       "stdout, speed, draft acceptance and workspace figures to stderr.")
    flags.add_model_flags(g, server=False)
    g.add_argument("-p", "--prompt", required=True)
    g.add_argument("-n", "--n-predict", type=int, default=64)
    g.add_argument("--temp", type=float, default=0.0, help="0: greedy (default)")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    flags.add_table_flags(g)
    g.set_defaults(func=_cmd_generate)

    sv = sub.add_parser("serve", allow_abbrev=False,
                        help="OpenAI's API and llama-server's on the patched Llama (llama-server's flags)",
                        description="Serve OpenAI's /v1/completions, /v1/chat/completions, /v1/responses, "
                        "/v1/models, Anthropic's /v1/messages and llama-server's /completion, /infill, /tokenize, "
                        "/detokenize, /apply-template, /props, /slots, /health and (--metrics) /metrics with the "
                        "patched Llama, and a chat page at / (--no-ui: none), configured by llama-server's "
                        "flags, values, defaults and LLAMA_ARG_* variables (docs/server-flags.md), e.g. -m MODEL "
                        "--device CPU,CPU -sm tensor --spec-type draft-mtp --port 8080; the phase-aware workspace "
                        "is on wherever a draft context exists. -np requests run at once (each on a slot); "
                        "others wait, up to --queue-size. Needs the server extra.")
    flags.add_model_flags(sv)
    flags.add_server_flags(sv)
    flags.add_table_flags(sv)
    sv.set_defaults(func=_cmd_serve)

    rs = sub.add_parser("rpc-server", allow_abbrev=False,
                        help="ggml's RPC server from this build: this host's devices for --rpc",
                        description="Serve this host's devices to clients' --rpc / rpc_servers (ggml's "
                        "rpc-server, with its flags). The protocol has no authentication: bind "
                        "127.0.0.1 (the default) or a trusted private network only; another address "
                        "prints a warning. Runs until killed.")
    rs.add_argument("-H", "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    rs.add_argument("-p", "--port", type=int, default=50052, help="port to bind (default 50052)")
    rs.add_argument("-t", "--threads", type=int, default=None,
                    help="threads of the CPU device (default: half the cores)")
    rs.add_argument("-d", "--device", help="comma-separated devices to serve (default: the "
                    "accelerators, else the CPU)")
    rs.add_argument("-c", "--cache", action="store_true",
                    help="cache large tensors in $LLAMA_CACHE/rpc (default ~/.cache/llama.cpp/rpc)")
    rs.set_defaults(func=_cmd_rpc_server)
    return p


#: the commands that take llama.cpp's flags, and with them its LLAMA_ARG_* variables
LLAMA_FLAG_COMMANDS = ("serve", "generate")


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._subparsers._group_actions:
        if name in action.choices:
            return action.choices[name]
    raise KeyError(name)


def _llama_argv(sub: argparse.ArgumentParser, argv: List[str]) -> List[str]:
    """A llama.cpp command line as llama.cpp reads it: its LLAMA_ARG_* variables first (the command
    line after them wins), and a long flag spelled with underscores (--ctx_size) read with dashes."""
    from . import server_flags

    known = set(sub._option_string_actions)
    out = []
    for a in argv:
        fixed = a.replace("_", "-") if a.startswith("--") and "=" not in a else a
        out.append(fixed if a not in known and fixed in known else a)
    return server_flags.env_arguments(known, argv=out) + out


def main(argv: Optional[List[str]] = None) -> int:
    from . import server_flags

    parser = make_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    sub = None
    if argv and argv[0] in LLAMA_FLAG_COMMANDS:
        sub = _subparser(parser, argv[0])
        try:
            argv = argv[:1] + _llama_argv(sub, argv[1:])
        except server_flags.EnvError as e:
            sub.error(str(e))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # llama-server's words for it: a flag it does not know either
        (sub or parser).error(f"invalid argument: {unknown[0]}" + (
            "" if unknown[0].startswith("-") else " (a value without its flag?)"))
    return args.func(args)
