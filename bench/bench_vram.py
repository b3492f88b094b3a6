"""The seed's comparison table on the CPU test bed, from ``llama-metaws vram``'s harness.

Each configuration (no workspace, unsafe-shared, private-meta and alias under tensor split over
``CPU,CPU``; alias under layer split) runs in its own process with the tiny agreement model and
``-np 2``; the peaks are exact compute bytes from ggml's accounting, read after every decode
from model load on. Writes the table into bench/BENCHMARKS.md.

    .venv/bin/python bench/bench_vram.py [--no-write]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_metaws  # noqa: E402,F401
from llama_metaws.tools import vram  # noqa: E402

import _doc  # noqa: E402


def run(runs: int, n_tokens: int, write: bool = True) -> str:
    records = vram.run_configurations(n_predict=n_tokens, requests=runs)
    peaks = {r["name"]: r["peak"] for r in records}
    alias, private = peaks["alias (tensor)"], peaks["private-meta (tensor)"]
    saved = {d: private[d] - alias[d] for d in ("CPU0", "CPU1")}
    lines = [
        "## The seed's table on the CPU test bed (bench/bench_vram.py, `llama-metaws vram`)",
        "",
        f"Tiny qwen35 MTP model (agreement 0.8), `CPU,CPU`, `-np 2`, {runs} requests of {n_tokens} "
        "tokens per configuration, each configuration in its own process; peaks from model load on. "
        "tokens/s here is one process each, not interleaved: read it as an indication only.",
        "",
        "```",
        vram.format_table(records),
        "```",
        "",
        f"The alias saves **{saved['CPU0']:,} B on CPU0 and {saved['CPU1']:,} B on CPU1** against "
        "private meta buffers: the draft's prompt-phase compute, which private meta buffers hold next "
        "to the target's. (The seed: 130 MiB per GPU with a 27B model, -c 16384, -ub 512.)",
    ]
    return _doc.publish("bench_vram", "\n".join(lines), write)


if __name__ == "__main__":
    _doc.main(__doc__, run, runs=2, tokens=32)
