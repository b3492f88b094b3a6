"""expected_failures.txt: the suite's tests (or whole files) that cannot pass here, and why.

A line is ``ENTRY | CATEGORY: REASON`` (the first `` | `` separates them). ENTRY is a test's node id as pytest prints it
(``unit/test_x.py::test_y[param]``), a prefix of node ids ending in ``*``, or a file
(``unit/test_x.py``: not run at all). CATEGORY is one of CATEGORIES. ``#`` starts a comment.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

CATEGORIES = {
    "real-model": "asserts the text or the behaviour of llama.cpp's downloaded test model",
    "embedding": "needs an embedding or reranking model",
    "multimodal": "needs multimodal input (an image or audio model)",
    "not-served": "a route or flag not served yet",
    "out-of-scope": "a llama-server feature outside issue 35's scope",
}
# the categories that leave the goal's denominator: a tiny stand-in cannot write that text
NOT_COUNTED = ("real-model",)


@dataclass
class Entry:
    pattern: str
    category: str
    reason: str

    @property
    def is_file(self) -> bool:
        return "::" not in self.pattern and not self.pattern.endswith("*")

    def matches(self, nodeid: str) -> bool:
        if self.pattern.endswith("*"):
            return nodeid.startswith(self.pattern[:-1])
        if self.is_file:
            return nodeid.split("::", 1)[0] == self.pattern
        return nodeid == self.pattern


def load_expected(path: Path) -> List[Entry]:
    entries = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip() if line.lstrip().startswith("#") else line.strip()
        if not line:
            continue
        if " | " not in line:
            raise ValueError(f"{path}:{n}: expected 'ENTRY | CATEGORY: REASON', got {line!r}")
        pattern, rest = (x.strip() for x in line.split(" | ", 1))
        category, _, reason = rest.partition(":")
        category = category.strip()
        if category not in CATEGORIES or not reason.strip():
            raise ValueError(f"{path}:{n}: category must be one of {', '.join(CATEGORIES)} "
                             f"followed by ': reason', got {rest!r}")
        entries.append(Entry(pattern, category, reason.strip()))
    return entries


def match(entries: List[Entry], nodeid: str) -> Optional[Entry]:
    """The most specific entry for a node id (an exact id over a prefix over a file)."""
    best = None
    for e in entries:
        if e.matches(nodeid):
            if best is None or (not e.pattern.endswith("*") and not e.is_file) or \
                    (best.is_file and not e.is_file):
                best = e
    return best
