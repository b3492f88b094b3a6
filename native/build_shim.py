"""The one builder of the cffi shim (API mode).

The declarations cffi sees are the small headers in ``decl/`` (what the shim uses of ggml and
llama), read in ``DECLS`` order, then the shim's own calls, taken from ``shim.h`` itself
(``shim_cdef``: its preprocessor lines and C++ guards dropped, ``#define`` values left to the
compiler), so the two cannot drift. The C side is every ``*.c`` file here, compiled by cffi with
C flags; every ``*.cpp`` file is compiled first with C++ flags (and llama.cpp's staging header
``llama-ext.h`` on its include path) and linked in as an object. Both are compiled against the
patched llama.cpp headers and linked to the patched libraries of one build directory (rpath set
to it, so the extension resolves to the very copies the binding loads through
``LLAMA_CPP_LIB_PATH``). ``llama_metaws.native.build`` calls ``compile_shim``;
``llama_metaws.native.shim`` imports the result.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Optional, Sequence

import cffi

HERE = Path(__file__).resolve().parent
MODULE_NAME = "_llama_metaws_native"
DECLS = ("ggml_backend.h", "ggml_alloc.h", "llama.h")
SHIM_HEADER = "shim.h"
WARNINGS = ("-Wall",)
C_FLAGS = ("-std=c11", *WARNINGS, "-Werror=implicit-function-declaration")
CXX_FLAGS = ("-std=c++17", *WARNINGS, "-O2", "-fPIC")


def shim_cdef(header: str) -> str:
    """``shim.h`` as cffi's cdef reads it: ``#pragma``/``#include`` lines and ``#ifdef
    __cplusplus`` blocks dropped, each ``#define NAME value`` made ``#define NAME ...`` (the
    compiler supplies the value). Any other preprocessor line is an error: cffi could not follow
    it, so shim.h keeps to plain declarations."""
    out, skipping = [], False
    for n, line in enumerate(header.splitlines(), 1):
        directive = line.strip()
        if skipping:
            if directive.startswith("#endif"):
                skipping = False
            elif directive.startswith("#"):
                raise ValueError(f"{SHIM_HEADER}:{n}: nested preprocessor line in a __cplusplus block: {directive}")
            continue
        if not directive.startswith("#"):
            out.append(line)
            continue
        words = directive[1:].split()
        if words[:1] in (["pragma"], ["include"]):
            continue
        if words[:2] == ["ifdef", "__cplusplus"]:
            skipping = True
            continue
        if words[:1] == ["define"] and len(words) >= 3 and re.fullmatch(r"[A-Za-z_]\w*", words[1]):
            out.append(f"#define {words[1]} ...")
            continue
        raise ValueError(f"{SHIM_HEADER}:{n}: cffi cannot read this preprocessor line: {directive}")
    if skipping:
        raise ValueError(f"{SHIM_HEADER}: an #ifdef __cplusplus block is not closed")
    return "\n".join(out) + "\n"


def sources(ext: str) -> list:
    """The shim's sources of one language (``.c``, ``.cpp``): every such file here."""
    return sorted(HERE.glob(f"*{ext}"))


def _cxx() -> list:
    return shlex.split(os.environ.get("CXX", "c++"))


def compile_cxx(out_dir: Path, include_dirs: Sequence[Path], sanitize: tuple = ()) -> list:
    """Each ``*.cpp`` here into an object under ``out_dir`` with C++ flags only; their paths."""
    objects = []
    for src in sources(".cpp"):
        obj = out_dir / "cxx" / (src.stem + ".o")
        obj.parent.mkdir(parents=True, exist_ok=True)
        cmd = [*_cxx(), *CXX_FLAGS, *sanitize, *(f"-I{d}" for d in include_dirs), "-c", str(src), "-o", str(obj)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"compiling {src.name} failed:\n{' '.join(cmd)}\n{res.stdout}{res.stderr}")
        objects.append(str(obj))
    return objects


def make_ffi(include_dir: Path, lib_dir: Path, sanitize: tuple = (), objects: Sequence[str] = ()) -> cffi.FFI:
    ffi = cffi.FFI()
    for name in DECLS:
        ffi.cdef((HERE / "decl" / name).read_text())
    ffi.cdef(shim_cdef((HERE / SHIM_HEADER).read_text()))
    ffi.set_source(
        MODULE_NAME,
        f'#include "{SHIM_HEADER}"\n',
        sources=[str(p) for p in sources(".c")],
        include_dirs=[str(HERE), str(include_dir)],
        library_dirs=[str(lib_dir)],
        libraries=["llama-common", "llama", "ggml", "ggml-base", "stdc++"],
        extra_objects=list(objects),
        extra_compile_args=[*C_FLAGS, *sanitize],
        extra_link_args=[f"-Wl,-rpath,{lib_dir}", *sanitize],
    )
    return ffi


def compile_shim(out_dir: Path, include_dir: Path, lib_dir: Path, sanitize: tuple = (),
                 ext_include_dir: Optional[Path] = None, common_include_dir: Optional[Path] = None) -> Path:
    """Compile the extension into ``out_dir``; returns the path of the built module.

    ``sanitize``: ``-fsanitize=...`` flags, the same as the libraries were built with;
    ``ext_include_dir``: where llama.cpp's ``llama-ext.h`` is (the patched tree's ``src/``),
    ``common_include_dir``: where its common library's headers are (the patched tree's
    ``common/``: ``chat.h``; the library is ``libllama-common``, installed beside libllama),
    for the C++ side.
    """
    sanitize = tuple(sanitize)
    cxx_includes = [HERE, include_dir, *([ext_include_dir] if ext_include_dir else []),
                    *([common_include_dir] if common_include_dir else [])]
    objects = compile_cxx(out_dir, cxx_includes, sanitize)
    ffi = make_ffi(include_dir, lib_dir, sanitize, objects)
    return Path(ffi.compile(tmpdir=str(out_dir), verbose=False))
