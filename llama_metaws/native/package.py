"""The native build inside an installed package: what ``pip install`` of our sdist puts in the wheel.

``setup.py`` runs :func:`stage_wheel` when setuptools builds the wheel (``pip install``, ``pip
wheel``, ``python -m build``): the native build of :mod:`llama_metaws.native.build` (the same six
steps, the same cache key, ``CMAKE_ARGS`` passed through, a cache hit when the key was built
before), then it copies into the wheel's tree:

- ``llama_metaws/_native/<key>/``: the build's shared libraries (``lib/``, by the names the
  binding loads: see :func:`library_files`), its ``build.json`` and the compiled cffi shim
  (``shim/<shim key>/``), laid out as in the cache;
- ``llama_metaws/_source/``: ``patches/`` and ``native/`` (everything the build reads), so that
  ``llama-metaws build`` works in the installed package too (``build.source_root`` falls back to
  it), and the run-time manifest ``_source/build/manifest.json`` that names the bundled build by
  paths relative to itself (``"bundled": true``).

With ``LLAMA_METAWS_BUILD_AT_INSTALL=0`` the wheel carries ``_source/`` only (a pure wheel:
``llama-metaws build`` compiles on first use; the GPU run kit's wheel is made so, its device
builds for CUDA from the kit's pre-patched tree).

The bundled libraries keep their ``$ORIGIN`` rpath but a wheel cannot hold the install's soname
symlinks, so :func:`preload` loads them by path, dependencies first, before the binding or the
shim does: the dynamic loader then finds each soname (``libggml.so.0``, ...) among the loaded
objects, and one copy of every library serves the binding, the shim and each other.

Only the standard library and :mod:`.build` / :mod:`.manifest` are used: ``setup.py`` loads
this module from the source tree without importing the package (whose ``__init__`` checks the
binding, which is not installed in pip's isolated build environment).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import sys
from pathlib import Path
from typing import List, Optional

from . import build as _build
from . import manifest as _manifest

#: Under the installed package: the bundled build and the build's own sources.
BUNDLE_DIR = "_native"
SOURCE_DIR = "_source"
#: ``0``: the wheel carries the sources only; ``llama-metaws build`` compiles on first use.
AT_INSTALL_ENV = "LLAMA_METAWS_BUILD_AT_INSTALL"
#: The shim's sources: what ``build.shim_key`` hashes and ``native/build_shim.py`` compiles.
NATIVE_SUFFIXES = (".h", ".c", ".cpp", ".py")


def build_at_install() -> bool:
    return os.environ.get(AT_INSTALL_ENV, "1").strip().lower() not in ("0", "no", "off", "false")


def announce(text: str) -> None:
    """A line the user sees: on stderr (``pip install -v`` shows it), and on the terminal
    (``/dev/tty``) when stderr is not one, as under pip without ``-v``, which hides the build's
    output behind its spinner."""
    print(text, file=sys.stderr, flush=True)
    try:
        if sys.stderr.isatty():
            return
    except (AttributeError, ValueError):
        pass
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(f"\n{text}\n")
    except OSError:  # no controlling terminal (CI, a service): stderr is all there is
        pass


# --------------------------------------------------------------------------------------------
# What goes into the wheel


def copy_sources(root: Path, dest: Path) -> None:
    """``patches/`` (the series and the patches it names) and ``native/`` (the shim's sources)."""
    patches = _build.read_series(root / "patches")
    (dest / "patches").mkdir(parents=True, exist_ok=True)
    shutil.copy2(root / "patches" / "series", dest / "patches" / "series")
    for p in patches:
        shutil.copy2(p, dest / "patches" / p.name)
    for p in sorted((root / "native").rglob("*")):
        if p.is_file() and p.suffix in NATIVE_SUFFIXES and "__pycache__" not in p.parts:
            out = dest / "native" / p.relative_to(root / "native")
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, out)


def library_files(lib_dir: Path) -> List[Path]:
    """The build's shared libraries by their unversioned names (``libllama.so``, ``libggml.so``,
    ``libggml-*.so``: the names the binding loads), each resolving to the real file."""
    return sorted(p for p in lib_dir.glob("lib*.so") if p.is_file())


