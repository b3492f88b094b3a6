"""The GPU run kit: what a machine with an NVIDIA GPU and no network needs, prepared here.

``llama-metaws-dev gpu-kit [--out DIR]`` (``make gpu-kit``) writes a folder (``build/gpu-kit`` by
default, well under the 64 MiB a device machine takes) holding:

- ``llama.cpp.tar.gz``: the llama.cpp vendored in the pinned sdist with ``patches/series``
  applied, trimmed to what the build of the libraries and of ``build --tools`` needs (the CPU,
  CUDA and RPC backends, llama-server's and the tools' sources without their tests, web UI or
  media; no docs, models or tests; see :data:`KEEP` and :data:`DROP`), with its ``lmws-source.json``: the
  sdist hash, the patches it holds and the tree's hash. ``run.sh`` unpacks it and points
  ``LLAMA_METAWS_LLAMA_SOURCE`` at it, so the build never fetches the sdist;
- ``wheels/``: CPython 3.12 manylinux x86_64 wheels of everything llama-metaws needs (the
  binding built as a wheel without its native build, cffi, gguf, numpy, setuptools for cffi's
  compiler, pytest, nvidia-ml-py, and their own needs) and llama-metaws itself (its wheel made
  from its sdist as pip makes it, without the native build: :func:`own_wheel`; the developer
  package's: :func:`dev_wheel`);
- ``repo/``: this checkout's ``patches/``, ``native/``, ``tests/``, ``bench/`` and package,
  the source root of the build (``LLAMA_METAWS_SOURCE_ROOT``) and of the tests;
- ``models/``: the tiny agreement MTP model that ``vram`` and ``repro`` run on
  (:mod:`llama_metaws.demo`; the tests write their own);
- ``run.sh`` and ``report.py`` (from ``kit/`` in the checkout) and ``MANIFEST.json``.

``run.sh`` installs the wheels with ``pip --no-index``, builds for CUDA (``--cpu``: for the CPU)
with llama-server in the same CMake tree, runs the CUDA subset of the suite, ``llama-metaws vram
--nvidia`` and the real-shape step (:mod:`llama_metaws_dev.sidebyside`: ours and llama-server side
by side on a model of Qwen3.5/3.6-27B's width and vocabulary), and writes ``run.log``,
``summary.json``, ``vram.json``, ``vram.png``, ``realshape.json`` and ``junit.xml`` under ``$OUT``.

``llama-metaws-dev gpu-kit --dry-run`` (``make gpu-kit-dry-run``) proves the kit self-contained:
``run.sh --cpu`` into a fresh virtual environment and a fresh build cache, with no network
(``unshare -rn`` where the kernel allows it, else pip's index off and every proxy pointed at a
closed port), with the install, build, devices, a few tests, one vram configuration and the
real-shape step at a small shape (:data:`DRY_RUN_REALSHAPE_ARGS`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Sequence

from llama_metaws.native import build as _build
from llama_metaws.paths import SDIST_SHA256, cache_root

Progress = Callable[[str], None]

KIT_FORMAT = 1
#: What a kit may weigh: the device machine takes 64 MiB of working tree in all, the checkout
#: included; a kit stays well under that.
SIZE_LIMIT = 48 * 2**20
DEFAULT_PYTHON_VERSIONS = ("3.12",)
#: manylinux tags for pip download (pip matches each exactly); linux_x86_64 is the binding's
#: own wheel, built here.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64")
#: Installed by run.sh beside llama-metaws[nvidia]: pytest for the suite; setuptools because
#: cffi compiles the shim through it and Python 3.12 has no distutils.
EXTRA_REQUIREMENTS = ("pytest>=7.4", "setuptools>=70")

#: The llama.cpp tree the build reads (relative to vendor/llama.cpp), all else dropped.
#: ggml's backends other than the CPU, CUDA and RPC are dropped from ggml/src, and tests/ but
#: test-alloc.cpp (a peer test of the suite compiles it against the patched ggml). The common
#: library (the shim's chat layer) and the cpp-httplib it links are kept, and models/templates
#: (the chat templates the suite's chat tests read). tools/ and examples/ hold the targets of
#: ``llama-metaws build --tools`` (llama-server, llama-speculative-simple, llama-bench,
#: llama-batched-bench) and the CMake files that list them (examples/ brings pocs/ in), so they
#: stay but for :data:`DROP`; scripts/ui-assets.cmake writes llama-server's (empty) web UI table.
KEEP = ("CMakeLists.txt", "LICENSE", "licenses", "cmake", "include", "src", "vendor", "ggml", "common",
        "tests/test-alloc.cpp", "models/templates", "tools", "examples", "pocs", "scripts/ui-assets.cmake")
KEEP_BACKENDS = ("ggml-cpu", "ggml-cuda", "ggml-rpc")
#: What no configure or build of those targets reads (globs relative to the tree): the web UI's
#: sources (the build embeds none: LLAMA_BUILD_UI=OFF, no prebuilt assets), the servers' and
#: mtmd's test suites and media, and the examples for other platforms.
DROP = ("tools/ui/*", "tools/ui/.*", "tools/server/tests", "tools/server/bench", "tools/server/*.md",
        "tools/mtmd/test-*", "tools/mtmd/tests", "tools/mtmd/legacy-models", "tools/*/README*.md",
        "examples/llama.android", "examples/llama.swiftui", "examples/model-conversion",
        "examples/llama-eval", "examples/sycl", "examples/*.py", "examples/*.sh", "examples/*.swift")
#: In tools/ui, what its CMakeLists reads without a web UI build (the rest goes by DROP).
KEEP_UI = ("CMakeLists.txt", "ui.cpp.in", "ui.h.in", "sources.cmake")

#: The checkout's parts the kit carries (the build's source root and the tests).
REPO_PARTS = ("llama_metaws", "dev", "native", "patches", "tests", "bench", "pyproject.toml", "README.md",
              "Makefile")
TEMPLATE_DIR = "kit"  # run.sh and report.py, in the checkout


class KitError(RuntimeError):
    """The kit could not be made, or a dry run failed; the message says which step and why."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def default_out() -> Path:
    return _build.source_root() / "build" / "gpu-kit"


