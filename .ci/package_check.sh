#!/usr/bin/env bash
# make package-check: llama-metaws installed the way a user installs it, and used from there.
#
#   1. `python -m build` makes the sdist and, from it, the wheel; `twine check --strict` on both;
#      the wheel carries what users run and none of the developer package (dev/: the tests'
#      builders, the process helpers, the GPU run kit, the series check, the tools build, repro);
#   2. a fresh virtual environment in a temporary directory, and from a cwd there (no checkout on
#      sys.path) one pip command: the sdist with its server and test extras, CMAKE_ARGS with the
#      binding's -DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF (docs/installation.md, "With pip");
#   3. the installed package: imported from the venv, the binding without a native library of its
#      own, one libllama loaded (the wheel's), `llama-metaws build` in the installed package;
#   4. `llama-metaws demo`, then the developer package from the sdist's dev/ (the tests need it) and
#      a smoke subset of the sdist's tests against the installed package: Llama with MTP drafting
#      under tensor split, `serve` answering requests, `llama-metaws-dev repro`.
# The native build may be a hit of the cache key (~/.cache/llama-metaws/builds, LLAMA_METAWS_CACHE).
# Usage: .ci/package_check.sh [PYTHON]   (the interpreter of the fresh venv; default python3)
# PYTEST_ISOLATION (make package-check sets it to the Makefile's): pytest's options for the smoke
# tests, which run in a pytest-xdist worker so that a native crash fails one test, not the run.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILDER="$ROOT/.venv/bin/python"   # has build and twine (make package-check installs them)
BASE_PYTHON=${1:-python3}
TMP=$(mktemp -d "${TMPDIR:-/tmp}/llama-metaws-package.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
t0=$(date +%s)
step() { echo; echo "== package-check [$(( $(date +%s) - t0 )) s] $*"; }

step "1/4 python -m build (sdist, then the wheel from it), twine check"
"$BUILDER" -m build --outdir "$TMP/dist" "$ROOT"
"$BUILDER" -m twine check --strict "$TMP"/dist/*
SDIST=$(ls "$TMP"/dist/llama_metaws-*.tar.gz)
WHEEL=$(ls "$TMP"/dist/llama_metaws-*.whl)
ls -l "$TMP"/dist
"$BUILDER" - "$WHEEL" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
# the developer package's modules, by the names they have (and had) in the checkout
dev = [n for n in names if n.startswith("llama_metaws_dev/") or n.startswith("llama_metaws/testing/")
       or n.rsplit("/", 1)[-1] in ("gpukit.py", "series.py", "tools_build.py", "repro.py")
       or "/sidebyside/" in n or n.startswith("tests/") or n.startswith("dev/")]
assert not dev, f"the wheel carries developer code: {dev}"
py = [n for n in names if n.endswith(".py")]
assert "llama_metaws/demo/model.py" in py and "llama_metaws/cli/__init__.py" in py, py
print(f"the wheel: {len(py)} Python modules, none of the developer package")
EOF

step "2/4 one pip install of the sdist into a fresh venv ($BASE_PYTHON), cwd $TMP/cwd"
mkdir "$TMP/cwd"
cd "$TMP/cwd"
"$BASE_PYTHON" -m venv "$TMP/venv"
V="$TMP/venv/bin"
"$V/python" -m pip install --quiet --upgrade pip
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$V/python" -m pip install "$SDIST[server,test]"

step "3/4 the installed package"
LLAMA_METAWS_PACKAGE_CHECK_ROOT="$ROOT" "$V/python" - <<'EOF'
import importlib.util, os, pathlib, sys
root = os.environ["LLAMA_METAWS_PACKAGE_CHECK_ROOT"]
assert not any(p and os.path.realpath(p).startswith(root) for p in sys.path), sys.path
import llama_metaws
pkg = pathlib.Path(llama_metaws.__file__).resolve().parent
assert pkg.is_relative_to(pathlib.Path(sys.prefix).resolve()), pkg
binding = pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent
own = sorted(p.name for p in binding.rglob("*.so*"))
assert not own, f"the binding built a native library of its own: {own}"
from llama_metaws.native.runtime import require_build
b = require_build()
assert b.bundled and b.root == pkg / "_native" / b.manifest["key"], b
from llama_metaws.engine.devices import list_devices
print("devices:", [d.name for d in list_devices()])
maps = {line.split()[-1] for line in open("/proc/self/maps") if "libllama" in line or "libggml" in line}
print("loaded:", *sorted(maps), sep="\n  ")
assert maps and all(m.startswith(str(b.lib_dir)) for m in maps), maps
assert len([m for m in maps if os.path.basename(m).split(".so")[0] == "libllama"]) == 1, maps
print(f"llama-metaws {llama_metaws.__version__} from {pkg}: build {b.root.name}, binding {binding} "
      "without a native library of its own")
EOF
"$V/llama-metaws" build

step "4/4 llama-metaws demo, then the smoke tests against the installed package"
"$V/llama-metaws" demo
tar -xzf "$SDIST" -C "$TMP" --wildcards '*/tests/*' '*/dev/*'
"$V/python" -m pip install --quiet --no-deps "$(ls -d "$TMP"/llama_metaws-*/dev)"   # not editable: from the sdist
cp -r "$TMP"/llama_metaws-*/tests "$TMP/cwd/tests"   # the tests alone: no package beside them
# shellcheck disable=SC2086  # PYTEST_ISOLATION: make's options for pytest, word-split on purpose
"$V/python" -m pytest -q -p no:cacheprovider -rfE ${PYTEST_ISOLATION:-} \
    "tests/test_llama.py::test_greedy_identity_with_and_without_drafting" \
    "tests/test_server.py::test_completions_streamed_and_not_give_the_same_greedy_text" \
    "tests/test_tensor_split.py::test_llama_level_reproduction" \
    "tests/test_tensor_split.py::test_the_repro_cli_json"
step "done: the sdist installs and runs from a fresh venv"
