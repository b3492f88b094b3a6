"""llama.cpp's own test-llama-archs on the patched tree, and the phase-workspace lifecycle in it.

test-llama-archs needs llama.cpp's common library, so it is built with the vendored CMake from the
build's patched tree (``<build>/src``) into ``<build>/peer-tests``, once per build key, with the
build's own CMake arguments (the sanitizer build gets a sanitized one, in its own key's
directory). Only the common library, cpp-httplib and the test are compiled; the test links the
build's installed ggml and llama, the libraries the plugin runs on (llama's unity sources name
their absolute paths, so ccache never reused them and rebuilding them was most of the cost).
These tests carry the ``peer`` marker, which ``make test`` leaves out and ``make peer-tests``
runs (``.ci/run`` calls it); ``make sanitize`` runs the lifecycle under ASan and UBSan.
"""

import fcntl
import os
import re
import shutil
import subprocess

import pytest

from llama_metaws.native import build as native_build
from llama_metaws.native import runtime

pytestmark = pytest.mark.peer

TARGET = "test-llama-archs"


# what test-llama-archs links that the build installed already: its ggml and llama are not rebuilt
_INSTALLED = re.compile(r"bin/lib(ggml[\w-]*|llama)\.so")  # ggml-base, ggml-cpu, ggml-rpc...
_OUTPUT = re.compile(r" -o (\S+)|\bar qc (\S+)|cmake_symlink_library (\S+)")


def _build(b, bdir, env):
    """Configure the build's patched tree with the tests and the common library, then compile
    only what is not installed (the common library, cpp-httplib, the test) and link the test
    against the build's own installed ggml and llama (the libraries the plugin runs on)."""
    args = [*native_build.BASE_CMAKE_ARGS, "-DLLAMA_BUILD_TESTS=ON", "-DLLAMA_BUILD_COMMON=ON",
            *b.manifest.get("cmake_args", ())]
    if native_build.sanitizer_flags(b.manifest.get("cmake_args", ())):
        # instrumented, unoptimized, with line tables: the code under test is the installed
        # libraries (-O2); at -O2 -g the common library compiled about 4x slower (one file:
        # 401 s against 103 s on the loaded cores here)
        args += [f"-DCMAKE_{lang}_FLAGS_RELWITHDEBINFO=-O0 -g1 -DNDEBUG" for lang in ("C", "CXX")]
    ninja = native_build._tool("ninja")
    assert ninja, "ninja not found (pip install ninja)"
    res = subprocess.run([native_build._cmake(), "-S", str(b.src_dir), "-B", str(bdir),
                          "-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}", *args],
                         env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    res = subprocess.run([ninja, "-C", str(bdir), "-t", "commands", TARGET],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    objects, steps = [], []
    for cmd in res.stdout.splitlines():
        m = _OUTPUT.search(cmd)
        assert m, cmd
        out = next(g for g in m.groups() if g)
        if " -c " in cmd:
            if not out.startswith(("ggml/", "src/CMakeFiles/llama.dir/")):
                objects.append(out)
        elif not _INSTALLED.match(out):
            steps.append(cmd)
    assert objects and steps[-1].find(f"-o bin/{TARGET}") > 0, res.stdout[-4000:]
    (bdir / "bin").mkdir(exist_ok=True)
    for lib in b.lib_dir.iterdir():
        if _INSTALLED.match(f"bin/{lib.name}"):
            dst = bdir / "bin" / lib.name
            if dst.is_symlink() or dst.exists():
                dst.unlink()
            shutil.copy2(lib, dst, follow_symlinks=False)
    res = subprocess.run([ninja, "-C", str(bdir), "-j", str(os.cpu_count() or 1), *objects],
                         env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    for cmd in steps:  # the static libraries, libllama-common and the test, in ninja's order
        res = subprocess.run(cmd, shell=True, cwd=bdir, env=env, capture_output=True, text=True)
        assert res.returncode == 0, cmd[:500] + res.stdout[-2000:] + res.stderr[-2000:]


@pytest.fixture(scope="module")
def test_llama_archs():
    b = runtime.require_build()
    bdir = b.root / "peer-tests"  # one level below the key, as the main build's cmake-build was
    exe, done = bdir / "bin" / TARGET, bdir / "done"
    with open(b.root / "peer-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another checkout of the same series may be building it
        if not done.is_file():
            env = dict(os.environ, CCACHE_BASEDIR=str(b.root), CCACHE_NOHASHDIR="1")
            env.pop("LD_PRELOAD", None)  # make sanitize preloads the sanitizers: not into compilers
            _build(b, bdir, env)
            for obj in bdir.rglob("*.o"):  # the objects only: the binary and its libraries stay
                obj.unlink()
            done.write_text(TARGET + "\n")
    return exe


def _run(exe, *args, timeout=900, env=None):
    res = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout,
                         env=env)
    return res.returncode, res.stdout + res.stderr


def test_the_vendored_test_llama_archs_passes_for_all_architectures(test_llama_archs):
    # exit status 0: every case passed (main returns 1 if one failed); the closing summary line
    # may be lost with the logger's last lines (see the lifecycle below)
    rc, out = _run(test_llama_archs, "-s", "42")
    assert rc == 0, out[-6000:]
    assert "qwen35" in out and "FAIL" not in out, out[-2000:]  # the workspace's architecture ran


def test_the_phase_workspace_lifecycle_over_a_random_mtp_model(test_llama_archs):
    """attach -1 then 1, equal buffers, one synchronize per handoff, prompt/decode grow and
    shrink, fail-closed reserves under memory pressure, teardown either order, re-attach."""
    # exit status 0 is the test's own verdict: every check is a GGML_ASSERT (an abort), and main
    # returns 0 only after the last one. The closing OK line is not: llama.cpp's common logger
    # prints from a worker thread that exit does not drain (common_log_main leaks it on purpose);
    # linked against the installed libraries the line was lost on every run here (and the
    # all-architectures run lost its last table rows and summary, exit status 0)
    env = dict(os.environ)
    cmake_args = runtime.require_build().manifest.get("cmake_args", ())
    if "-fsanitize=address" in native_build.sanitizer_flags(cmake_args):
        # a C++ program: LeakSanitizer can read its pointers (a leak exits 23)
        env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":detect_leaks=1"
    rc, out = _run(test_llama_archs, "--phase-workspace", "-s", "42", timeout=300, env=env)
    assert rc == 0, out[-6000:]
    assert "ws_attach: failed to allocate the shared workspace" in out  # the -1 case really failed
    assert "llama_decode: failed to decode, ret = -2" in out  # and so did the prompt under pressure