def copy_build(b: _build.Build, dest: Path) -> _build.Build:
    """The libraries, ``build.json`` and the shim of ``b`` under ``dest`` (files, no symlinks)."""
    (dest / "lib").mkdir(parents=True, exist_ok=True)
    for p in library_files(b.lib_dir):
        shutil.copyfile(p.resolve(), dest / "lib" / p.name)
    shutil.copy2(b.root / "build.json", dest / "build.json")
    if b.shim is None:
        raise _build.BuildError(f"the build {b.root} has no compiled shim")
    shim = dest / "shim" / b.shim.parent.name / b.shim.name
    shim.parent.mkdir(parents=True)
    shutil.copy2(b.shim, shim)
    return _build.Build(dest, shim)


def write_bundled_manifest(bundle: _build.Build, path: Path) -> Path:
    """The run-time manifest of a bundled build: paths relative to the manifest's folder."""
    _manifest.write_manifest(bundle, path=path, tools={})
    doc = json.loads(path.read_text())
    doc["build"] = os.path.relpath(bundle.root, path.parent)
    doc["shim"] = os.path.relpath(bundle.shim, path.parent)
    doc["bundled"] = True
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def stage_wheel(build_lib: Path, progress: _build.Progress = _build._stderr_progress) -> Optional[Path]:
    """Put the sources, and unless ``LLAMA_METAWS_BUILD_AT_INSTALL=0`` the native build, into
    ``build_lib/llama_metaws``; returns the bundled manifest (None without a build)."""
    root = _build.source_root()
    pkg = build_lib / "llama_metaws"
    src = pkg / SOURCE_DIR
    if src.exists():
        shutil.rmtree(src)
    copy_sources(root, src)
    if not build_at_install():
        announce(f"llama-metaws: {AT_INSTALL_ENV}=0: no native build in this wheel; "
                 "run `llama-metaws build` after installing")
        return None
    inputs = _build.BuildInputs.collect()
    if _build.find_build(inputs) is None:
        announce("llama-metaws: compiling the patched llama.cpp and the cffi shim (build "
                 f"{inputs.key()}, CMAKE_ARGS: {' '.join(inputs.cmake_args) or 'none, the CPU'}): "
                 "this takes minutes (17 for the CPU on 2 busy cores here, longer for CUDA); "
                 "`pip install -v` shows its progress")
    else:
        progress(f"llama-metaws: native build {inputs.key()} found in the cache")
    b = _build.build(progress)
    bundle = pkg / BUNDLE_DIR
    if bundle.exists():
        shutil.rmtree(bundle)
    staged = copy_build(b, bundle / b.root.name)  # named by its key, as in the cache
    path = write_bundled_manifest(staged, src / "build" / "manifest.json")
    progress(f"llama-metaws: build {inputs.key()} bundled into the wheel ({BUNDLE_DIR}/{b.root.name}/)")
    return path


# --------------------------------------------------------------------------------------------
# At run time


def _load_order(libs: List[Path]) -> List[Path]:
    """ggml-base first, then the backends, then ggml, then llama: each after what it needs."""

    def rank(p: Path) -> int:
        name = p.name
        if name.startswith("libggml-base"):
            return 0
        if name.startswith("libggml-"):
            return 1
        if name.startswith("libggml"):
            return 2
        return 3

    return sorted(libs, key=lambda p: (rank(p), p.name))


def preload(lib_dir: Path) -> None:
    """Load a bundled build's libraries by path, each after those it needs (see the module's
    docstring); a library that still fails names itself and the loader's reason."""
    pending = _load_order(library_files(lib_dir))
    while pending:
        failed, errors = [], []
        for p in pending:
            try:
                ctypes.CDLL(str(p))
            except OSError as e:
                failed.append(p)
                errors.append(str(e))
        if len(failed) == len(pending):
            raise OSError(f"cannot load the bundled native build in {lib_dir}: " + "; ".join(errors))
        pending = failed