def _run(cmd: Sequence[str], what: str, env: Optional[dict] = None, cwd: Optional[Path] = None) -> str:
    res = subprocess.run(list(cmd), capture_output=True, text=True, env=env, cwd=cwd)
    if res.returncode != 0:
        raise KitError(f"{what} failed (exit {res.returncode}): {' '.join(map(str, cmd))}\n"
                       f"{res.stdout[-3000:]}{res.stderr[-3000:]}")
    return res.stdout


# --------------------------------------------------------------------------------------------
# the source


def trim(src: Path) -> List[str]:
    """Drop everything of the tree the library build does not read; returns what was dropped."""
    dropped = []
    keep_top = {k.split("/")[0] for k in KEEP}
    for entry in sorted(src.iterdir()):
        if entry.name not in keep_top:
            dropped.append(entry.name)
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    for top in keep_top:  # a kept file inside a dropped folder (tests/test-alloc.cpp)
        files = [k for k in KEEP if k.startswith(top + "/")]
        if files and (src / top).is_dir():
            for p in sorted((src / top).iterdir()):
                if f"{top}/{p.name}" not in files:
                    dropped.append(f"{top}/{p.name}")
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
    for p in sorted((src / "ggml" / "src").iterdir()):
        if p.is_dir() and p.name.startswith("ggml-") and p.name not in KEEP_BACKENDS:
            dropped.append(f"ggml/src/{p.name}")
            shutil.rmtree(p)
    for pattern in DROP:
        for p in sorted(src.glob(pattern)):
            if p.parent.name == "ui" and p.name in KEEP_UI:
                continue
            dropped.append(p.relative_to(src).as_posix())
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    return dropped


