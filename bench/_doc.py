"""The benchmark document, bench/BENCHMARKS.md: each benchmark owns one marked section."""

from __future__ import annotations

import datetime
import platform
from pathlib import Path

DOC = Path(__file__).resolve().parent / "BENCHMARKS.md"
HEADER = """# Benchmarks

Each section below is written by the script named in it, from one run that measures the
variants side by side (interleaved), and reports ratios: the machine is shared and noisy.
Memory on CPU is exact, from ggml's own buffer accounting.
"""


def machine() -> str:
    return f"{platform.machine()}, {platform.python_implementation()} {platform.python_version()}"


def write_section(name: str, body: str) -> Path:
    """Replace (or append) the section between this benchmark's markers."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    stamp = datetime.date.today().isoformat()
    block = f"{begin}\n{body.rstrip()}\n\n_Last run: {stamp}, {machine()}._\n{end}"
    text = DOC.read_text() if DOC.exists() else HEADER
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)
    return DOC
