"""The native build: its cache key, its cache, and a patch that does not apply."""

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llama_metaws import paths
from llama_metaws.native import build
from llama_metaws.native import runtime
from llama_metaws.errors import BindingVersionError

ROOT = Path(__file__).resolve().parent.parent


def _copy_patches(tmp_path: Path) -> Path:
    d = tmp_path / "patches"
    shutil.copytree(ROOT / "patches", d)
    return d


def test_same_inputs_give_the_same_key(tmp_path):
    a = build.BuildInputs.collect(patches_dir=_copy_patches(tmp_path / "a"), cmake_args=[])
    b = build.BuildInputs.collect(patches_dir=_copy_patches(tmp_path / "b"), cmake_args=[])
    assert a == b and a.key() == b.key()


def test_a_changed_patch_gives_a_new_key(tmp_path):
    d = _copy_patches(tmp_path)
    before = build.BuildInputs.collect(patches_dir=d, cmake_args=[])
    first = build.read_series(d)[0]
    first.write_text(first.read_text() + "\n")
    after = build.BuildInputs.collect(patches_dir=d, cmake_args=[])
    assert after.key() != before.key()


def test_cmake_args_and_compiler_are_in_the_key(tmp_path):
    d = _copy_patches(tmp_path)
    base = build.BuildInputs.collect(patches_dir=d, cmake_args=[], compiler="gcc 12")
    assert build.BuildInputs.collect(patches_dir=d, cmake_args=["-DGGML_CUDA=ON"], compiler="gcc 12").key() != base.key()
    assert build.BuildInputs.collect(patches_dir=d, cmake_args=[], compiler="gcc 13").key() != base.key()


def test_the_rpc_backend_is_in_every_build_and_in_the_key(tmp_path):
    inputs = build.BuildInputs.collect(patches_dir=_copy_patches(tmp_path), cmake_args=[])
    assert "-DGGML_RPC=ON" in inputs.base_cmake_args
    without = dataclasses.replace(inputs, base_cmake_args=tuple(
        a for a in inputs.base_cmake_args if a != "-DGGML_RPC=ON"))
    assert without.key() != inputs.key()


def test_cmake_args_come_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90")
    inputs = build.BuildInputs.collect(patches_dir=_copy_patches(tmp_path))
    assert inputs.cmake_args == ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90")


def test_series_naming_a_missing_patch_is_an_error(tmp_path):
    d = _copy_patches(tmp_path)
    (d / "series").write_text("0099-nothing-here.patch\n")
    with pytest.raises(build.BuildError, match="0099-nothing-here.patch"):
        build.read_series(d)


#: a line of one of the build's six steps (``[4/6] configure: ...``): none when the build is cached
STEP_LINE = re.compile(r"^\[\d+/\d+\]", re.M)


def test_unchanged_inputs_do_not_rebuild():
    """A cache hit: no step runs and the build directory is left as it was."""
    current = runtime.require_build()
    stamp = (current.root / "build.json").stat().st_mtime_ns
    lines = []
    again = build.build_library(build.BuildInputs.collect(), lines.append)
    assert again.root == current.root
    assert (current.root / "build.json").stat().st_mtime_ns == stamp
    assert any("up to date" in line for line in lines)
    assert not [line for line in lines if STEP_LINE.match(line)], lines


