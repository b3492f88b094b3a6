"""The package as pip installs it: the sdist's files and metadata, the installed layout.

Fast checks only: the sdist is made once (``python -m build --sdist``: no native build), the
installed layouts are folders made here from the checkout and the current build, as
``llama_metaws.native.package`` lays out the wheel. The slow end-to-end check (the sdist
installed into a fresh venv, the demo and a smoke subset against it) is ``make package-check``.
"""

import email.parser
import json
import os
import pty
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import llama_metaws
from llama_metaws import paths
from llama_metaws.native import build, manifest, package
from llama_metaws.native.runtime import require_build

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    res = subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(out), str(ROOT)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (path,) = out.glob("llama_metaws-*.tar.gz")
    return path


def _members(sdist: Path) -> dict:
    with tarfile.open(sdist) as tar:
        return {m.name.split("/", 1)[1]: m for m in tar.getmembers() if "/" in m.name}


def _read(sdist: Path, name: str) -> str:
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/", 1)[0]
        return tar.extractfile(f"{top}/{name}").read().decode()


@pytest.mark.network
def test_the_sdist_holds_everything_the_native_build_reads(sdist):
    names = set(_members(sdist))
    series = [p.name for p in build.read_series(ROOT / "patches")]
    assert series and "patches/series" in names
    assert {f"patches/{n}" for n in series} <= names
    native = {p.relative_to(ROOT).as_posix() for p in (ROOT / "native").rglob("*")
              if p.is_file() and p.suffix in package.NATIVE_SUFFIXES and "__pycache__" not in p.parts}
    assert {"native/shim.h", "native/shim.c", "native/build_shim.py", "native/decl/llama.h"} <= native
    assert native <= names, native - names
    assert {"setup.py", "pyproject.toml", "LICENSE", "README.md", "llama_metaws/native/build.py",
            "llama_metaws/native/package.py", "tests/conftest.py"} <= names
    assert not [n for n in names if n.endswith((".so", ".o", ".pyc")) or n.startswith("build/")]