def make_source(out: Path, progress: Progress = _stderr) -> dict:
    """The patched, trimmed llama.cpp as ``out/llama.cpp.tar.gz``; returns its manifest."""
    patches = _build.read_series(_build.source_root() / "patches")
    sdist = _build.fetch_sdist(cache_root() / "downloads", progress)
    with tempfile.TemporaryDirectory(prefix="lmws-kit-src-") as tmp:
        src = Path(tmp) / "llama.cpp"
        _build.unpack_vendored(sdist, src)
        _build.apply_patches(src, patches, progress)
        dropped = trim(src)
        manifest = _build.write_source_manifest(src, patches, trimmed=dropped,
                                                recipe=f"llama_metaws_dev.gpukit KEEP ({KIT_FORMAT})")
        n_files = sum(1 for p in src.rglob("*") if p.is_file())
        size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
        with tarfile.open(out / "llama.cpp.tar.gz", "w:gz", compresslevel=9) as tar:
            tar.add(src, arcname="llama.cpp")
    progress(f"  llama.cpp: {n_files} files, {size / 2**20:.1f} MiB unpacked "
             f"({len(dropped)} entries dropped), tree {manifest['tree_sha256'][:16]}")
    return dict(manifest, files=n_files, unpacked_bytes=size)


# --------------------------------------------------------------------------------------------
# the wheels


def binding_wheel(progress: Progress = _stderr) -> Path:
    """llama-cpp-python as a wheel without its native build (cached by the sdist's hash)."""
    d = cache_root() / "kit" / f"binding-{SDIST_SHA256[:16]}"
    found = sorted(d.glob("llama_cpp_python-*.whl")) if d.is_dir() else []
    if found:
        return found[0]
    sdist = _build.fetch_sdist(cache_root() / "downloads", progress)
    d.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF")
    progress("  building the binding's wheel without its native build (-DLLAMA_BUILD=OFF)")
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", tmp, str(sdist)],
             "the binding's wheel", env=env)
        (whl,) = Path(tmp).glob("llama_cpp_python-*.whl")
        names = _run([sys.executable, "-m", "zipfile", "-l", str(whl)], "listing the wheel")
        if ".so" in names:  # no native library may be in it
            raise KitError(f"the binding's wheel {whl.name} holds a native library: "
                           "CMAKE_ARGS=-DLLAMA_BUILD=OFF was not honoured")
        os.replace(whl, d / whl.name)
    return sorted(d.glob("llama_cpp_python-*.whl"))[0]


def own_wheel(dest: Path) -> Path:
    """llama-metaws itself, made as pip makes it for a user: the sdist of this checkout
    (``python -m build --sdist``), then its wheel (``pip wheel`` of the sdist), with
    ``LLAMA_METAWS_BUILD_AT_INSTALL=0``: a pure wheel carrying the patches and the shim's sources
    and no native build, since the device builds for CUDA from the kit's pre-patched tree
    (``llama_metaws.native.package``)."""
    with tempfile.TemporaryDirectory() as tmp:
        _run([sys.executable, "-m", "build", "--sdist", "--outdir", tmp, str(_build.source_root())],
             "llama-metaws's sdist")
        (sdist,) = Path(tmp).glob("llama_metaws-*.tar.gz")
        env = dict(os.environ, LLAMA_METAWS_BUILD_AT_INSTALL="0")
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", tmp, str(sdist)],
             "llama-metaws's wheel", env=env)
        (whl,) = Path(tmp).glob("llama_metaws-*.whl")
        if not whl.name.endswith("-py3-none-any.whl"):
            raise KitError(f"llama-metaws's wheel {whl.name} is not pure: it would not install on "
                           "the device's CPython")
        shutil.copy2(whl, dest / whl.name)
        return dest / whl.name


def dev_wheel(dest: Path) -> Path:
    """The developer package (``dev/``: the tests' builders, the real-shape step, the assert's
    reproduction, the tools build) as a pure wheel: run.sh installs it beside llama-metaws."""
    with tempfile.TemporaryDirectory() as tmp:
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", tmp,
              str(_build.source_root() / "dev")], "llama-metaws-dev's wheel")
        (whl,) = Path(tmp).glob("llama_metaws_dev-*.whl")
        shutil.copy2(whl, dest / whl.name)
        return dest / whl.name


def _version(pyproject: str = "pyproject.toml") -> str:
    """The version in the checkout's ``pyproject`` (llama-metaws's; ``dev/pyproject.toml``: the
    developer package's)."""
    text = (_build.source_root() / pyproject).read_text()
    for line in text.splitlines():
        if line.strip().startswith("version"):
            return line.split("=", 1)[1].strip().strip('"')
    raise KitError(f"no version in {pyproject}")


