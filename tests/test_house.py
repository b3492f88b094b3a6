"""The house rules of the Python layer: its import graph, one door to the binding,
the build manifest, and params set only by the names the binding's structs declare."""

import ast
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import llama_cpp
import llama_cpp.llama_cpp as llama_cpp_lib

from llama_metaws.native import build
from llama_metaws.native import manifest
from llama_metaws.native.params import set_fields

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "llama_metaws"


def _modules():
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def import_graph():
    """module -> the package's modules it imports (anywhere in it: function-level imports too)."""
    mods = _modules()
    graph = {}
    for name, f in mods.items():
        package = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
                if subs:  # `from . import x`: the module x, not the package
                    deps.update(subs)
                elif target in mods:
                    deps.add(target)
        deps.discard(name)
        graph[name] = deps
    return graph


def _find_cycle(graph):
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = "done"
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert "llama_metaws.tools.vram.harness" in graph and "llama_metaws.native.binding" in graph
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


# The package's layers, bottom up, and the layers each may import (its own included).
LAYERS = {
    "errors": set(),
    "paths": set(),                                     # the cache folder, the pinned binding
    "native": {"paths", "errors"},
    "engine": {"native", "paths", "errors"},
    "demo": {"paths", "errors"},                        # the demo's models and their writer
    "frontends": {"engine", "native", "paths", "errors"},  # Llama, server/, the flag tables
    "tools": {"frontends", "engine", "native", "demo", "paths", "errors"},
    "cli": {"tools", "frontends", "engine", "native", "demo", "paths", "errors"},
}

#: llama.cpp's command-line vocabulary, which ``serve`` reads as the command line does: the
#: front-ends' layer, though it sits in cli/
SHARED_FLAG_TABLES = ("llama_metaws.cli.flags", "llama_metaws.cli.server_flags")


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:  # llama_metaws/__init__.py: the package's face, with the front-ends
        return "frontends"
    if module in SHARED_FLAG_TABLES:
        return "frontends"
    head = parts[1]
    if head in ("native", "engine", "tools", "demo", "errors", "paths", "cli"):
        return head
    if head == "__main__":
        return "cli"
    return "frontends"  # api/ (Llama, completion, chat layer, state), server/


def upward_imports(graph):
    return sorted(f"{a} ({layer_of(a)}) imports {b} ({layer_of(b)})" for a, deps in graph.items()
                  for b in deps if layer_of(b) != layer_of(a) and layer_of(b) not in LAYERS[layer_of(a)])


def test_no_module_imports_from_a_layer_above_its_own():
    graph = import_graph()
    assert {layer_of(m) for m in graph} == set(LAYERS)
    assert upward_imports(graph) == []


def test_the_layer_check_finds_an_upward_import():
    bad = {"llama_metaws.engine.workspace": {"llama_metaws.api.llama"}, "llama_metaws.api.llama": set()}
    assert upward_imports(bad) == ["llama_metaws.engine.workspace (engine) imports llama_metaws.api.llama (frontends)"]


def test_importing_the_package_loads_no_model_builder():
    res = _python("import sys, llama_metaws; from llama_metaws import Llama; "
                  "print(sorted(m for m in sys.modules if m.startswith(('llama_metaws_dev', 'llama_metaws.demo'))))",
                  dict(os.environ))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "[]"


def test_errors_is_a_leaf_and_check_error_sits_beside_the_compiled_shim():
    graph = import_graph()
    assert graph["llama_metaws.errors"] == set()
    from llama_metaws import errors
    from llama_metaws.native import shim as _native

    assert hasattr(_native, "check_error") and not hasattr(errors, "check_error")


def test_nothing_in_the_package_imports_the_developer_package_but_build_tools():
    """The wheel works without dev/: only ``llama-metaws build --tools`` reaches for it (and says
    what to install when it is missing)."""
    offenders = []
    for name, f in _modules().items():
        for node in ast.walk(ast.parse(f.read_text())):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders += [f"{name}: {m}" for m in mods if m.split(".")[0] == "llama_metaws_dev"]
    assert offenders == ["llama_metaws.cli: llama_metaws_dev"], offenders


def test_without_the_developer_package_build_tools_says_what_to_install(tmp_path):
    blocker = tmp_path / "llama_metaws_dev"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('the developer package is not installed')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "llama_metaws", "build", "--tools"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 2 and "developer package" in res.stderr and "dev/" in res.stderr, res.stderr


def test_cli_and_server_share_the_flag_table():
    graph = import_graph()
    assert "llama_metaws.cli.flags" in graph["llama_metaws.cli"]
    assert "llama_metaws.cli.flags" in graph["llama_metaws.server"]
    assert "llama_metaws.cli" not in graph["llama_metaws.server"]


def test_only_the_binding_module_imports_llama_cpp():
    """Everyone takes the binding from llama_metaws.native.binding (after the build check); the
    binding's server extra is imported by server.py after _binding."""
    offenders = []
    for name, f in _modules().items():
        if name == "llama_metaws.native.binding":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for n in names:
                if n == "llama_cpp" or n.startswith("llama_cpp."):
                    if not (name.startswith("llama_metaws.server") and n.startswith("llama_cpp.server")):
                        offenders.append(f"{name}: {n}")
    assert not offenders, offenders


# --------------------------------------------------------------------------------------------
# the build manifest

def _python(code, env=None, cwd=None):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=env, cwd=cwd)


