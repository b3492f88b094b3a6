"""The run-time manifest: which native build this checkout uses.

``llama-metaws build`` writes it after building the library and the shim; ``import
llama_metaws`` (``runtime``) reads it and never recomputes the build key from the run-time
environment (``CMAKE_ARGS``, ``CC``). It records the build directory, the shim, and what the
checkout's patches and shim sources were: a checkout whose sources changed since is stale, and
the error names the command to run.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

from . import build as _build

MANIFEST_ENV = "LLAMA_METAWS_MANIFEST"
MANIFEST_VERSION = 1


def manifest_path() -> Path:
    """``LLAMA_METAWS_MANIFEST``, else ``build/manifest.json`` in the source checkout.

    ``llama-metaws build`` writes it; ``import llama_metaws`` reads it and never recomputes
    the key from the environment (``CMAKE_ARGS``, ``CC`` at run time do not matter). A second
    build flavour (``make sanitize``) keeps a manifest of its own through the variable.
    """
    env = os.environ.get(MANIFEST_ENV)
    return Path(env) if env else _build.source_root() / "build" / "manifest.json"


def source_fingerprint(root: Optional[Path] = None) -> dict:
    """What the checkout's sources are now: the series (name, sha256) and the shim's sources."""
    root = root or _build.source_root()
    return {
        "patches": [[p.name, hashlib.sha256(p.read_bytes()).hexdigest()] for p in _build.read_series(root / "patches")],
        "native": _build.shim_key("", root / "native"),
    }


def write_manifest(b: _build.Build, path: Optional[Path] = None, tools: Optional[dict] = None) -> Path:
    """Record ``b`` (library and shim) as the build this checkout uses, and llama.cpp's tools
    (``"tools": {target: path}``, :mod:`llama_metaws_dev.tools_build`): those given, else those the
    manifest already names for the same library key while they exist."""
    path = path or manifest_path()
    made = b.manifest  # the build's own build.json: its key and inputs
    if tools is None:
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = {}
        if old.get("key") == made["key"] and all(Path(p).is_file() for p in old.get("tools", {}).values()):
            tools = old.get("tools")
    doc = dict(version=MANIFEST_VERSION, key=made["key"], build=str(b.root),
               shim=str(b.shim) if b.shim else None, cmake_args=list(made.get("cmake_args", ())),
               base_cmake_args=list(made.get("base_cmake_args", ())),
               compiler=made.get("compiler"), **source_fingerprint())
    if tools:
        doc["tools"] = {name: str(p) for name, p in tools.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(path: Optional[Path] = None) -> _build.Build:
    """The build the manifest names, checked against the checkout; BuildError says what to run."""
    path = path or manifest_path()
    run = "run `llama-metaws build` (or `make setup`)"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise _build.BuildError(f"no native build is recorded for this checkout ({path} is missing): {run}") from None
    except ValueError as e:
        raise _build.BuildError(f"the build manifest {path} is unreadable ({e}): {run}") from None
    if doc.get("version") != MANIFEST_VERSION:
        raise _build.BuildError(f"the build manifest {path} is of another version: {run}")
    now = source_fingerprint()
    if doc.get("patches") != now["patches"]:
        raise _build.BuildError(f"the build in {path} was made from another patches/series than the "
                         f"checkout's: {run}")
    if doc.get("native") != now["native"]:
        raise _build.BuildError(f"the cffi shim in {path} was built from other native/ sources: {run}")
    # a bundled build (the installed package's, ``package.write_bundled_manifest``) is named
    # relative to the manifest's folder
    root = path.parent / doc["build"]
    if not (root / "build.json").is_file():
        raise _build.BuildError(f"the build {root} named in {path} no longer exists: {run}")
    shim = path.parent / doc["shim"] if doc.get("shim") else None
    if shim is None or not shim.is_file():
        raise _build.BuildError(f"the cffi shim named in {path} no longer exists: {run}")
    if not Path(doc["build"]).is_absolute():
        root, shim = root.resolve(), shim.resolve()
    return _build.Build(root, shim, bundled=bool(doc.get("bundled")))