def requirements() -> List[str]:
    """What run.sh installs: llama-metaws with its nvidia extra, the developer package, and
    EXTRA_REQUIREMENTS."""
    return [f"llama-metaws[nvidia]=={_version()}", f"llama-metaws-dev=={_version('dev/pyproject.toml')}", *EXTRA_REQUIREMENTS]


def download_wheels(wheels: Path, python_versions: Iterable[str], progress: Progress = _stderr) -> None:
    """The whole closure of :func:`requirements`, as binary wheels for each Python version."""
    for version in python_versions:
        progress(f"  wheels for CPython {version} (manylinux x86_64)")
        cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:",
               "--python-version", version, "--implementation", "cp", "--find-links", str(wheels),
               "-d", str(wheels)]
        for plat in PLATFORMS:
            cmd += ["--platform", plat]
        _run(cmd + requirements(), f"pip download for CPython {version}")


def check_wheels(wheels: Path, python_version: str) -> None:
    """Resolve the requirements for this Python from the kit alone, as pip would (no network)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-index",
               "--find-links", str(wheels), "--only-binary=:all:", "--python-version", python_version,
               "--implementation", "cp", "--target", tmp, "--quiet"]
        for plat in PLATFORMS:
            cmd += ["--platform", plat]
        _run(cmd + requirements(), f"resolving the kit's wheels for CPython {python_version} offline",
             env=offline_env())


# --------------------------------------------------------------------------------------------
# the kit


def offline_env(base: Optional[dict] = None) -> dict:
    """An environment in which pip reaches no index: no pip configuration, proxies to a closed port."""
    env = {k: v for k, v in (base or os.environ).items()
           if not k.upper().startswith("PIP_") and k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")}
    closed = "http://127.0.0.1:9"
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               http_proxy=closed, https_proxy=closed, HTTP_PROXY=closed, HTTPS_PROXY=closed,
               ALL_PROXY=closed, no_proxy="", NO_PROXY="")
    return env


def _git_rev(root: Path) -> Optional[str]:
    try:
        rev = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return rev.stdout.strip() or None


def _copy_repo(dest: Path) -> None:
    root = _build.source_root()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".pytest_cache", ".hypothesis")
    for part in REPO_PARTS:
        p = root / part
        if p.is_dir():
            shutil.copytree(p, dest / part, ignore=ignore)
        elif p.is_file():
            shutil.copy2(p, dest / part)


def kit_size(kit: Path) -> int:
    return sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())


def make_kit(out: Optional[Path] = None, python_versions: Sequence[str] = DEFAULT_PYTHON_VERSIONS,
             progress: Progress = _stderr) -> Path:
    """Make the kit into ``out`` (replaced if it exists); returns its folder."""
    from llama_metaws.demo.model import make_tiny_mtp_model

    out = Path(out) if out else default_out()
    root = _build.source_root()
    t0 = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent if out.parent.exists() else None))
    try:
        progress("[1/5] source: the patched llama.cpp, trimmed")
        source = make_source(tmp, progress)

        progress("[2/5] wheels")
        wheels = tmp / "wheels"
        wheels.mkdir()
        shutil.copy2(binding_wheel(progress), wheels)
        own_wheel(wheels)
        dev_wheel(wheels)
        download_wheels(wheels, python_versions, progress)
        for v in python_versions:
            check_wheels(wheels, v)

        progress("[3/5] models")
        models = tmp / "models"
        models.mkdir()
        # the model of vram and repro (the tests make their own, with the gguf package)
        make_tiny_mtp_model(models / "tiny-qwen35-mtp-agreement-0.8.gguf", agreement=0.8)

        progress("[4/5] repo and scripts")
        _copy_repo(tmp / "repo")
        for name in ("run.sh", "report.py"):
            shutil.copy2(root / TEMPLATE_DIR / name, tmp / name)
        (tmp / "run.sh").chmod(0o755)

        progress("[5/5] manifest")
        files = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {
            "format": KIT_FORMAT,
            "made": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "llama_metaws": _version(),
            "git": _git_rev(root),
            "python_versions": list(python_versions),
            "requirements": requirements(),
            "source": {k: source[k] for k in ("sdist", "sdist_sha256", "patches", "tree_sha256",
                                              "files", "unpacked_bytes")},
            "wheels": {p.name: _build.sha256_file(p) for p in sorted(wheels.glob("*.whl"))},
            "models": sorted(p.name for p in models.glob("*.gguf")),
        }
        manifest["bytes"] = sum(files.values())
        (tmp / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
        size = kit_size(tmp)
        # a kit with wheels for more Pythons than the device's is a dry run's, not a device's
        if size > SIZE_LIMIT and list(python_versions) == list(DEFAULT_PYTHON_VERSIONS):
            raise KitError(f"the kit weighs {size / 2**20:.1f} MiB, over its {SIZE_LIMIT / 2**20:.0f} MiB "
                           "limit: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in
                                                 sorted(files.items(), key=lambda kv: -kv[1])[:5]))
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(f"llama-metaws-dev gpu-kit: {out} ({size / 2**20:.1f} MiB, {len(files)} files) "
             f"in {time.monotonic() - t0:.0f} s")
    return out


# --------------------------------------------------------------------------------------------
# the dry run


def find_python(version: str = "3.12") -> Optional[str]:
    """An interpreter of this version that runs: on PATH, or pyenv's."""
    candidates = [shutil.which(f"python{version}")]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates += [str(d / "bin" / f"python{version}") for d in sorted(pyenv.glob(f"{version}*"), reverse=True)]
    for exe in filter(None, candidates):
        try:
            ok = subprocess.run([exe, "-c", "import venv"], capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return exe
    return None


def _python_version(python: str) -> str:
    return _run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], "python version").strip()