def test_the_cli_build_is_cached():
    """``llama-metaws build`` with unchanged inputs: no step, no shim compiled, nothing rewritten
    but the manifest (timeout: a hang detector, far above a cache hit)."""
    current = runtime.require_build()
    stamps = {p: p.stat().st_mtime_ns for p in (current.root / "build.json", current.shim)}
    res = subprocess.run([sys.executable, "-m", "llama_metaws", "build"], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    assert "up to date" in res.stderr
    assert not STEP_LINE.search(res.stderr) and "building the cffi shim" not in res.stderr, res.stderr
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert Path(res.stdout.strip()) == current.root


BAD_PATCH = """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
Subject: [PATCH] test : a patch whose context is not in the tree

---
 include/llama.h | 1 +
 1 file changed, 1 insertion(+)

diff --git a/include/llama.h b/include/llama.h
--- a/include/llama.h
+++ b/include/llama.h
@@ -10,3 +10,4 @@
 this line is not in llama.h
 nor is this one
 or this one
+int added_by_a_bad_patch;
"""


def test_a_patch_that_does_not_apply_names_itself_and_the_hunk(tmp_path):
    src = tmp_path / "src"
    (src / "include").mkdir(parents=True)
    (src / "include" / "llama.h").write_text("".join(f"line {i}\n" for i in range(40)))
    bad = tmp_path / "0002-bad.patch"
    bad.write_text(BAD_PATCH)
    with pytest.raises(build.BuildError) as err:
        build.apply_patches(src, [bad], lambda line: None)
    msg = str(err.value)
    assert "0002-bad.patch" in msg
    assert "include/llama.h:10" in msg  # the file and the hunk git reported


def test_the_full_build_stops_at_a_bad_patch_and_names_it(tmp_path, monkeypatch):
    """Steps 1-3 for real (the sdist from the shared download cache), then the named failure."""
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "patches", root / "patches")
    (root / "patches" / "0002-bad.patch").write_text(BAD_PATCH)
    with open(root / "patches" / "series", "a") as f:
        f.write("0002-bad.patch\n")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "downloads").symlink_to(paths.cache_root() / "downloads", target_is_directory=True)
    monkeypatch.setenv("LLAMA_METAWS_SOURCE_ROOT", str(root))
    monkeypatch.setenv("LLAMA_METAWS_CACHE", str(cache))
    lines = []
    with pytest.raises(build.BuildError, match=r"patch step: 0002-bad.patch does not apply"):
        build.build_library(build.BuildInputs.collect(), lines.append)
    assert any(line.startswith("[3/6] patch") for line in lines)
    assert not any(line.startswith("[4/6]") for line in lines)
    # nothing half-built is left where a later run would take it for a build
    assert not any((cache / "builds").glob("*/build.json"))


PATCH_SYMBOLS = {
    "libllama.so": ["llama_n_compute_buffers", "llama_get_compute_buffer",  # 0001
                    "llama_set_phase_aware_workspace", "llama_attach_shared_workspace",  # 0005
                    "llama_get_compute_buffer_state", "llama_set_workspace_meta_sharing",  # 0005, 0010
                    "llama_state_seq_get_data_back"],  # 0024
    "libggml-base.so": ["ggml_gallocr_set_resizable", "ggml_gallocr_request_shrink",  # 0002
                        "ggml_backend_sched_set_resizable",  # 0003
                        # 0004, a testing option the plugin's builds turn on (build.BASE_CMAKE_ARGS)
                        "ggml_backend_inject_alloc_failure",
                        "ggml_backend_meta_buffer_alias",  # 0008
                        "ggml_gallocr_set_meta_sharing"],  # 0009
    # the RPC backend is in every build (build.BASE_CMAKE_ARGS); patch 0019's
    # ggml_backend_rpc_server_ok is reached through the registry (test_rpc.py)
    "libggml-rpc.so": ["ggml_backend_rpc_start_server", "ggml_backend_rpc_add_server"],
}


@pytest.mark.parametrize("lib", sorted(PATCH_SYMBOLS))
def test_the_built_libraries_export_our_symbols(lib):
    path = runtime.require_build().lib_dir / lib
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True,
                         check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    missing = [sym for sym in PATCH_SYMBOLS[lib] if sym not in exported]
    assert not missing, f"{lib} lacks {missing}"


def test_each_patch_is_numbered_by_its_place_and_titled_without_a_count():
    """git format-patch -N: "[PATCH] area : what", the file numbered by its place in the series
    (a "[PATCH nn/10]" left in a longer series misnumbers it)."""
    for i, patch in enumerate(build.read_series(ROOT / "patches"), 1):
        assert patch.name.startswith(f"{i:04d}-"), patch.name
        subject = next(line for line in patch.read_text().splitlines() if line.startswith("Subject: "))
        assert re.match(r"Subject: \[PATCH\] [\w.-]+ : \S", subject), (patch.name, subject)
        assert "From: llama-metaws <dev@llama-metaws>" in patch.read_text()


def test_the_public_headers_carry_no_allocator_types_and_no_testing_hook():
    """llama.h speaks llama's own types (llama_compute_buffer_state, llama_workspace_meta_sharing),
    and no installed header declares the allocation-failure injector (a testing build option,
    declared in ggml's internal ggml-backend-impl.h)."""
    include = runtime.require_build().include_dir
    llama_h = (include / "llama.h").read_text()
    assert "llama_compute_buffer_state" in llama_h and "llama_workspace_meta_sharing" in llama_h
    assert "ggml_gallocr" not in llama_h
    offenders = [h.name for h in include.glob("*.h") if "inject_alloc_failure" in h.read_text()]
    assert not offenders, offenders


