"""``llama-metaws build --tools`` (``tools_build``): llama.cpp's own tools from the same patched tree, cached under
a key of their own (the library inputs plus the tool targets)."""

import dataclasses
import json
import subprocess
import sys

import pytest

from llama_metaws import paths
from llama_metaws.native import build
from llama_metaws_dev import tools_build


def test_the_tools_key_is_not_the_library_key_and_follows_its_inputs():
    inputs = build.BuildInputs.collect()
    assert tools_build.tools_key(inputs) != inputs.key()
    assert tools_build.tools_key(inputs) == tools_build.tools_key(build.BuildInputs.collect())
    other = dataclasses.replace(inputs, cmake_args=("-DGGML_CUDA=ON",))
    assert tools_build.tools_key(other) != tools_build.tools_key(inputs)
    assert tools_build.tools_dir_for(inputs).parent == paths.cache_root() / "tools"


def test_the_tools_and_the_server_are_built_with_the_common_library():
    assert tools_build.TOOL_TARGETS == ("llama-speculative-simple", "llama-bench", "llama-server",
                                        "llama-batched-bench")
    args = tools_build.TOOLS_CMAKE_ARGS
    assert "-DLLAMA_BUILD_COMMON=ON" in args
    # the server's CMake: its subdirectory, and its web UI neither downloaded nor built (offline)
    assert "-DLLAMA_BUILD_SERVER=ON" in args
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in args and "-DLLAMA_BUILD_UI=OFF" in args
    # a later -D wins: the base arguments turn the server off, the tools' turn it on after them
    cmd = [*build.BASE_CMAKE_ARGS, *args]
    assert max(i for i, x in enumerate(cmd) if x.startswith("-DLLAMA_BUILD_SERVER=")) == \
        cmd.index("-DLLAMA_BUILD_SERVER=ON")


def test_the_tools_key_follows_the_targets_and_their_cmake_arguments(monkeypatch):
    inputs = build.BuildInputs.collect()
    key = tools_build.tools_key(inputs)
    monkeypatch.setattr(tools_build, "TOOL_TARGETS", tools_build.TOOL_TARGETS[:2])
    assert tools_build.tools_key(inputs) != key  # a build without the server is another build
    monkeypatch.undo()
    monkeypatch.setattr(tools_build, "TOOLS_CMAKE_ARGS",
                        tuple(a for a in tools_build.TOOLS_CMAKE_ARGS if "PREBUILT_UI" not in a))
    assert tools_build.tools_key(inputs) != key