#: Run inside the dry run's network namespace before run.sh: its loopback interface up (a new
#: namespace has it down, and the real-shape step talks to llama-server on 127.0.0.1), then exec
#: the command given. Nothing else is brought up: no route leaves the namespace.
LOOPBACK_UP = """import fcntl, os, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
flags = struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, struct.pack("16sH14x", b"lo", 0)))[1]  # SIOCGIFFLAGS
fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", flags | 0x1))  # SIOCSIFFLAGS: IFF_UP
s.close()
os.execvp(sys.argv[1], sys.argv[1:])
"""


def no_network_prefix() -> List[str]:
    """``unshare -rn`` (a network namespace with nothing in it) where it works, else nothing."""
    exe = shutil.which("unshare")
    if exe and subprocess.run([exe, "-rn", "true"], capture_output=True).returncode == 0:
        return [exe, "-rn"]
    return []


#: The dry run's real-shape step: every row, at a width and vocabulary a 2-core CPU runs in seconds.
DRY_RUN_REALSHAPE_ARGS = "--shape small --layers 4 -n 32 --requests 1 --warmup 1 -c 1024 -ub 128"
#: The dry run's deadline (run.sh's --budget): its build compiles llama.cpp and the tools for the CPU
#: on 2 cores, where a GPU machine's 16 compile the CUDA build in the kit's 540 s.
DRY_RUN_BUDGET_S = 1500

#: The dry run's tests: a few of the CUDA subset's, one per concern.
DRY_RUN_TESTS = (
    "tests/test_workspace.py::test_shared_output_is_token_identical_over_several_requests",
    "tests/test_tensor_split.py::test_two_sequences_in_alias_mode",
    "tests/test_tensor_split.py::test_llama_level_reproduction",
)


