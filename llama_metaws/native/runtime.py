"""Point llama-cpp-python at our patched libraries before it loads them.

``import llama_metaws`` calls :func:`prepare`: it checks that the installed binding is the
release our patches target, reads the build manifest that ``llama-metaws build`` wrote
(``manifest.manifest_path()``; the key is never recomputed from the run-time environment) and
sets ``LLAMA_CPP_LIB_PATH`` to its ``lib/`` directory, so that ``import llama_cpp`` and the
cffi shim load the same single copy of ``libllama`` and ``libggml*``. A missing or stale build
is not an error here (``llama-metaws build`` must be able to run); it is raised, naming the
command to run, when something needs the native layer.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

from . import build as _build
from . import manifest as _manifest
from ..errors import BindingVersionError, NativeBuildMissing
from ..paths import SDIST_VERSION

BINDING_DISTRIBUTION = "llama_cpp_python"

_current: Optional[_build.Build] = None
_missing: Optional[str] = None
_searched = False


def check_binding_version() -> None:
    try:
        installed = importlib.metadata.version(BINDING_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise BindingVersionError(
            f"llama-cpp-python is not installed; llama-metaws needs llama-cpp-python=="
            f"{SDIST_VERSION} (install it with "
            f"CMAKE_ARGS='-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF' so it skips its own native build)"
        ) from None
    if installed != SDIST_VERSION:
        raise BindingVersionError(
            f"llama-cpp-python {installed} is installed, but llama-metaws patches the llama.cpp "
            f"vendored in llama-cpp-python {SDIST_VERSION}: install "
            f"llama-cpp-python=={SDIST_VERSION}"
        )


def current_build() -> Optional[_build.Build]:
    """The build the manifest names, or None when it is missing or stale (read once per process)."""
    global _current, _missing, _searched
    if not _searched:
        _searched = True
        try:
            _current = _manifest.read_manifest()
        except _build.BuildError as e:
            _current, _missing = None, str(e)
    return _current


def require_build() -> _build.Build:
    """The build in use; NativeBuildMissing (naming the command to run) when there is none."""
    b = current_build()
    if b is None:
        raise NativeBuildMissing(_missing or "no native build: run `llama-metaws build`")
    return b


def _loaded_binding_lib_dir() -> Optional[Path]:
    mod = sys.modules.get("llama_cpp.llama_cpp")
    base = getattr(mod, "_base_path", None)
    return Path(base).resolve() if base is not None else None


def prepare() -> None:
    check_binding_version()
    b = current_build()
    if b is None:
        return
    lib_dir = str(b.lib_dir)
    loaded = _loaded_binding_lib_dir()
    if loaded is not None and loaded != b.lib_dir.resolve():
        raise ImportError(
            f"llama_cpp was imported before llama_metaws and loaded its libraries from {loaded}; "
            f"import llama_metaws first so the binding uses the patched build in {lib_dir}"
        )
    if b.bundled:  # the installed package's build: its sonames are found among loaded objects
        from . import package as _package

        _package.preload(b.lib_dir)
    current = os.environ.get("LLAMA_CPP_LIB_PATH")
    if current and Path(current).resolve() != b.lib_dir.resolve():
        warnings.warn(
            f"LLAMA_CPP_LIB_PATH={current} is replaced by the patched build {lib_dir}",
            stacklevel=3,
        )
    os.environ["LLAMA_CPP_LIB_PATH"] = lib_dir
