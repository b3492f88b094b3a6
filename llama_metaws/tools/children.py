"""Child processes for cases that may abort: their environment, the assert they die on, the verdict.

``repro`` and the ``vram`` harness run each case in its own process, since some are expected
to end in a ``GGML_ASSERT`` abort. Both start them and read them back through here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
from typing import Dict, List, Optional, Sequence

_ASSERT = re.compile(r"(?:(\S+):(\d+): )?(GGML_ASSERT\(.*?\) failed)")


def child_env() -> Dict[str, str]:
    """The environment of a case that may abort: ggml's abort would otherwise attach gdb for a
    backtrace (slow, and it hangs under AddressSanitizer); the assert line is all we read."""
    return dict(os.environ, GGML_NO_BACKTRACE="1")


def find_assert(stderr: str) -> Optional[str]:
    """``"file.cpp:123: GGML_ASSERT(x) failed"`` from a child's stderr, or None."""
    m = _ASSERT.search(stderr or "")
    if not m:
        return None
    where = f"{os.path.basename(m.group(1))}:{m.group(2)}: " if m.group(1) else ""
    return where + m.group(3)


@dataclasses.dataclass
class ChildResult:
    returncode: Optional[int]  # None: killed at the timeout
    stdout: str
    stderr: str
    timeout: float

    @property
    def stdout_lines(self) -> List[str]:
        return self.stdout.strip().splitlines()

    def verdict(self) -> tuple:
        """``(result, message)``: ``"ok"`` (exit 0; the last stdout line), ``"assert"`` (the
        assert it died on), or ``"error"`` (a time-out, else the last line it printed)."""
        out = self.stdout_lines
        if self.returncode == 0:
            return "ok", out[-1] if out else ""
        if self.returncode is None:
            return "error", f"timed out after {self.timeout:g} s"
        found = find_assert(self.stderr)
        if found:
            return "assert", found
        tail = [ln for ln in self.stderr.strip().splitlines() if ln.strip()]
        last = out[-1] if out else (tail[-1] if tail else "")
        return "error", last or f"exit status {self.returncode}"


def run_child(cmd: Sequence[str], *, input: Optional[str] = None, timeout: float = 300) -> ChildResult:
    """Run ``cmd`` with :func:`child_env`; a time-out is a result, not an exception."""
    try:
        proc = subprocess.run(list(cmd), input=input, capture_output=True, text=True, timeout=timeout,
                              env=child_env())
        return ChildResult(proc.returncode, proc.stdout, proc.stderr, timeout)
    except subprocess.TimeoutExpired as e:
        def text(x):
            return x.decode("utf-8", "replace") if isinstance(x, bytes) else (x or "")
        return ChildResult(None, text(e.stdout), text(e.stderr), timeout)