def dry_run(kit: Path, python: Optional[str] = None, work: Optional[Path] = None,
            progress: Progress = _stderr, timeout: float = 1800, keep: Optional[Path] = None) -> dict:
    """``run.sh --cpu`` from the kit alone: a fresh venv, a fresh cache, no network.

    Returns the run's ``summary.json``; raises :class:`KitError` when a step failed. ``keep``:
    a folder that receives the run's output (run.log, summary.json, ...), pass or fail.
    """
    kit = Path(kit).resolve()
    python = python or find_python("3.12") or sys.executable
    version = _python_version(python)
    manifest = json.loads((kit / "MANIFEST.json").read_text())
    if version not in manifest["python_versions"]:
        raise KitError(f"the kit holds wheels for CPython {', '.join(manifest['python_versions'])}, "
                       f"not {version} ({python}): make it with --python-version {version}")
    own_tmp = work is None
    work = Path(tempfile.mkdtemp(prefix="lmws-kit-dry-")) if own_tmp else Path(work)
    try:
        venv = work / "venv"
        progress(f"dry run: fresh venv from {python} (CPython {version}) in {venv}")
        _run([python, "-m", "venv", str(venv)], "creating the venv")
        prefix = no_network_prefix()
        out = work / "out"
        env = offline_env()
        env.update(OUT=str(out), KIT_PYTHON=str(venv / "bin" / "python"), KIT_WORK=str(work / "work"),
                   KIT_TESTS=" ".join(DRY_RUN_TESTS), KIT_VRAM_ARGS="--config alias-tensor -n 8 --requests 1",
                   KIT_REALSHAPE_ARGS=DRY_RUN_REALSHAPE_ARGS, KIT_BUDGET_S=str(DRY_RUN_BUDGET_S))
        for k in ("LLAMA_METAWS_CACHE", "LLAMA_METAWS_SOURCE_ROOT", "LLAMA_METAWS_LLAMA_SOURCE",
                  "LLAMA_CPP_LIB_PATH", "CMAKE_ARGS", "VIRTUAL_ENV", "PYTHONPATH"):
            env.pop(k, None)
        # the venv's own bin/ only: nothing installed beside this checkout's venv can leak in
        env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                      if p and Path(p).resolve() != Path(sys.executable).parent.resolve())
        how = ("unshare -rn (a network namespace with only its loopback up)" if prefix
               else "pip's index off, proxies to a closed port")
        progress(f"dry run: bash run.sh --cpu with no network: {how}")
        t0 = time.monotonic()
        if prefix:  # its loopback up, by the venv's interpreter
            prefix = [*prefix, str(venv / "bin" / "python"), "-c", LOOPBACK_UP]
        res = subprocess.run([*prefix, "bash", str(kit / "run.sh"), "--cpu"], env=env, cwd=work,
                             timeout=timeout, capture_output=True, text=True)
        seconds = time.monotonic() - t0
        if keep is not None and out.is_dir():
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(out, keep)
        log = (out / "run.log").read_text() if (out / "run.log").is_file() else res.stdout + res.stderr
        summary_path = out / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
        if res.returncode != 0 or summary is None:
            raise KitError(f"dry run: run.sh --cpu exited {res.returncode} after {seconds:.0f} s:\n{log[-6000:]}")
        summary["dry_run"] = {"network": how, "python": python, "python_version": version,
                              "seconds": round(seconds, 1), "files": sorted(p.name for p in out.iterdir())}
        progress(f"dry run: passed in {seconds:.0f} s: " + ", ".join(
            f"{s['name']} {s['seconds']:.0f} s" for s in summary["steps"]))
        return summary
    finally:
        if own_tmp:
            shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# the command


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--out", type=Path, help="the kit's folder (default build/gpu-kit in the checkout)")
    p.add_argument("--python-version", action="append", metavar="X.Y",
                   help="CPython version of the wheels (repeatable; default 3.12, the device machine's)")
    p.add_argument("--dry-run", action="store_true",
                   help="then run the kit's run.sh --cpu into a fresh venv with no network, and check it "
                   "passed (its output: DIR.dry-run beside the kit)")
    p.add_argument("--python", help="the dry run's interpreter (default: python3.12 if found, else this one)")
    return p


def run_from_args(args: argparse.Namespace) -> int:
    versions = list(dict.fromkeys(args.python_version or DEFAULT_PYTHON_VERSIONS))
    try:
        if args.dry_run:
            python = args.python or find_python("3.12") or sys.executable
            v = _python_version(python)
            if v not in versions:
                versions.append(v)
        kit = make_kit(args.out, versions)
        if args.dry_run:
            summary = dry_run(kit, python, keep=kit.parent / f"{kit.name}.dry-run")
            print(json.dumps({"kit": str(kit), "bytes": kit_size(kit), "dry_run": summary["dry_run"],
                              "steps": summary["steps"]}, indent=2))
        else:
            print(kit)
    except (KitError, _build.BuildError) as e:
        print(f"llama-metaws-dev gpu-kit: {e}", file=sys.stderr)
        return 1
    return 0
