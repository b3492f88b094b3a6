"""``llama-metaws demo``: the main job on the embedded default model.

:func:`run` lists the devices, completes a prompt with the demo's tiny MTP model
(:mod:`llama_metaws.demo.model`) under tensor split with MTP drafting and the workspace, compares
the workspace modes each in its own process (:mod:`llama_metaws.tools.vram`), and prints the
compute held at a real vocabulary (:mod:`llama_metaws.demo.realshape`'s model) beside llama.cpp's
reservation.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

def default_model() -> Path:
    """The embedded default: the tiny MTP model, made once into the cache."""
    from ..demo.model import make_tiny_mtp_model
    from ..paths import cache_root

    path = cache_root() / "models" / "tiny-qwen35-mtp-agreement-0.8.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    return make_tiny_mtp_model(path, agreement=0.8)  # written anew: cheap, and always current


def run(args: argparse.Namespace, print_devices: Callable[[], None]) -> int:
    """Devices, a short MTP completion, then the workspace modes compared (memory per device) on the
    embedded tiny model."""
    from ..api.llama import Llama
    from ..tools import vram

    print_devices()
    model_path = Path(args.model) if args.model else default_model()
    devices = [d.strip() for d in args.device.split(",") if d.strip()]
    print(f"\nmodel: {model_path}")
    with Llama(str(model_path), draft="mtp", devices=devices, split_mode="tensor", n_ctx=256,
               n_batch=64, n_ubatch=64, verbose=args.verbose) as llm:
        out = llm(args.prompt, max_tokens=args.n_predict, temperature=0.0)["choices"][0]["text"]
        print(f"greedy completion of {args.prompt!r} with MTP drafting, tensor split over "
              f"{','.join(devices)}: {out!r}")
        print(f"draft acceptance {llm.draft_stats.last.acceptance:.1%}; shared workspace: " + ", ".join(
            f"{e.buffer_type} {e.allocated:,} B (alias={e.alias})" for e in llm.workspace_stats()))

    print("\nthe workspace modes compared (memory per device), each configuration in its own process "
          "(unsafe-shared is expected to die with GGML_ASSERT(tensor)):", flush=True)
    records = vram.run_configurations(model=str(model_path), devices=devices)
    print(vram.format_table(records))
    real_vocabulary_row()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("(install the plot extra for a picture: pip install -e '.[plot]')")
    else:
        print(f"plot: {vram.plot(records, args.plot)}")
    return 0 if all(vram.as_expected(r) for r in records) else 1


def real_vocabulary_row() -> None:
    """Held compute at a real vocabulary, ours beside llama.cpp's reservation with llama-server's limits."""
    from ..tools.reservation import REAL_VOCAB_SHAPE, held_side_by_side
    from ..demo.realshape import make_mtp_model

    path = make_mtp_model(**REAL_VOCAB_SHAPE)  # cached after the first demo
    side = held_side_by_side(str(path))
    print(f"\nat a real vocabulary ({side.n_vocab:,} tokens; n_embd {REAL_VOCAB_SHAPE['n_embd']}, "
          f"{REAL_VOCAB_SHAPE['n_layer']} layers, one CPU), -np 2 -ub 512 -c 4096 --spec-type draft-mtp "
          "--spec-draft-n-max 3, compute held:", flush=True)
    print("\n".join(side.lines()))
