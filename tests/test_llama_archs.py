"""llama.cpp's own test-llama-archs on the patched tree, and the phase-workspace lifecycle in it.

test-llama-archs needs llama.cpp's common library, so it is built with the vendored CMake from the
build's patched tree (``<build>/src``) into ``<build>/peer-tests``, once per build key, with the
build's own CMake arguments (the sanitizer build gets a sanitized one). A cold build takes about
10 minutes on 2 cores (ccache reuses ggml's and llama's objects from the main build; the common
library includes llama.h, which our patches change): these tests carry the ``peer`` marker, which
``make test`` leaves out and ``make peer-tests`` runs (``.ci/run`` calls it); ``make sanitize``
runs the lifecycle under ASan and UBSan.
"""

import fcntl
import os
import subprocess

import pytest

from llama_metaws import build as native_build
from llama_metaws import runtime

pytestmark = pytest.mark.peer

TARGET = "test-llama-archs"


@pytest.fixture(scope="module")
def test_llama_archs():
    b = runtime.require_build()
    bdir = b.root / "peer-tests"  # one level below the key, as the main build's cmake-build was
    exe, done = bdir / "bin" / TARGET, bdir / "done"
    with open(b.root / "peer-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another checkout of the same series may be building it
        if not done.is_file():
            args = [*native_build.BASE_CMAKE_ARGS, "-DLLAMA_BUILD_TESTS=ON", "-DLLAMA_BUILD_COMMON=ON",
                    *b.manifest.get("cmake_args", ())]
            env = dict(os.environ, CCACHE_BASEDIR=str(b.root), CCACHE_NOHASHDIR="1")
            for cmd in ([native_build._cmake(), "-S", str(b.src_dir), "-B", str(bdir),
                         *native_build._generator_args(), *args],
                        [native_build._cmake(), "--build", str(bdir), "--parallel", str(os.cpu_count() or 1),
                         "--target", TARGET]):
                res = subprocess.run(cmd, env=env, capture_output=True, text=True)
                assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
            for obj in bdir.rglob("*.o"):  # the objects only: the binary and its libraries stay
                obj.unlink()
            done.write_text(TARGET + "\n")
    return exe


def _run(exe, *args, timeout=900):
    res = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout)
    return res.returncode, res.stdout + res.stderr


def test_the_vendored_test_llama_archs_passes_for_all_architectures(test_llama_archs):
    rc, out = _run(test_llama_archs, "-s", "42")
    assert rc == 0, out[-6000:]
    assert "Summary: all" in out and "test(s) passed" in out, out[-2000:]
    assert "qwen35" in out  # the architecture the workspace serves was among them


def test_the_phase_workspace_lifecycle_over_a_random_mtp_model(test_llama_archs):
    """attach -1 then 1, equal buffers, one synchronize per handoff, prompt/decode grow and
    shrink, fail-closed reserves under memory pressure, teardown either order, re-attach."""
    # llama.cpp's common logger prints from a worker thread that exit does not always drain (seen
    # on a loaded machine: exit status 0, the last line missing): every run must exit 0 (a failed
    # GGML_ASSERT aborts), and one of at most three must show the closing OK line
    for _ in range(3):
        rc, out = _run(test_llama_archs, "--phase-workspace", "-s", "42", timeout=300)
        assert rc == 0, out[-6000:]
        if "phase-aware workspace: prompt" in out and ": OK" in out:
            break
    assert "phase-aware workspace: prompt" in out and ": OK" in out, out[-2000:]
    assert "ws_attach: failed to allocate the shared workspace" in out  # the -1 case really failed
    assert "llama_decode: failed to decode, ret = -2" in out  # and so did the prompt under pressure
