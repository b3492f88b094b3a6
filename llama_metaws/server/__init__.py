"""``llama-metaws serve``: OpenAI's API (chat, completions, Responses), Anthropic's Messages API
and llama-server's own on the patched ``Llama``.

llama-cpp-python's request types and ``Llama.create_completion`` / ``create_chat_completion``
(stop strings, seeds, logprobs, grammars; chats through llama.cpp's own chat layer,
:mod:`llama_metaws.api.chat_layer`) do the work; the serving around them is ours. :mod:`.app` puts
the route groups (:mod:`.routes`) on a :class:`.serving.Serving`; the request layer
(:mod:`.validation`, :mod:`.openai_api`, :mod:`.responses_api`, :mod:`.anthropic_api`,
:mod:`.llama_api`, :mod:`.infill`, :mod:`.chat`) checks, tokenizes and shapes, off the model's
thread, and talks to the model only through ``Llama``'s public calls and to the worker
(:mod:`.worker`) through a small interface (its module docstring). The worker runs ``-np``
requests at once on the engine (one runner thread each), the rest wait; a dropped or interrupted
stream frees its slot after its next token, a request beyond ``--queue-size`` waiting ones gets
a 503, bad requests get a 4xx in their API's error shape, every response carries llama-server's
``timings`` (draft counts included), ``--metrics`` serves ``GET /metrics`` and ``/`` a chat page
(:mod:`.routes.ui`; ``--no-ui``: none). SIGTERM and
SIGINT cancel the requests in flight and stop the server within seconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

GRACEFUL_SHUTDOWN_S = 3   # uvicorn waits this long for open connections after a signal
WORKER_JOIN_S = 5         # then the model's thread this long before the process exits anyway


def listen(hosts: str, port: int, reuse_port: bool = False) -> list:
    """A listening socket on ``port`` for each of llama-server's comma-separated ``--host``
    addresses (IPv4 or IPv6, e.g. ``127.0.0.1,::1``); ``reuse_port``: SO_REUSEPORT (--reuse-port)."""
    import socket

    out = []
    try:
        for host in [h.strip().strip("[]") for h in hosts.split(",") if h.strip()] or ["127.0.0.1"]:
            if host.endswith(".sock"):
                raise ValueError(f"{host}: a UNIX socket is not served here; give a TCP address (--host, --port)")
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            out.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((host, port))
            sock.listen(2048)
            sock.set_inheritable(True)
    except BaseException:
        for sock in out:
            sock.close()
        raise
    return out


def api_keys_of(args: argparse.Namespace):
    """--api-key (comma-separated) and --api-key-file's lines (# starts a comment), as llama-server
    reads them; None: no key asked for."""
    keys = [k.strip() for k in (args.api_key or "").split(",") if k.strip()] if args.api_key is not None else None
    path = getattr(args, "api_key_file", None)
    if path:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f if line.strip() and not line.strip().startswith("#")]
        keys = (keys or []) + lines
    return keys


def serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from .app import create_app
        from ..api.chat_layer import ChatTemplates
        from .openai_api import system_fingerprint
        from .validation import ModelAccess
        from .worker import ModelWorker, ServedLlama
    except ImportError as e:
        from ..errors import NativeBuildMissing

        if isinstance(e, NativeBuildMissing):  # an ImportError too, but not a missing extra
            print(f"llama-metaws serve: {e}", file=sys.stderr)
        else:
            print(f"llama-metaws serve needs the server extra (pip install 'llama-metaws[server]'): {e}",
                  file=sys.stderr)
        return 2

    from ..cli.flags import chat_options, llama_kwargs

    if args.queue_size < 0:
        print(f"llama-metaws serve: --queue-size must be >= 0, got {args.queue_size}", file=sys.stderr)
        return 2
    if args.slot_save_path is not None and not os.path.isdir(args.slot_save_path):
        print(f"llama-metaws serve: --slot-save-path {args.slot_save_path}: not a directory", file=sys.stderr)
        return 2
    try:
        api_keys = api_keys_of(args)
    except OSError as e:
        print(f"llama-metaws serve: --api-key-file {args.api_key_file}: {e}", file=sys.stderr)
        return 2
    try:
        llm = ServedLlama(args.model, **llama_kwargs(args))
    except ValueError as e:
        print(f"llama-metaws serve: {e}", file=sys.stderr)
        return 2
    try:  # llama.cpp's chat layer, as llama-server sets it up (see llama_metaws.api.chat_layer)
        templates = ChatTemplates.for_llama(llm, args.chat_template, args.chat_template_file, chat_options(args))
    except ValueError as e:
        llm.close()
        print(f"llama-metaws serve: {e}", file=sys.stderr)
        return 2
    llm.use_chat_templates(templates)  # chats run as /apply-template shows them

    def names(text):
        return [x.strip() for x in (text or "").split(",") if x.strip()]

    model = ModelAccess(llm, templates, alias=Path(args.model).name, aliases=names(args.alias),
                        tags=names(args.tags), temperature=args.temp, n_predict=args.n_predict, seed=args.seed,
                        verbose=args.verbose, spm_infill=args.spm_infill, cache_prompt=args.cache_prompt)
    alias = model.alias
    worker = ModelWorker(llm, queue_size=args.queue_size)
    app = create_app(worker, model, api_key=api_keys, metrics=args.metrics, slots=args.slots,
                     max_body_size=args.max_body_size, model_path=args.model,
                     build_info=f"llama-metaws {system_fingerprint()}", slot_save_path=args.slot_save_path,
                     cors=dict(origins=args.cors_origins, methods=args.cors_methods, headers=args.cors_headers,
                               credentials=args.cors_credentials), ui=args.ui)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM, SIGINT: cancel the request in flight too
            worker.stop()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    # uvicorn raises a caught signal again once it has stopped; let that be a no-op so the
    # model is closed below (a signal during that bounded wait is ignored too)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: None)
    try:
        sockets = listen(args.host, args.port, reuse_port=args.reuse_port)
    except (OSError, ValueError) as e:
        worker.close(timeout=WORKER_JOIN_S)
        llm.close()
        print(f"llama-metaws serve: cannot listen on {args.host} port {args.port}: {e}", file=sys.stderr)
        return 3
    print(f"llama-metaws serve: http://{args.host}:{args.port}/v1 (model {alias!r})", file=sys.stderr,
          flush=True)
    Server(config).run(sockets=sockets)
    if worker.close(timeout=WORKER_JOIN_S):
        llm.close()
    else:
        print("llama-metaws serve: the model's thread did not stop in time; exiting", file=sys.stderr,
              flush=True)
        os._exit(0)
    print("llama-metaws serve: stopped", file=sys.stderr, flush=True)
    return 0
