"""The one builder of the cffi shim (API mode).

The declarations cffi sees are the small headers in ``decl/``, read in ``DECLS`` order; the C
side is ``shim.c`` (and ``rpc.c``, ``breakdown.cpp``, ``sampler.cpp``) compiled against the patched llama.cpp headers and linked to the patched
libraries of one build directory (rpath set to it, so the extension resolves to the very
copies the binding loads through ``LLAMA_CPP_LIB_PATH``). ``llama_metaws.native.build`` calls
``compile_shim``; ``llama_metaws.native.shim`` imports the result.
"""

from __future__ import annotations

from pathlib import Path

import cffi

HERE = Path(__file__).resolve().parent
MODULE_NAME = "_llama_metaws_native"
DECLS = ("ggml_backend.h", "ggml_alloc.h", "llama.h", "shim.h")


def make_ffi(include_dir: Path, lib_dir: Path, sanitize: tuple = ()) -> cffi.FFI:
    ffi = cffi.FFI()
    for name in DECLS:
        ffi.cdef((HERE / "decl" / name).read_text())
    ffi.set_source(
        MODULE_NAME,
        '#include "shim.h"\n',
        sources=[str(HERE / "shim.c"), str(HERE / "rpc.c"),
                 # the C++ side: llama-ext.h calls; sampling that catches what llama.cpp throws
                 str(HERE / "breakdown.cpp"), str(HERE / "sampler.cpp")],
        include_dirs=[str(HERE), str(include_dir)],
        library_dirs=[str(lib_dir)],
        libraries=["llama", "ggml", "ggml-base", "stdc++"],
        extra_compile_args=["-std=c11", "-Wall", "-Werror=implicit-function-declaration", *sanitize],
        extra_link_args=[f"-Wl,-rpath,{lib_dir}", *sanitize],
    )
    return ffi


def compile_shim(out_dir: Path, include_dir: Path, lib_dir: Path, sanitize: tuple = ()) -> Path:
    """Compile the extension into ``out_dir``; returns the path of the built module.

    ``sanitize``: ``-fsanitize=...`` flags, the same as the libraries were built with.
    """
    ffi = make_ffi(include_dir, lib_dir, tuple(sanitize))
    return Path(ffi.compile(tmpdir=str(out_dir), verbose=False))
