"""The benchmark document, bench/BENCHMARKS.md: each benchmark owns one marked section."""

from __future__ import annotations

import argparse
import datetime
import platform
from pathlib import Path
from typing import Callable

DOC = Path(__file__).resolve().parent / "BENCHMARKS.md"
HEADER = """# Benchmarks

Every figure below is from the 2-core CPU machine (the CPU test bed: the CPU device listed twice
for tensor split), except the section "On a GPU", which the GPU run kit wrote on one NVIDIA
H200 (one GPU listed twice; no machine with two GPUs has been lent yet).

Each section below is written by the script named in it, from one run that measures the
variants side by side (interleaved), and reports ratios: the machine is shared and noisy.
Memory on CPU is exact, from ggml's own buffer accounting.
"""


def machine() -> str:
    return f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}"


def write_section(name: str, body: str, where: str = "") -> Path:
    """Replace (or append) the section between this benchmark's markers; ``where`` names the
    machine that ran it (default: this one)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    stamp = datetime.date.today().isoformat()
    block = f"{begin}\n{body.rstrip()}\n\n_Last run: {stamp}, {where or machine()}._\n{end}"
    text = DOC.read_text() if DOC.exists() else HEADER
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)
    return DOC


def publish(name: str, table: str, write: bool, where: str = "") -> str:
    """Print a benchmark's table and, unless told not to, write it into its section."""
    print(table)
    if write:
        print(f"\nwritten to {write_section(name, table, where)}")
    return table


def main(doc: str, run: Callable[..., str], runs: int, tokens: int) -> None:
    """The command line every benchmark shares: --runs, --tokens, --no-write."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--runs", type=int, default=runs, help=f"interleaved requests per variant ({runs})")
    ap.add_argument("--tokens", type=int, default=tokens, help=f"tokens generated per request ({tokens})")
    ap.add_argument("--no-write", action="store_true", help="print only")
    a = ap.parse_args()
    run(a.runs, a.tokens, write=not a.no_write)
