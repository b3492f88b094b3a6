"""``llama-metaws build --tools`` (``tools_build``): llama.cpp's own tools from the same patched tree, cached under
a key of their own (the library inputs plus the tool targets)."""

import dataclasses
import subprocess
import sys


from llama_metaws.native import build
from llama_metaws.native import tools_build


def test_the_tools_key_is_not_the_library_key_and_follows_its_inputs():
    inputs = build.BuildInputs.collect()
    assert tools_build.tools_key(inputs) != inputs.key()
    assert tools_build.tools_key(inputs) == tools_build.tools_key(build.BuildInputs.collect())
    other = dataclasses.replace(inputs, cmake_args=("-DGGML_CUDA=ON",))
    assert tools_build.tools_key(other) != tools_build.tools_key(inputs)
    assert tools_build.tools_dir_for(inputs).parent == build.cache_root() / "tools"


def test_only_the_two_tools_are_built_with_the_common_library():
    assert tools_build.TOOL_TARGETS == ("llama-speculative-simple", "llama-bench")
    assert "-DLLAMA_BUILD_COMMON=ON" in tools_build.TOOLS_CMAKE_ARGS


def test_find_tools_is_none_without_a_tools_build(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_METAWS_CACHE", str(tmp_path))
    assert tools_build.find_tools() is None
    d = tools_build.tools_dir_for(build.BuildInputs.collect())
    (d / "bin").mkdir(parents=True)
    (d / "tools.json").write_text("{}")
    (d / "bin" / "llama-bench").write_text("")
    assert tools_build.find_tools() is None  # one target missing: not a tools build
    (d / "bin" / "llama-speculative-simple").write_text("")
    assert set(tools_build.find_tools()) == set(tools_build.TOOL_TARGETS)


def test_build_tools_returns_a_cached_build_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_METAWS_CACHE", str(tmp_path))
    inputs = build.BuildInputs.collect()
    d = tools_build.tools_dir_for(inputs)
    (d / "bin").mkdir(parents=True)
    (d / "tools.json").write_text("{}")
    for name in tools_build.TOOL_TARGETS:
        (d / "bin" / name).write_text("")
    lines = []
    found = tools_build.build_tools(inputs, lines.append)
    assert found == {name: d / "bin" / name for name in tools_build.TOOL_TARGETS}
    assert any("up to date" in line for line in lines)


def test_the_cli_build_has_a_tools_flag():
    res = subprocess.run([sys.executable, "-m", "llama_metaws", "build", "--help"],
                         capture_output=True, text=True)
    assert res.returncode == 0
    assert "--tools" in res.stdout and "llama-speculative-simple" in res.stdout
