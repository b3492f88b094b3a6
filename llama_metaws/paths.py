"""Where llama-metaws keeps its files, and the binding it is pinned to.

The user's cache (builds, downloaded sources, models the demo and the benches write, the cost
curves of ``draft_max="auto"``) and the llama-cpp-python release whose vendored llama.cpp the
patch series is written against. Modules that need a folder or the pinned version read them here,
not from the builder (:mod:`llama_metaws.native.build`), which imports them too.
"""

from __future__ import annotations

import os
from pathlib import Path

#: the binding whose sdist vendors the llama.cpp the patches apply to
SDIST_PROJECT = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_FILENAME = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
#: the vendored llama.cpp's folder inside that sdist
VENDOR_PREFIX = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/"

#: overrides the cache folder
CACHE_ENV = "LLAMA_METAWS_CACHE"


def cache_root() -> Path:
    """``LLAMA_METAWS_CACHE``, else ``$XDG_CACHE_HOME/llama-metaws`` (``~/.cache``)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "llama-metaws"
