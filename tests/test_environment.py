"""The suite depends on the code, not on the shell it runs in (tests/suite_env.py)."""

import os
import subprocess
import sys
from pathlib import Path

from llama_metaws.native.runtime import require_build
from suite_env import suite_environment

ROOT = Path(__file__).resolve().parent.parent

#: what a developer's shell may export that would change what the tests check
EXPORTED = {
    "CMAKE_ARGS": "-DGGML_NATIVE=OFF -DGGML_AVX512=OFF",  # another build key
    "LLAMA_ARG_CTX_SIZE": "7",  # serve reads llama-server's variables
    "LLAMA_ARG_N_PARALLEL": "9",
    "LLAMA_METAWS_SOMETHING_ELSE": "1",
}


def test_the_suite_environment_drops_the_shells_variables_and_pins_the_build():
    build = require_build()
    env = suite_environment(dict(os.environ, **EXPORTED), build)
    assert not [k for k in env if k.startswith("LLAMA_ARG_")]
    assert "LLAMA_METAWS_SOMETHING_ELSE" not in env
    assert env.get("CMAKE_ARGS", "") != EXPORTED["CMAKE_ARGS"]
    assert env["LLAMA_CPP_LIB_PATH"] == str(build.lib_dir)
    # the variables that say which build is under test are kept
    kept = dict(os.environ, LLAMA_METAWS_TEST_DEVICES="CPU,CPU", LLAMA_METAWS_MANIFEST="m.json")
    env = suite_environment(kept, build)
    assert env["LLAMA_METAWS_TEST_DEVICES"] == "CPU,CPU" and env["LLAMA_METAWS_MANIFEST"] == "m.json"


def test_tests_that_read_the_build_key_and_the_servers_defaults_pass_with_them_exported():
    """Tests that computed another build key under an exported CMAKE_ARGS, or that a server started
    with another context size would fail, run in a child pytest with those variables exported."""
    chosen = ["tests/test_build.py::test_unchanged_inputs_do_not_rebuild",
              "tests/test_packaging.py::test_a_bundled_build_is_used_from_the_installed_package_alone",
              "tests/test_environment.py::test_the_suite_environment_drops_the_shells_variables_and_pins_the_build"]
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *chosen],
                         cwd=ROOT, env=dict(os.environ, **EXPORTED), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert f"{len(chosen)} passed" in res.stdout, res.stdout[-2000:]
