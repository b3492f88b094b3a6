"""``llama-metaws serve``: OpenAI's API and llama-server's own on the patched ``Llama``.

llama-cpp-python's request types and ``Llama.create_completion`` / ``create_chat_completion``
(stop strings, seeds, logprobs, grammars; chats through llama.cpp's own chat layer,
:mod:`llama_metaws.chat_layer`) do the work; the serving around them is ours: the request layer
(:mod:`.requests`, :mod:`.openai_api`, :mod:`.llama_api`, :mod:`.chat`, :mod:`.app`) checks, tokenizes and shapes, off the model's thread, and talks to the
model only through ``Llama``'s public calls and to the worker (:mod:`.worker`) through a small
interface (its module docstring), so the scheduler under it can change. One thread owns the model
and runs one request at a time, a dropped or interrupted stream frees it after its next token, a
request that waits while ``--queue-size`` others wait already gets a 503, bad requests get a 4xx
in their API's error shape, every response carries llama-server's ``timings`` (draft counts
included) and ``--metrics`` serves ``GET /metrics``. SIGTERM and SIGINT cancel the request in
flight and stop the server within seconds.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

GRACEFUL_SHUTDOWN_S = 3   # uvicorn waits this long for open connections after a signal
WORKER_JOIN_S = 5         # then the model's thread this long before the process exits anyway


def serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from .app import create_app
        from ..chat_layer import ChatTemplates
        from .openai_api import system_fingerprint
        from .requests import ModelAccess
        from .worker import ModelWorker, ServedLlama
    except ImportError as e:
        print(f"llama-metaws serve needs the server extra (pip install 'llama-metaws[server]'): {e}",
              file=sys.stderr)
        return 2

    from ..flags import chat_options, llama_kwargs

    if args.queue_size < 0:
        print(f"llama-metaws serve: --queue-size must be >= 0, got {args.queue_size}", file=sys.stderr)
        return 2
    try:
        llm = ServedLlama(args.model, **llama_kwargs(args))
    except ValueError as e:
        print(f"llama-metaws serve: {e}", file=sys.stderr)
        return 2
    try:  # llama.cpp's chat layer, as llama-server sets it up (see llama_metaws.chat_layer)
        templates = ChatTemplates.for_llama(llm, args.chat_template, args.chat_template_file, chat_options(args))
    except ValueError as e:
        llm.close()
        print(f"llama-metaws serve: {e}", file=sys.stderr)
        return 2
    llm.use_chat_templates(templates)  # chats run as /apply-template shows them
    alias = args.alias or Path(args.model).name
    model = ModelAccess(llm, templates, alias=alias, temperature=args.temp, n_predict=args.n_predict)
    worker = ModelWorker(llm, queue_size=args.queue_size)
    app = create_app(worker, model, api_key=args.api_key, metrics=args.metrics, slots=args.slots,
                     max_body_size=args.max_body_size, model_path=args.model,
                     build_info=f"llama-metaws {system_fingerprint()}")

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
    print(f"llama-metaws serve: http://{args.host}:{args.port}/v1 (model {alias!r})", file=sys.stderr,
          flush=True)
    Server(config).run()
    if worker.close(timeout=WORKER_JOIN_S):
        llm.close()
    else:
        print("llama-metaws serve: the model's thread did not stop in time; exiting", file=sys.stderr,
              flush=True)
        os._exit(0)
    print("llama-metaws serve: stopped", file=sys.stderr, flush=True)
    return 0
