"""The native build: the patched llama.cpp and the cffi shim over it.

Steps (``llama-metaws build``):

1. fetch the llama-cpp-python sdist through pip and check its sha256;
2. unpack its vendored llama.cpp;
3. apply ``patches/series`` in order;
4. configure with CMake (CPU by default; ``CMAKE_ARGS`` is passed through);
5. build;
6. install the shared libraries and headers, then build the cffi shim against them.

The result lives in ``<cache>/builds/<key>``, where the key hashes every input that changes
the output: the sdist hash, the content of each patch in the series, the CMake arguments and
the compiler's version.

A pre-patched source (``LLAMA_METAWS_LLAMA_SOURCE=DIR``, as the GPU run kit carries it: see
``llama_metaws_dev.gpukit``) replaces steps 1-3 on a machine that cannot fetch the sdist. Its
``lmws-source.json`` names the sdist hash, the patches it holds and the hash of the tree; the
patches must be those of the current series, and the tree's hash joins the key (a trimmed tree
is another input than the whole sdist, so it gets a key of its own) and is checked before the
build. An unchanged series finds its directory and returns at once; a changed
patch gets a new key and a fresh build. The shim has a key of its own (the library key plus the
shim's sources), so editing a declaration rebuilds the shim only.

Only ``BuildError`` leaves this module on a failure; its message names the step, and for a
patch that does not apply, the patch and the file and hunk git reported.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from ..paths import SDIST_FILENAME, SDIST_PROJECT, SDIST_SHA256, SDIST_VERSION, VENDOR_PREFIX, cache_root

# Bump when the steps below change in a way that changes what they produce.
RECIPE_VERSION = 1

# What the binding and the shim need, nothing more: llama.cpp's common library (its chat layer,
# common/chat.h, which the shim's chat_layer.cpp wraps; installed as lib/libllama-common.so), no
# tools, tests or the app. The RPC
# backend is on for everyone (``rpc_servers=``, ``llama-metaws rpc-server``), and so is ggml's
# testing option GGML_ALLOC_FAULT_INJECTION (patch 0004, off in ggml's default build): this build
# is the one the plugin's tests, the sanitizer run and the GPU kit run on, and they fail
# allocations through ``inject_alloc_failure``; ``CMAKE_ARGS=-DGGML_ALLOC_FAULT_INJECTION=OFF``
# builds without it. Users get it too: one uncontended lock per buffer allocation, which
# bench/bench_fault_hook.py measures as no cost at load or per request (bench/BENCHMARKS.md), so
# one build serves both and CI builds the library once. These arguments join the key (``BuildInputs.base_cmake_args``), so
# changing them is a new build.
BASE_CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_RPC=ON",
    "-DGGML_ALLOC_FAULT_INJECTION=ON",
    "-DCMAKE_INSTALL_LIBDIR=lib",
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
)

STEPS = ("fetch", "unpack", "patch", "configure", "build", "install")

# A pre-patched llama.cpp tree to build instead of fetching the sdist (the GPU run kit's).
PATCHED_SOURCE_ENV = "LLAMA_METAWS_LLAMA_SOURCE"
SOURCE_MANIFEST = "lmws-source.json"

Progress = Callable[[str], None]


class BuildError(RuntimeError):
    """A step of the native build failed; the message says which and why."""


def _stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Where things are


def source_root() -> Path:
    """What holds ``patches/`` and ``native/``: ``LLAMA_METAWS_SOURCE_ROOT``, else the source
    checkout (or unpacked sdist) this module lives in, else the installed package's ``_source/``
    (the copy ``pip install`` puts there: :mod:`llama_metaws.native.package`)."""
    env = os.environ.get("LLAMA_METAWS_SOURCE_ROOT")
    if env:
        candidates = [Path(env)]
    else:
        here = Path(__file__).resolve()
        candidates = [here.parents[2], here.parents[1] / "_source"]
    for root in candidates:
        if (root / "patches" / "series").is_file():
            return root
    raise BuildError(
        f"no patches/series under {' or '.join(str(c) for c in candidates)}: llama-metaws builds "
        "from its source checkout (`pip install -e .`) or from its sdist (`pip install "
        "llama_metaws-*.tar.gz`), or set LLAMA_METAWS_SOURCE_ROOT"
    )


# --------------------------------------------------------------------------------------------
# The key


def read_series(patches_dir: Path) -> List[Path]:
    """The patches named in ``series``, in order; blank lines and ``#`` comments are skipped."""
    series = patches_dir / "series"
    out = []
    for raw in series.read_text().splitlines():
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        path = patches_dir / name
        if not path.is_file():
            raise BuildError(f"patch step: {series} names {name}, which does not exist")
        out.append(path)
    return out


