"""A native crash in one test does not end the suite.

``make test`` (and ``make peer-tests``, and package-check's smoke run) runs pytest with the
Makefile's ``PYTEST_ISOLATION``: the tests run in a pytest-xdist worker process, so a SIGSEGV in
llama.cpp fails the test it happened in, by name ("worker 'gw0' crashed while running ..."), a
new worker takes up the tests after it, and the summary counts them all.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parent.parent

CRASHING = """\
import os, signal

def test_before():
    pass

def test_segfaults():
    os.kill(os.getpid(), signal.SIGSEGV)

def test_after():
    pass
"""


def isolation_options() -> List[str]:
    """The Makefile's PYTEST_ISOLATION, as make passes it to pytest."""
    m = re.search(r"^PYTEST_ISOLATION\s*:?=(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, "the Makefile defines no PYTEST_ISOLATION"
    return shlex.split(m.group(1))


def _pytest(tmp_path: Path, options: List[str]) -> subprocess.CompletedProcess:
    (tmp_path / "test_crashing.py").write_text(CRASHING)
    (tmp_path / "test_later.py").write_text("def test_in_a_later_file():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_CORE"))}
    return subprocess.run(
        [sys.executable, "-m", "pytest", *options, "-p", "no:cacheprovider", "-q", "-rf",
         "test_crashing.py", "test_later.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_segfault_fails_its_test_by_name_and_the_rest_still_run(tmp_path):
    res = _pytest(tmp_path, isolation_options())
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    assert re.search(r"^FAILED test_crashing\.py::test_segfaults\b.*crashed", out, re.M), out
    assert re.search(r"^1 failed, 3 passed\b", out, re.M), out


def test_without_the_isolation_the_segfault_ends_the_run(tmp_path):
    """What the isolation is for: in-process, the crash takes pytest down with no summary."""
    res = _pytest(tmp_path, ["-p", "no:xdist"])
    assert res.returncode == -signal.SIGSEGV, res.stdout + res.stderr
    assert not re.search(r"\d+ passed", res.stdout), res.stdout
