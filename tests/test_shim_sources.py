"""The shim's sources and how they are built: cffi's declarations come from shim.h itself, each
language's files get their own flags (no warnings), every .c and .cpp file here is compiled, and
the C++ side takes llama.cpp's declarations from llama-ext.h instead of copies of them."""

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

from llama_metaws.native import build
from llama_metaws.native.runtime import require_build
from llama_metaws.native.shim import lib

NATIVE = Path(__file__).resolve().parent.parent / "native"


def _load_builder(native_dir: Path):
    """native_dir/build_shim.py as its own module (its HERE is native_dir)."""
    spec = importlib.util.spec_from_file_location(f"build_shim_{abs(hash(native_dir))}", native_dir / "build_shim.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cffi_sees_every_call_and_constant_shim_h_declares():
    header = (NATIVE / "shim.h").read_text()
    names = set(re.findall(r"\b(lmws_\w+)\s*\(", header)) | set(re.findall(r"#define\s+(LMWS_\w+)", header))
    assert "lmws_memory_breakdown" in names and "LMWS_NOT_ELIGIBLE" in names
    missing = sorted(n for n in names if not hasattr(lib, n))
    assert not missing, f"declared in native/shim.h but not reachable through cffi: {missing}"


def test_shim_cdef_keeps_declarations_and_leaves_values_to_the_compiler():
    builder = _load_builder(NATIVE)
    header = ("// a comment\n#pragma once\n#include \"llama.h\"\n#define LMWS_X -3\n"
              "#ifdef __cplusplus\nextern \"C\" {\n#endif\n"
              "struct lmws_s { int a; };\nint lmws_f(struct lmws_s * s);\n"
              "#ifdef __cplusplus\n}\n#endif\n")
    cdef = builder.shim_cdef(header)
    assert "#define LMWS_X ..." in cdef
    assert "int lmws_f(struct lmws_s * s);" in cdef and "struct lmws_s { int a; };" in cdef
    assert "extern" not in cdef and "#include" not in cdef and "#pragma" not in cdef and "#ifdef" not in cdef


@pytest.mark.parametrize("line", ["#if defined(FOO)", "#ifdef FOO", "#define LMWS_F(x) (x)", "#undef LMWS_X"])
def test_shim_cdef_refuses_a_preprocessor_line_cffi_cannot_follow(line):
    builder = _load_builder(NATIVE)
    with pytest.raises(ValueError, match="shim.h:2"):
        builder.shim_cdef(f"int lmws_a(void);\n{line}\nint lmws_b(void);\n")


def test_the_cpp_side_declares_nothing_llama_ext_h_declares():
    """breakdown.cpp once copied llama_memory_breakdown_data and checked the copy's size against
    itself; it includes llama-ext.h (the patched tree's, on the C++ include path) instead."""
    src = (NATIVE / "breakdown.cpp").read_text()
    assert '#include "llama-ext.h"' in src
    assert not re.search(r"struct\s+llama_memory_breakdown_data\s*\{", src)
    assert "llama_get_memory_breakdown(const" not in src  # no declaration of its own either


PROBE_CPP = """#include "shim.h"
#include <map>
extern "C" int lmws_probe_cpp(void) {
    std::map<int, int> m{{1, 2}};
    if constexpr (sizeof(m) > 0) { return m.at(1); } // C++17
    return 0;
}
"""
PROBE_C = """#include "shim.h"
int lmws_probe_c(void) {
    _Static_assert(sizeof(int) >= 2, "C11"); // C11
    return 3;
}
"""


def test_a_new_source_of_either_language_is_built_with_its_own_flags_and_no_warnings(tmp_path, capfd):
    """A copy of native/ with a .cpp and a .c file added and their calls declared in shim.h:
    both are compiled (C++17 and C11 code), cffi sees the new calls, and neither compiler warns
    (C flags reaching the C++ file printed '-std=c11 is valid for C/ObjC but not for C++')."""
    native = tmp_path / "native"
    shutil.copytree(NATIVE, native, ignore=shutil.ignore_patterns("__pycache__"))
    (native / "probe.cpp").write_text(PROBE_CPP)
    (native / "probe.c").write_text(PROBE_C)
    header = (native / "shim.h").read_text()
    header = header.replace("#ifdef __cplusplus\n}\n#endif", "int lmws_probe_cpp(void);\nint lmws_probe_c(void);\n\n"
                            "#ifdef __cplusplus\n}\n#endif")
    (native / "shim.h").write_text(header)
    b = require_build()
    builder = _load_builder(native)
    capfd.readouterr()
    module_path = builder.compile_shim(tmp_path / "out", b.include_dir, b.lib_dir,
                                       ext_include_dir=b.src_dir / "src", common_include_dir=b.src_dir / "common")
    out, err = capfd.readouterr()
    assert "warning" not in (out + err).lower(), out + err
    spec = importlib.util.spec_from_file_location(builder.MODULE_NAME, module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.lib.lmws_probe_cpp() == 2 and module.lib.lmws_probe_c() == 3
    assert module.lib.LMWS_EINVAL == lib.LMWS_EINVAL


def test_the_shim_key_covers_every_source_file(tmp_path):
    """A new source file (or an edit of any) is a new shim key: the shim is rebuilt."""
    native = tmp_path / "native"
    shutil.copytree(NATIVE, native, ignore=shutil.ignore_patterns("__pycache__"))
    before = build.shim_key("k", native)
    (native / "sampler.cpp").write_text("// new\n")
    assert build.shim_key("k", native) != before