#: The binding's own CMake options (its CMakeLists.txt): ``-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF``
#: in ``CMAKE_ARGS`` skip its native build when pip builds it in the same command as us. They
#: mean nothing to llama.cpp, so they are left out of our build and its key.
BINDING_ONLY_CMAKE_OPTIONS = ("LLAMA_BUILD", "LLAVA_BUILD")


def own_cmake_args(text: str) -> List[str]:
    """``CMAKE_ARGS`` as our build takes it: split like a shell, the binding's options left out."""
    pat = re.compile(r"-D(%s)(:[A-Za-z]+)?=" % "|".join(BINDING_ONLY_CMAKE_OPTIONS))
    return [arg for arg in shlex.split(text) if not pat.match(arg)]


def compiler_identity() -> str:
    """The first line of ``--version`` of the C and C++ compilers CMake will pick."""
    lines = []
    for var, default in (("CC", "cc"), ("CXX", "c++")):
        exe = os.environ.get(var, default)
        try:
            res = subprocess.run(
                [*shlex.split(exe), "--version"], capture_output=True, text=True, check=False
            )
            first = (res.stdout or res.stderr).splitlines()[:1]
            lines.append(f"{exe}: {first[0] if first else 'unknown'}")
        except OSError:
            lines.append(f"{exe}: not found")
    return "; ".join(lines)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclasses.dataclass(frozen=True)
class BuildInputs:
    """Everything that decides what the library build produces."""

    sdist_sha256: str
    patches: tuple  # ((name, sha256 of content), ...) in series order
    cmake_args: tuple
    compiler: str
    recipe: int = RECIPE_VERSION
    # "" for the sdist; "pre-patched:<tree sha256>" for a pre-patched source (PATCHED_SOURCE_ENV)
    source: str = ""
    base_cmake_args: tuple = BASE_CMAKE_ARGS  # the arguments every build gets (before cmake_args)

    @classmethod
    def collect(
        cls,
        patches_dir: Optional[Path] = None,
        cmake_args: Optional[Sequence[str]] = None,
        compiler: Optional[str] = None,
    ) -> "BuildInputs":
        patches_dir = patches_dir or source_root() / "patches"
        if cmake_args is None:
            cmake_args = own_cmake_args(os.environ.get("CMAKE_ARGS", ""))
        patches = tuple((p.name, _sha256_bytes(p.read_bytes())) for p in read_series(patches_dir))
        source = ""
        pre = patched_source_dir()
        if pre is not None:
            source = "pre-patched:" + read_source_manifest(pre, patches)["tree_sha256"]
        return cls(
            sdist_sha256=SDIST_SHA256,
            patches=patches,
            cmake_args=tuple(cmake_args),
            compiler=compiler if compiler is not None else compiler_identity(),
            source=source,
        )

    def key(self) -> str:
        doc = dataclasses.asdict(self)
        if not doc["source"]:  # the sdist: the key it always had
            del doc["source"]
        return _sha256_bytes(json.dumps(doc, sort_keys=True).encode())[:20]


# --------------------------------------------------------------------------------------------
# A pre-patched source


def patched_source_dir() -> Optional[Path]:
    """``LLAMA_METAWS_LLAMA_SOURCE``: a pre-patched llama.cpp tree to build, or None (the sdist)."""
    env = os.environ.get(PATCHED_SOURCE_ENV)
    return Path(env) if env else None