def _added_llama_h_calls():
    names = []
    for patch in build.read_series(ROOT / "patches"):
        in_llama_h = False
        for line in patch.read_text().splitlines():
            if line.startswith("diff --git "):
                in_llama_h = line.endswith(" b/include/llama.h")
            elif in_llama_h and line.startswith("+") and "LLAMA_API" in line:
                names.append(re.search(r"(llama_\w+)\s*\(", line).group(1))
    return names


def _documented(lines, i):
    """A comment right above line i's declaration, or above the group it belongs to (declarations
    and their continuation lines, blank lines between them, as llama_state_seq_*_ext are)."""
    k = i - 1
    while k >= 0:
        line = lines[k]
        if line.strip().startswith("//"):
            return True
        if "LLAMA_API" in line or (line.startswith(" " * 8) and line.strip()):
            k -= 1
        elif not line.strip() and k > 0 and lines[k - 1].rstrip().endswith(");"):
            k -= 1
        else:
            return False
    return False


def test_every_call_the_series_adds_to_llama_h_is_documented():
    lines = (runtime.require_build().include_dir / "llama.h").read_text().splitlines()
    names = _added_llama_h_calls()
    assert "llama_get_compute_buffer_state" in names and "llama_state_seq_get_data_back" in names
    at = {name: next(k for k, line in enumerate(lines) if "LLAMA_API" in line and re.search(rf"\b{name}\s*\(", line))
          for name in names}
    undocumented = [name for name, i in at.items() if not _documented(lines, i)]
    assert not undocumented, undocumented


def test_the_documentation_check_finds_an_undocumented_call():
    lines = ["    // what f does", "    LLAMA_API void f(int a,", "            int b);", "",
             "    LLAMA_API void g(int a);", "", "    struct s {", "    };", "", "    LLAMA_API void h(void);"]
    assert _documented(lines, 1) and _documented(lines, 4) and not _documented(lines, 9)


def test_the_snapshot_read_is_a_const_method_of_the_memory_interface():
    """Patch 0024: llama_memory_i::state_write_back, const; the context casts to no memory type."""
    src = runtime.require_build().src_dir / "src"
    memory_h = (src / "llama-memory.h").read_text()
    assert re.search(r"virtual bool state_write_back\([^)]*\) const", memory_h)
    assert "dynamic_cast" not in (src / "llama-context.cpp").read_text()


MAPS_SCRIPT = """
import llama_metaws, llama_cpp
import llama_metaws.engine.buffers  # loads the cffi shim too
import json, re
paths = set()
for line in open('/proc/self/maps'):
    parts = line.split()
    if len(parts) >= 6 and re.search(r'/lib(ggml-base|ggml|ggml-cpu|llama)\\.so', parts[5]):
        paths.add(parts[5])
print(json.dumps(sorted(paths)))
"""


def test_one_copy_of_each_library_from_our_build():
    import json

    res = subprocess.run([sys.executable, "-c", MAPS_SCRIPT], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    paths = json.loads(res.stdout)
    lib_dir = str(runtime.require_build().lib_dir.resolve())
    for name in ("libggml-base.so", "libllama.so"):
        hits = [p for p in paths if os.path.basename(p).startswith(name)]
        assert len(hits) == 1, (name, paths)
        assert os.path.dirname(hits[0]) == lib_dir, (hits, lib_dir)


def test_another_binding_version_is_a_clear_error(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.3.16")
    with pytest.raises(BindingVersionError) as err:
        runtime.check_binding_version()
    assert "0.3.16" in str(err.value) and "0.3.36" in str(err.value)


def test_importing_llama_cpp_first_from_elsewhere_is_refused(tmp_path):
    """A binding that loaded other libraries before us would give two copies of ggml."""
    script = (
        "import os, sys, types\n"
        "fake = types.ModuleType('llama_cpp.llama_cpp'); fake._base_path = '/somewhere/else'\n"
        "sys.modules['llama_cpp.llama_cpp'] = fake\n"
        "import llama_metaws\n"
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert res.returncode != 0
    assert "import llama_metaws first" in res.stderr