@pytest.mark.network
def test_the_sdist_metadata_is_complete(sdist):
    meta = email.parser.Parser().parsestr(_read(sdist, "PKG-INFO"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["Name"] == "llama-metaws"
    assert meta["Version"] == project["version"] == llama_metaws.__version__  # one place
    assert meta["License-Expression"] == "MIT" and meta.get_all("License-File") == ["LICENSE"]
    assert meta["Requires-Python"] == ">=3.10"
    classifiers = meta.get_all("Classifier")
    assert "Programming Language :: Python :: 3" in classifiers and "Operating System :: POSIX :: Linux" in classifiers
    assert len(meta.get_all("Project-URL")) >= 2
    assert set(meta.get_all("Provides-Extra")) == {"server", "plot", "nvidia", "test", "suite"}
    assert f"llama-cpp-python=={paths.SDIST_VERSION}" in meta.get_all("Requires-Dist")
    assert meta["Description-Content-Type"] == "text/markdown"
    entry = _read(sdist, "llama_metaws.egg-info/entry_points.txt")
    assert "[console_scripts]" in entry and "llama-metaws = llama_metaws.cli:main" in entry
    requires = tomllib.loads(_read(sdist, "pyproject.toml"))["build-system"]["requires"]
    assert any(r.startswith("cffi") for r in requires) and any(r.startswith("cmake") for r in requires)


@pytest.mark.network
def test_serve_s_chat_page_is_in_the_sdist_and_in_the_wheel_pip_builds_from_it(sdist, tmp_path):
    page = "llama_metaws/server/ui/index.html"
    assert page in _members(sdist)
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "src")
    (src,) = (tmp_path / "src").iterdir()
    env = dict(os.environ, **{package.AT_INSTALL_ENV: "0"})  # the sources only: no native build
    res = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(src)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("llama_metaws-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert z.read(page) == (ROOT / page).read_bytes()


def test_the_binding_s_own_options_leave_our_build_and_its_key_alone(tmp_path):
    assert build.own_cmake_args("-DLLAMA_BUILD=OFF -DLLAVA_BUILD:BOOL=OFF -DGGML_CUDA=on "
                                "-DLLAMA_BUILD_TESTS=ON") == ["-DGGML_CUDA=on", "-DLLAMA_BUILD_TESTS=ON"]
    patches = ROOT / "patches"
    plain = build.BuildInputs.collect(patches_dir=patches, cmake_args=build.own_cmake_args(""), compiler="cc")
    skipped = build.BuildInputs.collect(patches_dir=patches, compiler="cc",
                                        cmake_args=build.own_cmake_args("-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"))
    assert plain.key() == skipped.key()
    cuda = build.BuildInputs.collect(patches_dir=patches, compiler="cc",
                                     cmake_args=build.own_cmake_args("-DLLAMA_BUILD=OFF -DGGML_CUDA=on"))
    assert cuda.key() != plain.key() and cuda.cmake_args == ("-DGGML_CUDA=on",)


def _installed_layout(site: Path) -> Path:
    """The package as a wheel installs it (no checkout around it), without a native build."""
    pkg = site / "llama_metaws"
    shutil.copytree(ROOT / "llama_metaws", pkg, ignore=shutil.ignore_patterns("__pycache__", "_source", "_native"))
    package.copy_sources(ROOT, pkg / package.SOURCE_DIR)
    return pkg


def _clean_env(site: Path, **extra) -> dict:
    """The installed layout's environment: no checkout's manifest or sources, no library path; the
    suite's CMAKE_ARGS (tests/suite_env.py: the arguments the build under test was made with, which
    the bundled copy of it was made with too) stay, so ``build`` there computes that build's key."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LLAMA_METAWS_MANIFEST", "LLAMA_METAWS_SOURCE_ROOT", "LLAMA_CPP_LIB_PATH")}
    return dict(env, PYTHONPATH=str(site), **extra)


def test_an_installed_package_refuses_another_binding_version_as_a_checkout_does(tmp_path):
    site = tmp_path / "site"
    _installed_layout(site)
    fake = site / "llama_cpp_python-0.3.16.dist-info"  # found before the real one
    fake.mkdir()
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: 0.3.16\n")
    script = ("import importlib.util, sys; print(importlib.util.find_spec('llama_metaws').origin, flush=True); "
              "from llama_metaws.cli import main; sys.exit(main(['build']))")
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_clean_env(site),
                         capture_output=True, text=True, timeout=120)
    assert res.stdout.startswith(str(site / "llama_metaws")), res.stdout
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last == ("llama_metaws.errors.BindingVersionError: llama-cpp-python 0.3.16 is installed, but "
                    "llama-metaws patches the llama.cpp vendored in llama-cpp-python 0.3.36: install "
                    "llama-cpp-python==0.3.36"), res.stderr[-2000:]


def test_a_bundled_build_is_used_from_the_installed_package_alone(tmp_path):
    """The wheel's layout: the libraries without their soname links, the shim, a relative manifest.
    One copy of each library is loaded, the package's, and `build` finds nothing to do."""
    current = require_build()
    site = tmp_path / "site"
    pkg = _installed_layout(site)
    staged = package.copy_build(current, pkg / package.BUNDLE_DIR / current.root.name)
    assert not [p for p in staged.lib_dir.iterdir() if p.is_symlink()]
    path = package.write_bundled_manifest(staged, pkg / package.SOURCE_DIR / "build" / "manifest.json")
    doc = json.loads(path.read_text())
    assert doc["bundled"] and not os.path.isabs(doc["build"]) and not os.path.isabs(doc["shim"])
    script = r"""
import os, sys
import llama_metaws
from llama_metaws.native.runtime import require_build
from llama_metaws.engine.devices import list_devices
from llama_metaws import Llama
from llama_metaws_dev.testing import make_tiny_model
b = require_build()
assert b.bundled and str(b.root).startswith(sys.argv[1]), b
model = make_tiny_model(sys.argv[2] + "/m.gguf", seed=3)
with Llama(str(model), n_ctx=64, n_batch=32, verbose=False) as llm:
    print(repr(llm("the quick", max_tokens=4, temperature=0.0)["choices"][0]["text"]))
maps = sorted({l.split()[-1] for l in open("/proc/self/maps") if "libllama" in l or "libggml" in l})
print("\n".join(maps))
"""
    res = subprocess.run([sys.executable, "-c", script, str(pkg), str(tmp_path)], cwd=tmp_path,
                         env=_clean_env(site), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    maps = [m for m in res.stdout.splitlines()[1:] if m]
    assert maps and all(m.startswith(str(staged.lib_dir)) for m in maps), maps
    assert len([m for m in maps if os.path.basename(m).split(".so")[0] == "libllama"]) == 1, maps
    res = subprocess.run([sys.executable, "-m", "llama_metaws", "build"], cwd=tmp_path,
                         env=_clean_env(site), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"carries build {current.root.name}" in res.stderr and "nothing to build" in res.stderr
    assert json.loads(path.read_text()) == doc  # still the bundled build


def test_without_the_build_at_install_the_wheel_carries_the_sources(tmp_path, monkeypatch):
    monkeypatch.setenv(package.AT_INSTALL_ENV, "0")
    assert package.stage_wheel(tmp_path, progress=lambda line: None) is None
    src = tmp_path / "llama_metaws" / package.SOURCE_DIR
    assert (src / "patches" / "series").read_text() == (ROOT / "patches" / "series").read_text()
    assert build.shim_key("", src / "native") == build.shim_key("", ROOT / "native")
    assert not (tmp_path / "llama_metaws" / package.BUNDLE_DIR).exists()


def test_the_long_step_is_announced_on_the_terminal_when_pip_hides_stderr():
    """pip without -v captures the build's output: the announcement goes to /dev/tty too."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: a controlling terminal, stderr a pipe as under pip
        try:
            r, w = os.pipe()
            os.dup2(w, 2)
            package.announce("llama-metaws: a long step")
        finally:
            os._exit(0)
    out = b""
    while True:
        try:
            chunk = os.read(fd, 1024)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.waitpid(pid, 0)
    assert b"llama-metaws: a long step" in out


def test_a_machine_without_git_gets_a_clear_build_error(tmp_path, monkeypatch):
    """The patch step runs `git apply`: pip's build on a machine without git says so."""
    (tmp_path / "src").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(build.BuildError, match="git not found"):
        build.apply_patches(tmp_path / "src", build.read_series(ROOT / "patches")[:1], lambda line: None)
