"""llama.cpp's own tools from the same patched tree: ``llama-metaws build --tools``.

``llama-speculative-simple``, ``llama-bench``, ``llama-server`` and ``llama-batched-bench`` (only
those targets) are built with ``LLAMA_BUILD_COMMON=ON`` through the library build's steps (:func:`build.prepare_source`, the
same work-directory layout, so with ccache the objects the two builds share are cache hits) into
``<cache>/tools/<tools key>/bin``: the executables and the shared libraries they load through their
``$ORIGIN`` rpath. The tools key is the library's inputs plus the targets and their CMake
arguments. :func:`find_tools` returns their paths; the run-time manifest lists them under
``tools``. When the library is not built yet, :func:`build_with_tools` (``build --tools``) compiles
the tools in the library's own CMake tree, after its install: ggml and llama once for both.

``llama-server`` (``LLAMA_BUILD_SERVER=ON``, which also brings in mtmd and cpp-httplib) embeds its web
UI's assets at build time; ``LLAMA_USE_PREBUILT_UI=OFF`` and ``LLAMA_BUILD_UI=OFF`` keep that step
from downloading them (from a Hugging Face bucket) or running npm, so the build works offline: the
server is built with an empty UI table (its HTTP API is all the benchmarks use).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

from llama_metaws.native.build import (
    BASE_CMAKE_ARGS,
    STEPS,
    Build,
    BuildError,
    BuildInputs,
    Progress,
    _cmake,
    _generator_args,
    _ninja_progress,
    _run_streamed,
    _sha256_bytes,
    _stderr_progress,
    build_library,
    cache_root,
    find_build,
    prepare_source,
    read_series,
    source_root,
)


#: The executables ``build --tools`` makes (only these targets are built).
TOOL_TARGETS = ("llama-speculative-simple", "llama-bench", "llama-server", "llama-batched-bench")
#: Bump when the tools' steps change in a way that changes what they produce.
TOOLS_RECIPE_VERSION = 1
# After BASE_CMAKE_ARGS (a later -D wins): the common library, the tools and examples that hold
# the targets, the server (its web UI neither downloaded nor built: offline, an empty asset table),
# and an rpath of $ORIGIN in the build tree (executables and shared libraries, the server's and
# batched-bench's own -impl libraries among them, all land in bin/, which is kept as it is).
TOOLS_CMAKE_ARGS = (
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_EXAMPLES=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
)


def tools_key(inputs: BuildInputs) -> str:
    """The library inputs plus the tool targets and their CMake arguments."""
    doc = json.dumps(dict(dataclasses.asdict(inputs), tools=list(TOOL_TARGETS),
                          tools_cmake_args=list(TOOLS_CMAKE_ARGS), tools_recipe=TOOLS_RECIPE_VERSION),
                     sort_keys=True).encode()
    return _sha256_bytes(doc)[:20]


def tools_dir_for(inputs: BuildInputs) -> Path:
    return cache_root() / "tools" / tools_key(inputs)


def find_tools(inputs: Optional[BuildInputs] = None) -> Optional[dict]:
    """``{target: path}`` of the tools built for these inputs (the current ones), or None."""
    inputs = inputs or BuildInputs.collect()
    root = tools_dir_for(inputs)
    if not (root / "tools.json").is_file():
        return None
    found = {name: root / "bin" / name for name in TOOL_TARGETS}
    return found if all(p.is_file() for p in found.values()) else None


def _configure_and_compile(inputs: BuildInputs, src: Path, bdir: Path, env: Dict[str, str],
                           say: Callable[[str], None], progress: Progress) -> None:
    """Configure ``bdir`` (a CMake tree of ``src``, new or the library's) with the tools' arguments
    and build only :data:`TOOL_TARGETS`."""
    say("cmake " + " ".join((*TOOLS_CMAKE_ARGS, *inputs.cmake_args)))
    cmd = [_cmake(), "-S", str(src), "-B", str(bdir), *_generator_args(), *BASE_CMAKE_ARGS,
           *TOOLS_CMAKE_ARGS, *inputs.cmake_args]
    _run_streamed(cmd, None, lambda line: None, "tools configure step: cmake", env)
    say(f"compiling {', '.join(TOOL_TARGETS)} with {os.cpu_count()} jobs")
    _run_streamed([_cmake(), "--build", str(bdir), "--parallel", str(os.cpu_count() or 1),
                   "--target", *TOOL_TARGETS],
                  None, _ninja_progress(progress), "tools build step: cmake --build", env)


def _keep(inputs: BuildInputs, work: Path, t0: float, how: str, progress: Progress) -> dict:
    """``work`` (holding ``bin/``) becomes the tools' cache entry, ``tools.json`` written last."""
    key, final = tools_key(inputs), tools_dir_for(inputs)
    manifest = dict(dataclasses.asdict(inputs), key=key, tools=list(TOOL_TARGETS),
                    tools_cmake_args=list(TOOLS_CMAKE_ARGS), built=how,
                    seconds=round(time.monotonic() - t0, 1))
    (work / "tools.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(work, final)
    progress(f"llama-metaws: built tools {key} in {time.monotonic() - t0:.0f} s ({final})")
    found = find_tools(inputs)
    if found is None:
        raise BuildError(f"tools step: {', '.join(TOOL_TARGETS)} missing from {final / 'bin'}")
    return found


def build_tools(inputs: BuildInputs, progress: Progress = _stderr_progress, *, force: bool = False) -> dict:
    """Fetch, unpack, patch, configure and build only :data:`TOOL_TARGETS`; cached by
    :func:`tools_key` in ``<cache>/tools/<key>/bin`` (the executables and the shared libraries
    they load through their ``$ORIGIN`` rpath). Returns ``{target: path}``.

    The steps and the work-directory layout are the library build's, so with ccache the
    objects both builds share (ggml, llama) are cache hits. Where neither is built yet,
    :func:`build_with_tools` compiles them once, in one tree.
    """
    key = tools_key(inputs)
    final = tools_dir_for(inputs)
    found = find_tools(inputs)
    if found is not None and not force:
        progress(f"llama-metaws: tools {key} are up to date ({final})")
        return found

    patches = read_series(source_root() / "patches")
    n = len(STEPS)
    t0 = time.monotonic()

    def step(i: int, text: str) -> None:
        progress(f"[{i}/{n}] tools {STEPS[i - 1]}: {text}")

    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=final.parent))
    try:
        src = work / "src"
        prepare_source(inputs, src, patches, step, progress)
        env = dict(os.environ, CCACHE_BASEDIR=str(work), CCACHE_NOHASHDIR="1")
        bdir = work / "cmake-build"
        said = iter((4, 5))
        _configure_and_compile(inputs, src, bdir, env, lambda text: step(next(said), text), progress)
        step(6, f"executables and their libraries into {final / 'bin'}")
        os.replace(bdir / "bin", work / "bin")
        shutil.rmtree(bdir)
        shutil.rmtree(src)  # the library build keeps the patched tree; the tools need only bin/
        return _keep(inputs, work, t0, "own tree", progress)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def build_in_tree(inputs: BuildInputs, src: Path, bdir: Path, env: Dict[str, str],
                  progress: Progress = _stderr_progress) -> dict:
    """The tools compiled in ``bdir``, an existing CMake tree of ``src`` (the library build's,
    after its install): reconfigured with the tools' arguments, which change no compile command
    of ggml or llama (their objects are kept; the shared libraries are relinked for the
    ``$ORIGIN`` rpath), then only :data:`TOOL_TARGETS` built; ``bdir/bin`` becomes the tools'
    cache entry. Returns ``{target: path}``."""
    t0 = time.monotonic()
    final = tools_dir_for(inputs)
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=final.parent))
    try:
        _configure_and_compile(inputs, src, bdir, env, lambda text: progress(f"  tools, in the library's tree: {text}"),
                               progress)
        os.replace(bdir / "bin", work / "bin")
        return _keep(inputs, work, t0, "in the library's tree", progress)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def build_with_tools(inputs: BuildInputs, progress: Progress = _stderr_progress, *,
                     force: bool = False) -> Tuple[Build, dict]:
    """The library and the tools: ``(Build, {target: path})``.

    Where the library is not built yet, the tools are compiled in its CMake tree right after
    its install (:func:`build_in_tree` as :func:`build.build_library`'s ``then``): ggml and llama
    are compiled once for both, which on a GPU machine without ccache saves a second CUDA build
    (the GPU run kit's build step). A cached library gets the tools' own tree
    (:func:`build_tools`). When the tools fail to build, the library is still kept, and the
    :class:`BuildError` says so.
    """
    lib = find_build(inputs)
    if lib is not None and not force:
        return lib, build_tools(inputs, progress)
    if find_tools(inputs) is not None and not force:
        return build_library(inputs, progress), build_tools(inputs, progress)
    made: Dict[str, object] = {}

    def then(src: Path, bdir: Path, env: Dict[str, str]) -> None:
        try:
            made["tools"] = build_in_tree(inputs, src, bdir, env, progress)
        except BuildError as e:  # the library is built: keep it
            made["error"] = e

    lib = build_library(inputs, progress, force=force, then=then)
    if "error" in made:
        raise BuildError(f"{made['error']} (the library was built and kept: {lib.root})")
    return lib, made["tools"]  # type: ignore[return-value]