def test_find_tools_is_none_without_a_tools_build(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_METAWS_CACHE", str(tmp_path))
    assert tools_build.find_tools() is None
    d = tools_build.tools_dir_for(build.BuildInputs.collect())
    (d / "bin").mkdir(parents=True)
    (d / "tools.json").write_text("{}")
    for name in tools_build.TOOL_TARGETS[:-1]:
        (d / "bin" / name).write_text("")
    assert tools_build.find_tools() is None  # one target missing: not a tools build
    (d / "bin" / tools_build.TOOL_TARGETS[-1]).write_text("")
    found = tools_build.find_tools()
    assert found == {name: d / "bin" / name for name in tools_build.TOOL_TARGETS}
    assert {"llama-server", "llama-batched-bench"} <= set(found)


def _cached_tools(inputs):
    """A tools entry in the cache for these inputs, as a finished build leaves it (empty files)."""
    d = tools_build.tools_dir_for(inputs)
    (d / "bin").mkdir(parents=True)
    (d / "tools.json").write_text("{}")
    for name in tools_build.TOOL_TARGETS:
        (d / "bin" / name).write_text("")
    return d


def test_build_tools_returns_a_cached_build_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_METAWS_CACHE", str(tmp_path))
    inputs = build.BuildInputs.collect()
    d = _cached_tools(inputs)
    lines = []
    found = tools_build.build_tools(inputs, lines.append)
    assert found == {name: d / "bin" / name for name in tools_build.TOOL_TARGETS}
    assert any("up to date" in line for line in lines)


def test_the_cli_build_has_a_tools_flag():
    res = subprocess.run([sys.executable, "-m", "llama_metaws", "build", "--help"],
                         capture_output=True, text=True)
    assert res.returncode == 0
    assert "--tools" in res.stdout
    for name in tools_build.TOOL_TARGETS:
        assert name in res.stdout


def test_the_built_server_takes_the_flags_the_benchmarks_pass():
    """Where ``build --tools`` has run: llama-server and llama-batched-bench start, and llama-server
    knows the flags bench_memory.py and bench_concurrency.py give it."""
    found = tools_build.find_tools()
    if found is None:
        pytest.skip("no tools build for these inputs (llama-metaws build --tools)")
    res = subprocess.run([str(found["llama-server"]), "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    for flag in ("--spec-type", "--spec-draft-n-max", "-np", "-lv", "--metrics", "-fa", "-ub"):
        assert flag in res.stdout, flag
    assert "draft-mtp" in res.stdout
    res = subprocess.run([str(found["llama-batched-bench"]), "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "-npl" in res.stdout


def test_the_tools_are_built_in_the_librarys_own_tree(tmp_path, monkeypatch):
    """build_in_tree reconfigures a library build's tree with the tools' arguments and builds only the
    tool targets: the library's objects are not compiled again (a tiny CMake project stands in for
    llama.cpp, whose tools build only when LLAMA_BUILD_TOOLS is on, as llama.cpp's do)."""
    import os

    src, bdir = tmp_path / "src", tmp_path / "work" / "cmake-build"
    src.mkdir()
    (src / "lib.c").write_text("int lib_answer(void) { return 42; }\n")
    (src / "tool.c").write_text("int lib_answer(void);\nint main(void) { return lib_answer() == 42 ? 0 : 1; }\n")
    (src / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.14)\nproject(standin C)\n"
        "set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n"
        "set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)\n"
        "add_library(standin SHARED lib.c)\n"
        "if (LLAMA_BUILD_TOOLS)\n  add_executable(standin-tool tool.c)\n"
        "  target_link_libraries(standin-tool standin)\nendif()\n")
    env = dict(os.environ)
    cmake = build._cmake()
    subprocess.run([cmake, "-S", str(src), "-B", str(bdir), *build._generator_args(), *build.BASE_CMAKE_ARGS],
                   check=True, capture_output=True, env=env)
    subprocess.run([cmake, "--build", str(bdir)], check=True, capture_output=True, env=env)
    lib_obj = next(bdir.rglob("lib.c.o"))
    compiled = lib_obj.stat().st_mtime_ns
    assert not (bdir / "bin" / "standin-tool").exists()  # the library build has no tools

    monkeypatch.setenv("LLAMA_METAWS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tools_build, "TOOL_TARGETS", ("standin-tool",))
    inputs = build.BuildInputs.collect()
    lines = []
    found = tools_build.build_in_tree(inputs, src, bdir, env, lines.append)
    final = tools_build.tools_dir_for(inputs)
    assert found == {"standin-tool": final / "bin" / "standin-tool"} == tools_build.find_tools(inputs)
    assert lib_obj.stat().st_mtime_ns == compiled  # ggml and llama's stand-in: not compiled again
    assert subprocess.run([str(found["standin-tool"])]).returncode == 0  # runs beside its library
    assert json.loads((final / "tools.json").read_text())["built"] == "in the library's tree"
    assert any("in the library's tree" in line for line in lines)
    assert not (bdir / "bin").exists()  # moved into the cache, not copied


def test_with_the_library_and_the_tools_cached_nothing_is_built(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_METAWS_CACHE", str(tmp_path))
    inputs = build.BuildInputs.collect()
    lib = build.build_dir_for(inputs)
    lib.mkdir(parents=True)
    (lib / "build.json").write_text("{}")
    d = _cached_tools(inputs)
    lines = []
    got, tools = tools_build.build_with_tools(inputs, lines.append)
    assert got.root == lib and tools == tools_build.find_tools(inputs)
    assert lines == [f"llama-metaws: tools {tools_build.tools_key(inputs)} are up to date ({d})"]
