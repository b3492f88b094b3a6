"""The environment the suite runs in: the code's, not the shell's.

A developer's shell may export what changes what a test checks: llama-server's ``LLAMA_ARG_*``
variables (``serve`` reads them: an exported ``LLAMA_ARG_CTX_SIZE`` would change every server
test), ``CMAKE_ARGS`` (a build key computed by a test, or by a ``llama-metaws build`` it starts,
would name another build than the one under test, and build it), the package's own switches.
:func:`suite_environment` gives the environment without them, pinned to the build under test;
``tests/conftest.py`` applies it to ``os.environ`` once, before any test runs, so every test and
every process a test starts sees it.

Kept: what says which build is under test (``LLAMA_METAWS_MANIFEST``, ``LLAMA_METAWS_CACHE``,
``LLAMA_METAWS_SOURCE_ROOT``, and ``LLAMA_METAWS_LLAMA_SOURCE`` where that build was made from a
pre-patched tree: the GPU run kit's), and the suite's own knobs (:data:`SUITE_KNOBS`).
"""

from __future__ import annotations

import shlex
from typing import Mapping

from llama_metaws.native.build import PATCHED_SOURCE_ENV, Build

#: the package's variables that choose the build under test: kept as they are
BUILD_CHOICE = ("LLAMA_METAWS_MANIFEST", "LLAMA_METAWS_CACHE", "LLAMA_METAWS_SOURCE_ROOT")
#: the suite's own knobs (docs/development.md): kept
SUITE_KNOBS = ("LLAMA_METAWS_TEST_DEVICES", "LLAMA_METAWS_SWEEP_STRIDE", "LLAMA_METAWS_FUZZ_SEED",
               "LLAMA_METAWS_FUZZ_CASES")


def suite_environment(environ: Mapping[str, str], build: Build) -> dict:
    """``environ`` as the suite runs with it, for the build under test ``build``."""
    env = {k: v for k, v in environ.items()
           if not k.startswith("LLAMA_ARG_")
           and not (k.startswith("LLAMA_METAWS_") and k not in BUILD_CHOICE + SUITE_KNOBS)}
    made = build.manifest
    # the arguments the build under test was made with: a key computed here is that build's
    env.pop("CMAKE_ARGS", None)
    if made.get("cmake_args"):
        env["CMAKE_ARGS"] = shlex.join(made["cmake_args"])
    if made.get("source") and PATCHED_SOURCE_ENV in environ:
        env[PATCHED_SOURCE_ENV] = environ[PATCHED_SOURCE_ENV]
    # the binding loads the build's libraries (import llama_metaws set it in this process already)
    env["LLAMA_CPP_LIB_PATH"] = str(build.lib_dir)
    return env
