"""ggml-cpu's AMX path: the tile configuration ``ldtilecfg`` loads (patch 0028), and a quantized
model's prompt through the AMX buffer type.

Without AMX hardware the fix is checked in the object code: ggml-cpu's ``amx/mmq.cpp`` from the
patched tree of the current build, compiled at -O3 with the AMX flags by the system compiler,
must store every byte of the configuration ``ggml_tile_config_init`` assigns before each
``ldtilecfg`` (tests/amx_objcode.py replays the stores). The same check on the unpatched text
(the patch reversed) must flag it where the compiler's ``_tile_loadconfig`` is GCC's 8-byte asm.

Where the CPU has AMX and the build compiled the AMX path, a q8_0 and a q4_0 model decode a
multi-token prompt through the AMX buffer type (llama.cpp's log names it) in a subprocess, and
the logits and greedy tokens are checked against the no-repack path (``use_extra_bufts=False``).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pytest

import llama_metaws  # noqa: F401  (sets LLAMA_CPP_LIB_PATH: must come before llama_cpp)
import llama_cpp.llama_cpp as ll

from llama_metaws import paths
from llama_metaws.native import build as _build
from llama_metaws.native.params import set_fields
from llama_metaws.native.runtime import require_build

ROOT = Path(__file__).resolve().parent.parent
MMQ = Path("ggml/src/ggml-cpu/amx/mmq.cpp")

# What ggml-cpu's CMake gives amx/mmq.cpp in a Release build (the definitions and -O3 of the
# default build), with the AMX path's instruction sets either as GGML_NATIVE=OFF spells them
# (-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON ...), or as
# GGML_NATIVE gives them on a Sapphire Rapids host.
RELEASE_FLAGS = ["-O3", "-DNDEBUG", "-std=gnu++17", "-fPIC", "-fopenmp", "-DGGML_USE_OPENMP",
                 "-DGGML_USE_CPU_REPACK", "-DGGML_USE_LLAMAFILE", "-D_GNU_SOURCE", "-D_XOPEN_SOURCE=600",
                 "-DGGML_BACKEND_BUILD", "-DGGML_BACKEND_SHARED", "-DGGML_SHARED"]
ARCH_FLAGS = {
    "ggml-amx-flags": ["-mavx", "-mavx2", "-mfma", "-mf16c", "-mbmi2", "-mavx512f", "-mavx512cd",
                       "-mavx512vl", "-mavx512dq", "-mavx512bw", "-mavx512vnni", "-mavx512bf16",
                       "-mamx-tile", "-mamx-int8", "-mamx-bf16"],
    "march-sapphirerapids": ["-march=sapphirerapids"],
}

NO_AMX_CPU = "this CPU has no AMX: amx_tile/amx_int8 absent from /proc/cpuinfo"
NO_AMX_BUILD = ("this build has no AMX path: ggml-cpu was compiled without AMX_INT8 (GGML_NATIVE on a "
                "CPU without AMX, or GGML_NATIVE=OFF without -DGGML_AMX_INT8=ON)")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import amx_objcode  # noqa: E402


def _cxx() -> List[str]:
    return shlex.split(os.environ.get("CXX", "c++"))


def _src_root() -> Path:
    src = require_build().src_dir
    if not (src / MMQ).is_file():
        pytest.skip(f"this build keeps no patched source tree ({src / MMQ} is missing)")
    return src


def _unpatched_text(src: Path, tmp: Path) -> str:
    """mmq.cpp as the vendored llama.cpp has it: the series' patches that touch it, reversed."""
    touching = [p for p in _build.read_series(ROOT / "patches")
                if f"diff --git a/{MMQ} b/{MMQ}" in p.read_text()]
    assert touching, f"no patch of patches/series touches {MMQ}"
    work = tmp / "unpatched"
    (work / MMQ).parent.mkdir(parents=True)
    (work / MMQ).write_bytes((src / MMQ).read_bytes())
    for patch in reversed(touching):
        res = subprocess.run(["git", "apply", "-R", f"--include={MMQ}", str(patch)], cwd=work,
                             capture_output=True, text=True)
        assert res.returncode == 0, f"{patch.name} does not reverse on the build's {MMQ}: {res.stderr}"
    return (work / MMQ).read_text()


def _compile_cached(src: Path, source: str, arch: str) -> Path:
    """``source`` (a text of mmq.cpp) compiled as ggml-cpu compiles it, with ``arch``'s flags, into
    the cache (``<cache>/amx-objects``), keyed by the build, the compiler, the flags and the text:
    a compile is ~10 CPU-seconds, done once per patch series and compiler."""
    ggml = src / "ggml"
    includes = [ggml / "include", ggml / "src", ggml / "src" / "ggml-cpu", src / MMQ.parent]
    flags = [*RELEASE_FLAGS, *ARCH_FLAGS[arch], *(f"-I{d}" for d in includes)]
    key = hashlib.sha256("\0".join([require_build().manifest["key"], _build.compiler_identity(),
                                     *_cxx(), *flags, source]).encode()).hexdigest()[:24]
    cache = paths.cache_root() / "amx-objects"
    obj = cache / f"mmq-{arch}-{key}.o"
    if obj.exists():
        return obj
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=cache, suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        text = tmp.with_suffix(".cpp")
        text.write_text(source)
        res = subprocess.run([*_cxx(), *flags, "-c", str(text), "-o", str(tmp)], capture_output=True, text=True)
        text.unlink()
        if res.returncode != 0 and "amx" in res.stderr and "unrecognized" in res.stderr:
            pytest.skip(f"the compiler does not know the AMX flags: {res.stderr.strip().splitlines()[0]}")
        assert res.returncode == 0, f"compiling mmq.cpp ({arch}) failed:\n{res.stderr[-4000:]}"
        os.replace(tmp, obj)
    finally:
        tmp.unlink(missing_ok=True)
    return obj


