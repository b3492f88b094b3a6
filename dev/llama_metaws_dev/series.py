"""``make series-check``: the patch series is bisectable.

For each patch of ``patches/series`` in order, on the vendored llama.cpp with the patches before
it applied (``git am``, one commit each, in ``build/series-check/llama.cpp``):

1. build the libraries (target ``llama``: ggml, its CPU and RPC backends, llama) with the
   plugin's CMake arguments (``build.BASE_CMAKE_ARGS``, ``CMAKE_ARGS`` left out), unoptimized;
2. compile llama.cpp's ``tests/test-alloc.cpp`` against them and run it;
3. where the patch changes ``tests/test-llama-archs.cpp``, build that test (it needs the common
   library) and run its ``--phase-workspace`` lifecycle.

Then, on the whole series, ``ggml-base`` built with ggml's defaults (``GGML_ALLOC_FAULT_INJECTION``
off, as a release build has it) must not export the allocation-failure injector.

One build directory serves every step, so ninja recompiles only what a patch touched and what
includes it; llama.cpp's CMake uses ccache when it is installed, and with its cache warm a step
is mostly cache hits (the first run, or a patch whose ggml or llama header changed, compiles
for real). A failure stops the run with the patch, the step and the tail of its output; each
step's full output is in ``build/series-check/logs/``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

from llama_metaws.native import build
from llama_metaws.paths import cache_root

GIT_IDENTITY = ("-c", "user.name=series-check", "-c", "user.email=series-check@llama-metaws")
LIBRARY_TARGET = "llama"
ARCHS_TEST = "test-llama-archs"
INJECTOR = "ggml_backend_inject_alloc_failure"
UNOPTIMIZED = tuple(f"-DCMAKE_{lang}_FLAGS_RELEASE=-O0 -DNDEBUG" for lang in ("C", "CXX"))


class SeriesError(RuntimeError):
    """A patch of the series broke the build or a test; the message names it and the step."""


def _run(cmd: Sequence[str], log: Path, what: str, cwd: Optional[Path] = None, env: Optional[dict] = None) -> str:
    """Run ``cmd``, append its output to ``log``; raise SeriesError with the tail on failure."""
    res = subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True, errors="replace")
    out = res.stdout + res.stderr
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{out}\n")
    if res.returncode != 0:
        raise SeriesError(f"{what} failed (exit {res.returncode}):\n" + "\n".join(out.splitlines()[-30:]))
    return out


def _git(repo: Path, *args: str, log: Path) -> str:
    return _run(["git", *GIT_IDENTITY, *args], log, f"git {args[0]}", cwd=repo)


def prepare_tree(work: Path, log: Path) -> Path:
    """The vendored llama.cpp as a git repository at tag ``vendored``, reset to it (a previous
    run's checkout is reused, so that files no patch touches keep their timestamps)."""
    repo = work / "llama.cpp"
    if not (repo / ".git").is_dir() or subprocess.run(
            ["git", "rev-parse", "-q", "--verify", "vendored"], cwd=repo, capture_output=True).returncode:
        shutil.rmtree(repo, ignore_errors=True)
        sdist = build.fetch_sdist(cache_root() / "downloads", lambda line: print(line, flush=True))
        build.unpack_vendored(sdist, repo)
        _git(repo, "init", "-q", log=log)
        _git(repo, "add", "-A", "-f", log=log)
        _git(repo, "commit", "-q", "--no-verify", "-m", "vendored llama.cpp", log=log)
        _git(repo, "tag", "vendored", log=log)
    subprocess.run(["git", "am", "--abort"], cwd=repo, capture_output=True)
    _git(repo, "reset", "-q", "--hard", "vendored", log=log)
    _git(repo, "clean", "-q", "-fdx", log=log)
    return repo


def configure(repo: Path, bdir: Path, args: Sequence[str], env: dict, log: Path) -> None:
    ninja = build._tool("ninja")
    if ninja is None:
        raise SeriesError("ninja not found (pip install ninja)")
    _run([build._cmake(), "-S", str(repo), "-B", str(bdir), "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}",
          *args], log, "cmake configure", env=env)


def ninja(bdir: Path, targets: Sequence[str], env: dict, log: Path) -> None:
    _run([build._cmake(), "--build", str(bdir), "--parallel", str(os.cpu_count() or 1), "--target", *targets],
         log, "build " + " ".join(targets), env=env)


def run_test_alloc(repo: Path, bdir: Path, env: dict, log: Path) -> int:
    """Compile tests/test-alloc.cpp against the built ggml (through ccache when there is one),
    run it; the number of its cases that passed."""
    exe = bdir / "test-alloc"
    cxx = [c for c in (shutil.which("ccache"), os.environ.get("CXX", "c++")) if c]
    lib = bdir / "bin"
    _run([*cxx, "-std=c++17", "-O1", f"-I{repo / 'ggml' / 'include'}", f"-I{repo / 'ggml' / 'src'}",
          str(repo / "tests" / "test-alloc.cpp"), f"-L{lib}", "-lggml-base", "-lggml", f"-Wl,-rpath,{lib}",
          "-o", str(exe)], log, "compile test-alloc", env=env)
    out = _run([str(exe)], log, "test-alloc")
    return out.count(" PASSED")


def changed_files(repo: Path, log: Path) -> List[str]:
    return _git(repo, "diff-tree", "--no-commit-id", "--name-only", "-r", "HEAD", log=log).split()


def exported(lib: Path) -> set:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def check(work: Path, patches: Sequence[Path], jobs_env: dict) -> List[dict]:
    logs = work / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    setup_log = logs / "00-setup.log"
    repo = prepare_tree(work, setup_log)
    bdir = work / "cmake-build"
    # the tests and the common library configured in (only built where a patch changes the test);
    # unoptimized: whether a tree compiles and the tests pass does not depend on -O, and -O0
    # compiles in about half the time
    args = [*build.BASE_CMAKE_ARGS, "-DLLAMA_BUILD_TESTS=ON", "-DLLAMA_BUILD_COMMON=ON", *UNOPTIMIZED]
    rows = []
    for i, patch in enumerate(patches, 1):
        t0 = time.monotonic()
        log = logs / f"{i:02d}-{patch.stem}.log"
        row = dict(n=i, patch=patch.name)
        try:
            _run(["git", *GIT_IDENTITY, "am", "-q", "--whitespace=nowarn", str(patch)], log, "git am", cwd=repo)
            if i == 1:
                configure(repo, bdir, args, jobs_env, log)
            ninja(bdir, [LIBRARY_TARGET], jobs_env, log)
            row["test_alloc_cases"] = run_test_alloc(repo, bdir, jobs_env, log)
            if f"tests/{ARCHS_TEST}.cpp" in changed_files(repo, log):
                ninja(bdir, [ARCHS_TEST], jobs_env, log)
                _run([str(bdir / "bin" / ARCHS_TEST), "--phase-workspace", "-s", "42"], log,
                     f"{ARCHS_TEST} --phase-workspace")
                row["archs"] = True
        except SeriesError as e:
            raise SeriesError(f"after {patch.name} (patch {i} of {len(patches)}): {e}\n(full log: {log})") from None
        row["seconds"] = round(time.monotonic() - t0, 1)
        rows.append(row)
        print(f"  [{i:2d}/{len(patches)}] {patch.name[:60]:60s} {row['seconds']:6.1f} s  "
              f"test-alloc: {row['test_alloc_cases']} passed" + (f", {ARCHS_TEST}: passed" if row.get("archs") else ""),
              flush=True)

    # a release build (ggml's defaults) carries no allocation-failure injector
    t0 = time.monotonic()
    log = logs / "99-release-ggml-base.log"
    rdir = work / "cmake-build-release"
    configure(repo, rdir, [*build.BASE_CMAKE_ARGS, *UNOPTIMIZED, "-DGGML_ALLOC_FAULT_INJECTION=OFF"], jobs_env, log)
    ninja(rdir, ["ggml-base"], jobs_env, log)
    libs = sorted((rdir / "bin").glob("libggml-base.so*"))
    if not libs or INJECTOR in exported(libs[0]):
        raise SeriesError(f"ggml-base built with ggml's defaults exports {INJECTOR} (or was not built): {libs}")
    if INJECTOR not in exported(sorted((bdir / "bin").glob("libggml-base.so*"))[0]):
        raise SeriesError(f"ggml-base built with the plugin's arguments lacks {INJECTOR}")
    rows.append(dict(n=len(patches) + 1, patch="release ggml-base", seconds=round(time.monotonic() - t0, 1)))
    print(f"  release build (GGML_ALLOC_FAULT_INJECTION=OFF): ggml-base exports no {INJECTOR} "
          f"({rows[-1]['seconds']:.1f} s)", flush=True)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llama_metaws_dev.series", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=None,
                        help="where the tree and the build directories live (default: build/series-check)")
    args = parser.parse_args(argv)
    root = build.source_root()
    work = (args.work or root / "build" / "series-check").resolve()
    work.mkdir(parents=True, exist_ok=True)
    if shutil.which("ccache") is None:
        print("series-check: ccache is not installed: every step compiles for real (apt-get install ccache)",
              file=sys.stderr)
    patches = build.read_series(root / "patches")
    # ccache: paths relative to the work directory, so another checkout's run shares the objects
    env = dict(os.environ, CCACHE_BASEDIR=str(work), CCACHE_NOHASHDIR="1")
    env.pop("LD_PRELOAD", None)
    t0 = time.monotonic()
    print(f"series-check: {len(patches)} patches in {work}", flush=True)
    try:
        check(work, patches, env)
    except (SeriesError, build.BuildError) as e:
        print(f"series-check: FAILED {e}", file=sys.stderr)
        return 1
    print(f"series-check: every patch builds and test-alloc passes after each "
          f"({time.monotonic() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
