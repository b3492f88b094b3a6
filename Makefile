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

.PHONY: setup build demo test bench clean-build

$(VENV)/.deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	CMAKE_ARGS="$(BINDING_CMAKE_ARGS)" $(PY) -m pip install --quiet --no-binary llama-cpp-python "llama-cpp-python==0.3.36"
	$(PY) -m pip install --quiet cmake ninja setuptools
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

setup: $(VENV)/.deps build

build: $(VENV)/.deps
	$(VENV)/bin/llama-metaws build

demo: setup
	$(VENV)/bin/llama-metaws demo

test: setup
	$(PY) -m pytest -ra tests

bench: setup
	$(PY) -m pytest -q bench

clean-build:
	rm -rf "$${LLAMA_METAWS_CACHE:-$${XDG_CACHE_HOME:-$$HOME/.cache}/llama-metaws}/builds"