def tree_sha256(root: Path) -> str:
    """One hash over every file's relative path and content (the manifest itself left out)."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(root).as_posix()
        if rel == SOURCE_MANIFEST:
            continue
        h.update(rel.encode() + b"\0")
        h.update(os.readlink(path).encode() if path.is_symlink() else sha256_file(path).encode())
        h.update(b"\0")
    return h.hexdigest()


def write_source_manifest(root: Path, patches: Sequence[Path], **extra) -> dict:
    """Record what a pre-patched tree holds: the sdist, the patches applied, the tree's hash."""
    doc = dict(sdist=SDIST_FILENAME, sdist_sha256=SDIST_SHA256,
               patches=[[p.name, _sha256_bytes(p.read_bytes())] for p in patches],
               tree_sha256=tree_sha256(root), **extra)
    (root / SOURCE_MANIFEST).write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def read_source_manifest(root: Path, patches: Sequence[Sequence[str]]) -> dict:
    """The manifest of a pre-patched tree, checked against the sdist and the current series."""
    path = root / SOURCE_MANIFEST
    if not path.is_file():
        raise BuildError(f"{PATCHED_SOURCE_ENV}={root}: no {SOURCE_MANIFEST} there "
                         "(make the tree with `llama-metaws-dev gpu-kit`)")
    doc = json.loads(path.read_text())
    if doc.get("sdist_sha256") != SDIST_SHA256:
        raise BuildError(f"{PATCHED_SOURCE_ENV}={root} was made from another sdist "
                         f"({doc.get('sdist_sha256')}, expected {SDIST_SHA256})")
    held = [tuple(x) for x in doc.get("patches", [])]
    if held != [tuple(x) for x in patches]:
        raise BuildError(f"{PATCHED_SOURCE_ENV}={root} holds other patches than patches/series "
                         f"({', '.join(n for n, _ in held) or 'none'}): make the kit again")
    return doc


