# Two commands do all set-up on a fresh machine with Python 3.10+:
#   make demo   the main job on the embedded default (tiny model, two CPU devices)
#   make test   the test suite
# Both create .venv, install the dependencies, run the native build (cached by the hash of
# its inputs: an unchanged series takes seconds) and the tiny model, then run.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The binding is installed without its own native build: our patched build replaces it.
BINDING_CMAKE_ARGS := -DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF

# The sanitizer build: AddressSanitizer + UndefinedBehaviorSanitizer over the patched ggml/llama
# and the shim (its own cache key), and the workspace/alias/fault tests under it, the allocation
# sweep and test-llama-archs's phase-workspace lifecycle (built sanitized, in the sanitizer build's
# directory) among them, and the engine's N slots at once under tensor split and its faults.
SANITIZE_CMAKE_ARGS := -DGGML_SANITIZE_ADDRESS=ON -DGGML_SANITIZE_UNDEFINED=ON \
	-DLLAMA_SANITIZE_ADDRESS=ON -DLLAMA_SANITIZE_UNDEFINED=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
# its own manifest: the run time reads the manifest, never CMAKE_ARGS (see manifest.manifest_path)
SANITIZE_MANIFEST := LLAMA_METAWS_MANIFEST="$(CURDIR)/build/manifest-sanitize.json"
SANITIZE_ENV := $(SANITIZE_MANIFEST) \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:no_huge_pages_for_shadow=0 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 GGML_NO_BACKTRACE=1 \
	LLAMA_METAWS_SWEEP_STRIDE=10
# detect_leaks=0: a Python process holds its native pointers in ints, which LeakSanitizer cannot
# read; the sweep's child runs a leak check with its open model as the root, and test-llama-archs
# (a C++ program) runs with detect_leaks=1.
# no_huge_pages_for_shadow=0: the meta backend's 368 MiB tensor contexts (two per device in
# each meta buffer) cost ASan a shadow of 46 MiB each to poison; on huge pages a tensor-split
# request runs several times faster (bench/BENCHMARKS.md). The sweep samples every 10th allocation index and the last one
# (make test walks them all).
SANITIZE_TESTS := tests/test_workspace.py tests/test_tensor_split.py tests/test_faults.py \
	tests/test_memory_pressure.py tests/test_host_kv.py tests/test_sweep.py \
	tests/test_recurrent_seq_rm.py tests/test_mtp_block.py \
	tests/test_llama_archs.py::test_the_phase_workspace_lifecycle_over_a_random_mtp_model \
	tests/test_engine.py::test_concurrent_requests_under_tensor_split_equal_their_solo_outputs \
	tests/test_engine.py::test_an_allocation_failure_fails_the_requests_of_its_step_and_the_retries_match

# make test (and peer-tests, and package-check's smoke run) run the tests in a pytest-xdist worker
# process: a native crash (a SIGSEGV in llama.cpp) fails the test it happened in, by name ("worker
# 'gw0' crashed while running ..."), a new worker goes on with the tests after it, and the summary
# counts them all (tests/test_native_crash.py). One worker: the tests were not written to run side
# by side, and the machines they run on may have 2 cores.
PYTEST_ISOLATION := -n 1 --max-worker-restart=50

.PHONY: setup build demo test package-check server-suite peer-tests series-check install-ccache bench sanitize clean-build gpu-kit gpu-kit-dry-run

$(VENV)/.deps: pyproject.toml dev/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	CMAKE_ARGS="$(BINDING_CMAKE_ARGS)" $(PY) -m pip install --quiet --no-binary llama-cpp-python "llama-cpp-python==0.3.36"
	$(PY) -m pip install --quiet cmake ninja setuptools build twine
	$(PY) -m pip install --quiet -e ".[test,plot,suite]"
	$(PY) -m pip install --quiet --no-deps -e dev
	touch $@

setup: $(VENV)/.deps build

build: $(VENV)/.deps
	$(VENV)/bin/llama-metaws build

demo: setup
	$(VENV)/bin/llama-metaws demo

test: setup
	$(PY) -m pytest -ra $(PYTEST_ISOLATION) -m "not peer" tests

# The package as a user installs it (docs/installation.md, "With pip"): python -m build, twine
# check, the sdist into a fresh venv in a temporary directory with one pip command, then
# llama-metaws demo and a smoke subset of the tests against the installed package (.ci/package_check.sh;
# the native build is a hit of the cache key when make setup built the same inputs).
package-check: setup
	PYTEST_ISOLATION="$(PYTEST_ISOLATION)" .ci/package_check.sh $(PYTHON)

# llama.cpp's own server suite (tools/server/tests of the pinned sdist, unpacked under
# build/server-suite) against llama-metaws serve through tests/server_suite's llama-server shim,
# tiny stand-ins for its models; tests/server_suite/expected_failures.txt lists what cannot
# pass and why. Prints the count; fails when a test not listed fails.
server-suite: setup
	$(PY) tests/server_suite/run.py

# llama.cpp's test-llama-archs (and our workspace lifecycle in it), built with the vendored CMake
# once per build key, linked against the build's installed ggml and llama (only the common
# library and the test are compiled): tests/test_llama_archs.py
peer-tests: setup
	$(PY) -m pytest -ra $(PYTEST_ISOLATION) -m peer tests

# The patch series is bisectable: each patch applied in turn to the vendored llama.cpp, the
# libraries built and llama.cpp's test-alloc run after each (dev/llama_metaws_dev/series.py;
# bench/BENCHMARKS.md records how long it took). ccache makes a repeated run mostly cache hits: it is installed
# with apt-get when missing (as root, or through sudo).
series-check: $(VENV)/.deps
	@command -v ccache >/dev/null 2>&1 || $(MAKE) --no-print-directory install-ccache
	$(VENV)/bin/llama-metaws-dev series-check

SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
install-ccache:
	$(SUDO) apt-get update -qq
	$(SUDO) apt-get install -y -qq ccache

bench: setup
	$(PY) bench/bench_workspace.py
	$(PY) bench/bench_tensor_split.py
	$(PY) bench/bench_llama.py
	$(PY) bench/bench_reuse.py
	$(PY) bench/bench_vram.py

sanitize: $(VENV)/.deps
	CMAKE_ARGS="$(SANITIZE_CMAKE_ARGS)" $(SANITIZE_MANIFEST) $(VENV)/bin/llama-metaws build
	$(SANITIZE_ENV) $(PY) -m pytest -q -p no:cacheprovider $(SANITIZE_TESTS)

# The GPU run kit (docs/gpu-kit.md): made here, run offline on an NVIDIA machine.
gpu-kit: $(VENV)/.deps
	$(VENV)/bin/llama-metaws-dev gpu-kit --out build/gpu-kit

# The kit's run.sh --cpu into a fresh venv with no network: proves the kit self-contained.
gpu-kit-dry-run: $(VENV)/.deps
	$(VENV)/bin/llama-metaws-dev gpu-kit --out build/gpu-kit-dry --dry-run

clean-build:
	rm -rf "$${LLAMA_METAWS_CACHE:-$${XDG_CACHE_HOME:-$$HOME/.cache}/llama-metaws}/builds"
