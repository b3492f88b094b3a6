"""``llama-metaws serve``: llama-cpp-python's OpenAI-compatible server on the patched Llama.

The server builds its model with ``llama_cpp.Llama(**model settings)``; in this process that
name is our :class:`~llama_metaws.llama.Llama`, with the MTP, device and workspace options of
the command line added. Everything else (routes, streaming, chat templates) is the server's.
"""

from __future__ import annotations

import argparse
import sys


def serve(args: argparse.Namespace) -> int:
    from ._binding import llama_cpp  # the patched build first: the server extra loads the binding

    try:
        import uvicorn
        from llama_cpp.server.app import create_app
        from llama_cpp.server.settings import ModelSettings, ServerSettings
    except ImportError as e:
        print(f"llama-metaws serve needs llama-cpp-python's server extra "
              f"(pip install 'llama-metaws[server]'): {e}", file=sys.stderr)
        return 2

    from .flags import llama_kwargs
    from .llama import Llama

    ours = llama_kwargs(args)
    # the settings below carry these; the rest are ours alone
    settings_keys = ("n_ctx", "n_batch", "n_ubatch", "split_mode", "tensor_split", "use_mmap",
                     "verbose", "n_gpu_layers", "n_threads", "seed")
    extra = {k: v for k, v in ours.items() if k not in settings_keys}
    extra["split_mode"] = ours["split_mode"]  # the settings' integer would lose "tensor" names

    class ServedLlama(Llama):
        def __init__(self, *a, **kw):
            kw.update(extra)
            super().__init__(*a, **kw)

    settings = dict(model=args.model, n_ctx=ours["n_ctx"], n_batch=ours["n_batch"],
                    n_ubatch=ours["n_ubatch"], use_mmap=ours["use_mmap"], verbose=ours["verbose"])
    if ours.get("tensor_split"):
        settings["tensor_split"] = ours["tensor_split"]
    if "n_gpu_layers" in ours:
        settings["n_gpu_layers"] = ours["n_gpu_layers"]
    elif "devices" in ours:
        settings["n_gpu_layers"] = -1
    if "n_threads" in ours:
        settings["n_threads"] = ours["n_threads"]
    if "seed" in ours:
        settings["seed"] = ours["seed"]

    llama_cpp.Llama = ServedLlama  # this process serves the patched Llama
    app = create_app(server_settings=ServerSettings(host=args.host, port=args.port),
                     model_settings=[ModelSettings(**settings)])
    print(f"llama-metaws serve: http://{args.host}:{args.port}/v1 (model {args.model})", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