def shim_key(lib_key: str, native_dir: Path) -> str:
    """The library key plus every file of the shim's sources."""
    h = hashlib.sha256(lib_key.encode())
    for path in sorted(p for p in native_dir.rglob("*") if p.is_file() and p.suffix in (".h", ".c", ".cpp", ".py")):
        h.update(str(path.relative_to(native_dir)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:20]


# --------------------------------------------------------------------------------------------
# A finished build


@dataclasses.dataclass(frozen=True)
class Build:
    """A finished build directory: ``lib/``, ``include/``, ``src/`` (the patched tree), ``shim/``.

    ``build.json`` is written last: a directory without it is not a build. ``shim`` is the
    compiled cffi module for this build, when known (the run-time manifest names it).
    """

    root: Path
    shim: Optional[Path] = None
    # inside an installed package (``llama_metaws/_native``): libraries without their soname
    # symlinks, loaded by path first (``package.preload``)
    bundled: bool = False

    @property
    def shim_path(self) -> Optional[Path]:
        return self.shim

    @property
    def lib_dir(self) -> Path:
        return self.root / "lib"

    @property
    def include_dir(self) -> Path:
        return self.root / "include"

    @property
    def src_dir(self) -> Path:
        return self.root / "src"

    @property
    def manifest(self) -> dict:
        return json.loads((self.root / "build.json").read_text())


def build_dir_for(inputs: BuildInputs) -> Path:
    return cache_root() / "builds" / inputs.key()


def find_build(inputs: Optional[BuildInputs] = None) -> Optional[Build]:
    """The finished build for these inputs (the current ones by default), or None."""
    inputs = inputs or BuildInputs.collect()
    root = build_dir_for(inputs)
    return Build(root) if (root / "build.json").is_file() else None


def find_shim(build: Build, native_dir: Optional[Path] = None) -> Optional[Path]:
    native_dir = native_dir or source_root() / "native"
    d = build.root / "shim" / shim_key(build.root.name, native_dir)
    found = sorted(d.glob("_llama_metaws_native*.so")) if d.is_dir() else []
    return found[0] if found else None


# --------------------------------------------------------------------------------------------
# The steps


def _run_streamed(cmd: Sequence[str], cwd: Optional[Path], on_line: Callable[[str], None], what: str,
                  env: Optional[dict] = None) -> None:
    """Run a command, hand each output line to ``on_line``, keep the tail for the error."""
    tail: List[str] = []
    proc = subprocess.Popen(
        list(cmd), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, errors="replace",
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        tail.append(line)
        del tail[:-40]
        on_line(line)
    if proc.wait() != 0:
        raise BuildError(f"{what} failed (exit {proc.returncode}):\n" + "\n".join(tail))


def fetch_sdist(downloads: Path, progress: Progress) -> Path:
    """The pinned sdist, from the cache or through ``pip download``; its sha256 is checked."""
    downloads.mkdir(parents=True, exist_ok=True)
    target = downloads / SDIST_FILENAME
    if target.is_file() and sha256_file(target) == SDIST_SHA256:
        progress(f"  using cached {target.name}")
        return target
    with tempfile.TemporaryDirectory(dir=downloads) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps",
            "--no-binary", SDIST_PROJECT, "--dest", tmp,
            f"{SDIST_PROJECT}=={SDIST_VERSION}",
        ]
        progress("  " + " ".join(cmd[2:]))
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise BuildError(f"fetch step: pip download failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
        got = Path(tmp) / SDIST_FILENAME
        if not got.is_file():
            raise BuildError(f"fetch step: pip did not produce {SDIST_FILENAME}: {os.listdir(tmp)}")
        digest = sha256_file(got)
        if digest != SDIST_SHA256:
            raise BuildError(
                f"fetch step: {SDIST_FILENAME} has sha256 {digest}, expected {SDIST_SHA256}"
            )
        os.replace(got, target)
    return target


def unpack_vendored(sdist: Path, dest: Path) -> None:
    """Extract ``vendor/llama.cpp`` of the sdist into ``dest`` (its ``.git`` link left out)."""
    dest.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if not m.name.startswith(VENDOR_PREFIX):
                continue
            rel = m.name[len(VENDOR_PREFIX):]
            if not rel or rel == ".git":
                continue
            m.name = rel
            members.append(m)
        try:
            tar.extractall(dest, members=members, filter="data")
        except TypeError:  # Python < 3.11.4 has no extraction filters
            tar.extractall(dest, members=members)


def apply_patches(src: Path, patches: Iterable[Path], progress: Progress) -> None:
    """Apply each patch with ``git apply`` (outside any repository); stop at the first failure."""
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(src.parent))
    for patch in patches:
        progress(f"  applying {patch.name}")
        try:
            res = subprocess.run(["git", "apply", "--whitespace=nowarn", str(patch)],
                                 cwd=src, capture_output=True, text=True, env=env)
        except FileNotFoundError:
            raise BuildError("patch step: git not found (the patches are applied with `git apply`): "
                             "install git") from None
        if res.returncode != 0:
            raise BuildError(f"patch step: {patch.name} does not apply:\n{res.stderr.strip()}")


def _ninja_progress(progress: Progress) -> Callable[[str], None]:
    """Turn ninja's ``[k/N] ...`` lines into a line every 5 % (and every error line)."""
    last = [-1]
    pat = re.compile(r"^\[(\d+)/(\d+)\]\s*(.*)$")

    def on_line(line: str) -> None:
        m = pat.match(line)
        if m:
            k, n = int(m.group(1)), int(m.group(2))
            pct = 100 * k // max(n, 1)
            if pct // 5 != last[0] or k == n:
                last[0] = pct // 5
                progress(f"  [{k}/{n}] {m.group(3)[:100]}")
        elif "error" in line.lower():
            progress("  " + line)

    return on_line


def _tool(name: str) -> Optional[str]:
    """A build tool from this Python's environment first (the venv's cmake/ninja), then PATH."""
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def _cmake() -> str:
    exe = _tool("cmake")
    if exe is None:
        raise BuildError("configure step: cmake not found (pip install cmake)")
    return exe


def _generator_args() -> List[str]:
    ninja = _tool("ninja")
    return ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []


def prepare_source(inputs: BuildInputs, src: Path, patches: List[Path], step: Callable[[int, str], None],
                   progress: Progress) -> None:
    """Steps 1-3 into ``src``: fetch, unpack and patch, or copy the pre-patched source (also the
    tools build's, :mod:`llama_metaws_dev.tools_build`)."""
    pre = patched_source_dir() if inputs.source else None
    if inputs.source and pre is None:
        raise BuildError(f"these inputs name a pre-patched source, but {PATCHED_SOURCE_ENV} is not set")
    if pre is not None:
        step(1, f"none: pre-patched source {pre} ({PATCHED_SOURCE_ENV})")
        step(2, f"copying {pre}")
        shutil.copytree(pre, src, symlinks=True)
        got = "pre-patched:" + tree_sha256(src)
        if got != inputs.source:
            raise BuildError(f"unpack step: {pre} does not hash to what its {SOURCE_MANIFEST} "
                             f"says ({got} != {inputs.source}): it was changed since it was made")
        step(3, f"{len(patches)} patch(es) already applied (checked against patches/series)")
    else:
        step(1, f"{SDIST_PROJECT} {SDIST_VERSION} sdist")
        sdist = fetch_sdist(cache_root() / "downloads", progress)

        step(2, "vendored llama.cpp")
        unpack_vendored(sdist, src)

        step(3, f"{len(patches)} patch(es) from patches/series")
        apply_patches(src, patches, progress)


#: ``then(src, bdir, env)``: more work in a library build's CMake tree, after its install and
#: before the tree is deleted (the tools of :mod:`llama_metaws_dev.tools_build`).
InTree = Callable[[Path, Path, Dict[str, str]], None]


def build_library(inputs: BuildInputs, progress: Progress = _stderr_progress, *, force: bool = False,
                  then: Optional[InTree] = None) -> Build:
    """Run the six steps for these inputs, or return the cached build at once (``then`` is not
    called then). ``then`` runs in the build's CMake tree once the library is installed; what it
    raises fails the build, which is then not kept."""
    final = build_dir_for(inputs)
    if (final / "build.json").is_file() and not force:
        progress(f"llama-metaws: build {inputs.key()} is up to date ({final})")
        return Build(final)

    patches = read_series(source_root() / "patches")
    n = len(STEPS)
    t0 = time.monotonic()

    def step(i: int, text: str) -> None:
        progress(f"[{i}/{n}] {STEPS[i - 1]}: {text}")

    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=final.parent))
    try:
        src = work / "src"
        prepare_source(inputs, src, patches, step, progress)

        # llama.cpp's CMake uses ccache when it is installed; relative paths under the work
        # directory let a changed series reuse every object its patches did not touch.
        env = dict(os.environ, CCACHE_BASEDIR=str(work), CCACHE_NOHASHDIR="1")
        step(4, "cmake " + (" ".join(inputs.cmake_args) or "(CPU, no CMAKE_ARGS)"))
        bdir = work / "cmake-build"
        cmd = [_cmake(), "-S", str(src), "-B", str(bdir), *_generator_args(), *inputs.base_cmake_args,
               f"-DCMAKE_INSTALL_PREFIX={work}", *inputs.cmake_args]
        _run_streamed(cmd, None, lambda line: None, "configure step: cmake", env)

        step(5, f"compiling with {os.cpu_count()} jobs")
        _run_streamed([_cmake(), "--build", str(bdir), "--parallel", str(os.cpu_count() or 1)],
                      None, _ninja_progress(progress), "build step: cmake --build", env)

        step(6, f"libraries and headers into {final}")
        _run_streamed([_cmake(), "--install", str(bdir)], None, lambda line: None,
                      "install step: cmake --install")
        if then is not None:
            then(src, bdir, env)
        shutil.rmtree(bdir)  # objects only; src/ stays for the peer tests
        manifest = dict(dataclasses.asdict(inputs), key=inputs.key(),
                        seconds=round(time.monotonic() - t0, 1))
        (work / "build.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if final.exists():  # a forced rebuild replaces the old directory
            shutil.rmtree(final)
        os.replace(work, final)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    progress(f"llama-metaws: built {inputs.key()} in {time.monotonic() - t0:.0f} s ({final})")
    return Build(final)


def sanitizer_flags(cmake_args: Sequence[str]) -> tuple:
    """The ``-fsanitize`` flags a build's CMake arguments ask for (the shim must match)."""
    flags = []
    for kind, flag in (("ADDRESS", "-fsanitize=address"), ("UNDEFINED", "-fsanitize=undefined")):
        if any(f"SANITIZE_{kind}=ON" in a for a in cmake_args):
            flags.append(flag)
    return tuple(flags)


def build_shim(build: Build, progress: Progress = _stderr_progress) -> Path:
    """The compiled cffi shim for this build, built now if its sources changed."""
    native_dir = source_root() / "native"
    found = find_shim(build, native_dir)
    if found is not None:
        return found
    out = build.root / "shim" / shim_key(build.root.name, native_dir)
    progress(f"llama-metaws: building the cffi shim into {out}")
    sys.path.insert(0, str(native_dir))
    try:
        import build_shim  # native/build_shim.py: the one builder
    finally:
        sys.path.remove(str(native_dir))
    tmp = Path(tempfile.mkdtemp(prefix="shim.tmp-", dir=build.root))
    try:
        build_shim.compile_shim(tmp, build.include_dir, build.lib_dir,
                                sanitize=sanitizer_flags(build.manifest.get("cmake_args", ())),
                                ext_include_dir=build.src_dir / "src",
                                common_include_dir=build.src_dir / "common")
        for stale in tmp.iterdir():  # objects and the generated C: only the module is kept
            if not stale.name.endswith(".so"):
                shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BuildError(f"shim step: {e}") from e
    found = find_shim(build, native_dir)
    if found is None:
        raise BuildError(f"shim step: no compiled module in {out}")
    return found


def build(progress: Progress = _stderr_progress, *, force: bool = False) -> Build:
    """Library and shim for the current inputs (``llama-metaws build`` then records the result
    in the run-time manifest: ``manifest.write_manifest``)."""
    inputs = BuildInputs.collect()
    b = build_library(inputs, progress, force=force)
    return Build(b.root, build_shim(b, progress))