def test_the_run_time_ignores_cmake_args_and_cc():
    env = dict(os.environ, CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_CUDA=ON", CC="a-compiler-that-is-not-there",
               CXX="another-one")
    res = _python("import llama_metaws, llama_cpp, os; from llama_metaws import Llama; "
                  "from llama_metaws.engine.devices import list_devices; "
                  "print(os.environ['LLAMA_CPP_LIB_PATH']); print(list_devices()[0].name)", env)
    assert res.returncode == 0, res.stderr
    lib_dir, first = res.stdout.split()
    doc = json.loads(manifest.manifest_path().read_text())
    assert Path(lib_dir) == Path(doc["build"]) / "lib"
    assert first == "CPU"


def test_a_missing_manifest_names_the_command_to_run(tmp_path):
    env = dict(os.environ, LLAMA_METAWS_MANIFEST=str(tmp_path / "none.json"))
    res = _python("import llama_metaws; print('imported'); from llama_metaws import Llama", env)
    assert "imported" in res.stdout  # `llama-metaws build` itself must be able to run
    assert res.returncode != 0
    assert "NativeBuildMissing" in res.stderr and "llama-metaws build" in res.stderr


def test_a_stale_build_names_the_command_to_run(tmp_path):
    """The checkout's patches changed since the build: the manifest's build is not used."""
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "patches", root / "patches")
    shutil.copytree(ROOT / "native", root / "native", ignore=shutil.ignore_patterns("__pycache__"))
    first = build.read_series(root / "patches")[0]
    first.write_text(first.read_text() + "\n")
    env = dict(os.environ, LLAMA_METAWS_SOURCE_ROOT=str(root),
               LLAMA_METAWS_MANIFEST=str(manifest.manifest_path()))
    res = _python("import llama_metaws; from llama_metaws.engine.devices import list_devices", env)
    assert res.returncode != 0
    assert "another patches/series" in res.stderr and "llama-metaws build" in res.stderr
    # the unchanged copy is not stale
    first.write_text(first.read_text()[:-1])
    res = _python("import llama_metaws; from llama_metaws.engine.devices import list_devices; print(len(list_devices()))", env)
    assert res.returncode == 0, res.stderr


def test_the_manifest_records_what_the_build_was_made_from():
    doc = json.loads(manifest.manifest_path().read_text())
    assert doc["patches"] == manifest.source_fingerprint()["patches"]
    assert Path(doc["shim"]).is_file() and Path(doc["build"], "build.json").is_file()


# --------------------------------------------------------------------------------------------
# params by declared names, on the instance only

def test_a_field_the_struct_does_not_declare_raises():
    params = llama_cpp.llama_model_default_params()
    with pytest.raises(AttributeError, match="use_mmap"):
        set_fields(params, {"use_mmap": False})  # the 0.3.36 binding has load_mode instead
    set_fields(params, {"load_mode": llama_cpp.LLAMA_LOAD_MODE_NONE, "load_mtp": True})
    assert params.load_mode == llama_cpp.LLAMA_LOAD_MODE_NONE and params.load_mtp


def test_our_params_reach_llama_and_no_other_thread_sees_them(tiny_mtp_model):
    from llama_metaws import Llama

    orig_model, orig_ctx = llama_cpp_lib.llama_model_default_params, llama_cpp_lib.llama_context_default_params
    seen, stop = [], threading.Event()

    def other_thread():
        while not stop.is_set():
            m, c = llama_cpp_lib.llama_model_default_params(), llama_cpp_lib.llama_context_default_params()
            seen.append((bool(m.load_mtp), m.devices, int(c.n_rs_seq), int(c.n_seq_max)))

    t = threading.Thread(target=other_thread)
    t.start()
    try:
        with Llama(str(tiny_mtp_model), draft="mtp", draft_max=2, devices=["CPU"], n_seq_max=2, n_ctx=128,
                   n_batch=32, verbose=False) as llm:
            assert llm.model_params.load_mtp and llm.model_params.devices
            assert llama_cpp.llama_n_seq_max(llm._ctx.ctx) == 2
            assert llama_cpp.llama_n_rs_seq(llm._ctx.ctx) == 2
    finally:
        stop.set()
        t.join()
    assert llama_cpp_lib.llama_model_default_params is orig_model
    assert llama_cpp_lib.llama_context_default_params is orig_ctx
    assert seen and all(s == (False, None, 0, 1) for s in seen), set(seen)


def test_params_that_did_not_reach_llama_are_an_error(tiny_mtp_model, monkeypatch):
    """A binding that made its params some other way: we notice instead of running without them."""
    from llama_metaws.api import llama as llama_mod

    def ignore(self, params):  # the binding's assignment no longer passes through our fields
        self.__dict__["_model_params"] = params

    monkeypatch.setattr(llama_mod.Llama, "model_params",
                        property(lambda self: self.__dict__.get("_model_params"), ignore))
    with pytest.raises(RuntimeError, match=r"llama_model_params\.load_mtp"):
        llama_mod.Llama(str(tiny_mtp_model), draft="mtp", n_ctx=128, n_batch=32, verbose=False)


def test_a_step_decides_runs_and_applies_in_three_modules():
    """vLLM's split: schedule decides and update applies, neither calls llama.cpp; execute runs the
    decodes. A newcomer finds where a step is built from the file names alone."""
    graph = import_graph()
    for phase in ("schedule", "update"):
        deps = graph[f"llama_metaws.engine.{phase}"]
        assert not any(d.startswith("llama_metaws.native") for d in deps), (phase, deps)
        assert "llama_cpp" not in (PKG / "engine" / f"{phase}.py").read_text(), phase
    assert "decode_target" in (PKG / "engine" / "execute.py").read_text()
    for name in ("schedule", "execute", "update", "core", "slots", "request", "drafting", "workspace",
                 "checkpoints", "contexts", "batch", "samplers", "limits"):
        assert (PKG / "engine" / f"{name}.py").is_file(), name