def _loadconfig_is_narrow_asm() -> Optional[bool]:
    """Whether the compiler's ``_tile_loadconfig`` is inline asm on a pointer-sized operand (GCC
    12.2's), from its preprocessed ``immintrin.h``; None when the body is not found."""
    res = subprocess.run([*_cxx(), "-mamx-tile", "-E", "-x", "c++", "-"], input="#include <immintrin.h>\n",
                         capture_output=True, text=True)
    m = re.search(r"_tile_loadconfig\s*\(const void \*__config\)\s*\{(.*?)\}", res.stdout, re.S)
    if m is None:
        return None
    return "__asm__" in m.group(1) and "void **" in m.group(1)


@pytest.fixture(scope="module")
def amx_objects(tmp_path_factory) -> Dict[str, object]:
    """mmq.cpp compiled at -O3: patched with each arch's flags, and unpatched with ggml's (two
    compiles at a time)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"AMX is x86-64 only (this machine is {platform.machine()})")
    src = _src_root()
    patched = (src / MMQ).read_text()
    unpatched = _unpatched_text(src, tmp_path_factory.mktemp("amx"))
    jobs = {f"patched-{a}": (patched, a) for a in ARCH_FLAGS}
    jobs["unpatched-ggml-amx-flags"] = (unpatched, "ggml-amx-flags")
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = {k: pool.submit(_compile_cached, src, text, a) for k, (text, a) in jobs.items()}
        objects = {k: f.result() for k, f in done.items()}
    return dict(objects=objects, patched_source=patched, unpatched_source=unpatched)


def _problems(obj: Path, source: str) -> List[str]:
    expected = amx_objcode.expected_config(source)
    replays = amx_objcode.ldtilecfg_replays(obj)
    assert replays, f"no ldtilecfg in {obj.name}: the AMX path was not compiled"
    out = []
    for r in replays:
        diffs = r.differences(expected)
        if diffs:
            out.append(f"ldtilecfg at {r.insn.addr:#x} ({r.insn.text}): " + "; ".join(diffs)
                       + (f" [stores not followed: {r.notes}]" if r.notes else ""))
    return out


@pytest.mark.parametrize("arch", list(ARCH_FLAGS))
def test_every_ldtilecfg_loads_the_whole_tile_configuration(amx_objects, arch):
    problems = _problems(amx_objects["objects"][f"patched-{arch}"], amx_objects["patched_source"])
    assert not problems, "\n".join(problems)


def test_the_object_check_catches_the_unpatched_load(amx_objects):
    """The check is not vacuous: on GCC's 8-byte asm the vendored code's load misses the tile
    shapes, and the check says which fields."""
    narrow = _loadconfig_is_narrow_asm()
    if narrow is False:
        pytest.skip("this compiler's _tile_loadconfig reads the whole configuration (a builtin): the "
                    "unpatched code is not miscompiled here")
    assert amx_objects["unpatched_source"] != amx_objects["patched_source"]
    problems = _problems(amx_objects["objects"]["unpatched-ggml-amx-flags"], amx_objects["unpatched_source"])
    assert problems, "the unpatched ggml_tile_config_init passed the object check"
    # GCC 12.2 keeps the zeroing of the whole object and drops the shapes' stores:
    # "rows[0] = 0 (the source assigns 8)"; another compiler may leave them never stored
    assert any("rows[0]" in p and "colsb[0]" in p for p in problems), problems


def test_the_expected_configuration_is_ggml_s_tile_layout(amx_objects):
    """The configuration the check expects, read from the source: palette 1, A/B/C tiles as the
    comment above ggml_tile_config_init lays them out (rows 16/8/16, colsb 32/64/64)."""
    cfg = amx_objcode.expected_config(amx_objects["patched_source"])
    assert cfg[0] == 1 and cfg[1] == 0 and not any(cfg[2:16])
    colsb = np.frombuffer(cfg[16:48], dtype="<u2")
    assert list(cfg[48:56]) == [8, 8, 16, 16, 16, 16, 16, 16]
    assert list(colsb[:8]) == [64, 64, 32, 32, 64, 64, 64, 64]
    assert not any(cfg[56:]) and not any(colsb[8:])


# --------------------------------------------------------------------------------------------
# a quantized model through the AMX buffer type, where the CPU has AMX

N_CTX = 128
N_THREADS = 2  # the tiles are configured per thread
PROMPT = [(7 * i + 3) % 128 for i in range(40)]  # past 2 * TILE_M rows: full blocks and a tail
N_STEPS = 16
FTYPES = {"q8_0": 7, "q4_0": 2}  # LLAMA_FTYPE_MOSTLY_Q8_0, LLAMA_FTYPE_MOSTLY_Q4_0


def cpu_has_amx() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return {"amx_tile", "amx_int8"} <= flags


def build_has_amx() -> bool:
    """ggml-cpu's AMX path is compiled in (its features list AMX_INT8)."""
    return "AMX_INT8 = 1" in ll.llama_print_system_info().decode()


def _greedy(path: str, extra_bufts: bool) -> dict:
    """In this process: load with or without the extra buffer types, decode PROMPT in one batch
    with every row's logits, then N_STEPS greedy tokens one at a time."""
    lines: List[str] = []

    @ll.llama_log_callback
    def record(level, text, user_data):
        lines.append(text.decode("utf-8", "replace"))
        sys.stderr.write(lines[-1])

    ll.llama_log_set(record, ctypes.c_void_p(0))
    ll.llama_backend_init()
    mp = ll.llama_model_default_params()
    set_fields(mp, dict(n_gpu_layers=0, use_extra_bufts=extra_bufts))
    model = ll.llama_model_load_from_file(path.encode(), mp)
    assert model, f"failed to load {path}"
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    cp = ll.llama_context_default_params()
    set_fields(cp, dict(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_seq_max=1, n_threads=N_THREADS,
                        n_threads_batch=N_THREADS))
    ctx = ll.llama_init_from_model(model, cp)
    assert ctx, "failed to create a context"

    def decode(tokens: List[int], pos0: int) -> np.ndarray:
        batch = ll.llama_batch_init(len(tokens), 0, 1)
        try:
            for i, tok in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos0 + i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, 1
            batch.n_tokens = len(tokens)
            assert ll.llama_decode(ctx, batch) == 0
        finally:
            ll.llama_batch_free(batch)
        return np.ctypeslib.as_array(ll.llama_get_logits(ctx), shape=(len(tokens), n_vocab)).copy()

    prompt_logits = decode(PROMPT, 0)
    tokens = [int(np.argmax(prompt_logits[-1]))]
    for step in range(N_STEPS - 1):
        tokens.append(int(np.argmax(decode([tokens[-1]], len(PROMPT) + step)[0])))
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    return dict(buffers=sorted(set(re.findall(r"(\S+) model buffer size", "".join(lines)))),
                prompt_logits=prompt_logits.tolist(), tokens=tokens)


def _greedy_in_a_subprocess(path: Path, extra_bufts: bool) -> dict:
    """:func:`_greedy` in a child: a crash in the AMX kernels fails this test with its signal."""
    res = subprocess.run([sys.executable, __file__, str(path), "1" if extra_bufts else "0"],
                         capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        how = (f"died of {signal.Signals(-res.returncode).name}" if res.returncode < 0
               else f"exited with {res.returncode}")
        pytest.fail(f"the decode (use_extra_bufts={extra_bufts}) {how}:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=list(FTYPES))
def quantized_model(request, tmp_path_factory) -> Path:
    """A tiny llama quantized by llama.cpp, where the AMX path can run (else the skip says why)."""
    from llama_metaws_dev.testing import make_tiny_model

    if not cpu_has_amx():
        pytest.skip(NO_AMX_CPU)
    if not build_has_amx():
        pytest.skip(NO_AMX_BUILD)

    d = tmp_path_factory.mktemp("amx-models")
    f32 = make_tiny_model(d / "tiny-f32.gguf", seed=3)
    out = d / f"tiny-{request.param}.gguf"
    qp = ll.llama_model_quantize_default_params()
    qp.ftype = FTYPES[request.param]
    assert ll.llama_model_quantize(str(f32).encode(), str(out).encode(), ctypes.byref(qp)) == 0
    return out


def test_a_prompt_through_the_amx_buffer_type_matches_the_no_repack_path(quantized_model):
    amx = _greedy_in_a_subprocess(quantized_model, True)
    plain = _greedy_in_a_subprocess(quantized_model, False)
    assert "AMX" in amx["buffers"], f"the weights did not go to the AMX buffer type: {amx['buffers']}"
    assert "AMX" not in plain["buffers"], plain["buffers"]
    assert amx["tokens"] == plain["tokens"]
    # every prompt row's logits (the rows the tile kernels computed): repacked kernels sum in
    # another order, so they are close, not equal (CPU_REPACK's q4_0 on an AVX-512 CPU without AMX:
    # within 1.2% of the largest logit of the plain path's)
    ref, got = np.array(plain["prompt_logits"]), np.array(amx["prompt_logits"])
    np.testing.assert_allclose(got, ref, rtol=0, atol=0.05 * float(np.abs(ref).max()))


if __name__ == "__main__":  # the child of _greedy_in_a_subprocess
    print(json.dumps(_greedy(sys.argv[1], sys.argv[2] == "1")))
