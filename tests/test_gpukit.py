"""The GPU run kit: its size, its wheels, its source, its script; the pre-patched build input.

The kit is made once for the module (it needs the network for pip download, as make test
does); its dry run (run.sh --cpu with no network) is ``make gpu-kit-dry-run``, run by CI.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from llama_metaws.native import build
from llama_metaws_dev import gpukit

pytestmark = [pytest.mark.network, pytest.mark.slow]  # pip download of the kit's wheels

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    return gpukit.make_kit(tmp_path_factory.mktemp("kit") / "gpu-kit", progress=lambda line: None)


@pytest.fixture(scope="module")
def manifest(kit):
    return json.loads((kit / "MANIFEST.json").read_text())


@pytest.fixture(scope="module")
def source(kit, tmp_path_factory):
    dest = tmp_path_factory.mktemp("kit-src")
    with tarfile.open(kit / "llama.cpp.tar.gz") as tar:
        tar.extractall(dest, filter="data") if sys.version_info >= (3, 12) else tar.extractall(dest)
    return dest / "llama.cpp"


def test_the_kit_is_well_under_what_a_device_machine_takes(kit, manifest):
    size = gpukit.kit_size(kit)
    assert size == manifest["bytes"] + (kit / "MANIFEST.json").stat().st_size
    assert size < gpukit.SIZE_LIMIT <= 48 * MiB  # 64 MiB travel in all, the checkout included
    assert {p.name for p in kit.iterdir()} == {"MANIFEST.json", "llama.cpp.tar.gz", "wheels", "models",
                                               "repo", "run.sh", "report.py"}


def _wheel_tags(name):
    # name-version(-build)?-python-abi-platform.whl
    parts = name[:-4].split("-")
    return parts[0].lower().replace("_", "-"), parts[-3], parts[-2], parts[-1]


def test_the_wheels_are_cpython_312_manylinux_x86_64_one_version_each(kit):
    wheels = {}
    for p in (kit / "wheels").glob("*.whl"):
        dist, py, abi, plat = _wheel_tags(p.name)
        assert dist not in wheels, f"two versions of {dist}: pip would stop the install"
        wheels[dist] = (py, abi, plat)
    # what the device machine lacks, and what a fresh venv lacks
    for dist in ("cffi", "pycparser", "gguf", "llama-cpp-python", "llama-metaws", "diskcache", "numpy",
                 "pytest", "setuptools", "pynvml", "nvidia-ml-py"):
        assert dist in wheels, f"no wheel of {dist} in the kit"
    for dist, (py, abi, plat) in wheels.items():
        if abi == "none":
            assert py.startswith("py3") and plat in ("any", "linux_x86_64"), (dist, py, plat)
        else:  # compiled: for CPython 3.12 on x86-64 manylinux
            assert (py, abi) == ("cp312", "cp312"), (dist, py, abi)
            assert all(re.fullmatch(r"manylinux(1|2014|_2_\d+)_x86_64", t) for t in plat.split(".")), (dist, plat)


def test_the_binding_wheel_has_no_native_library(kit):
    (whl,) = (kit / "wheels").glob("llama_cpp_python-0.3.36-*.whl")
    import zipfile

    names = zipfile.ZipFile(whl).namelist()
    assert "llama_cpp/llama_cpp.py" in names
    assert not [n for n in names if ".so" in n]


def test_the_kit_resolves_offline_for_cpython_312(kit, tmp_path):
    gpukit.check_wheels(kit / "wheels", "3.12")  # pip --dry-run --no-index, no configuration
    partial = tmp_path / "wheels"
    shutil.copytree(kit / "wheels", partial)
    for p in partial.glob("diskcache-*.whl"):
        p.unlink()
    with pytest.raises(gpukit.KitError, match="diskcache"):
        gpukit.check_wheels(partial, "3.12")


def test_the_source_is_patched_trimmed_and_hashed(source, manifest):
    src_manifest = json.loads((source / build.SOURCE_MANIFEST).read_text())
    assert src_manifest["tree_sha256"] == build.tree_sha256(source) == manifest["source"]["tree_sha256"]
    series = [[p.name, build._sha256_bytes(p.read_bytes())] for p in build.read_series(ROOT / "patches")]
    assert src_manifest["patches"] == series
    assert "ggml_backend_meta_buffer_alias" in (source / "ggml/src/ggml-backend-meta.cpp").read_text()
    for kept in ("CMakeLists.txt", "src/llama.cpp", "include/llama.h", "ggml/src/ggml-cpu",
                 "ggml/src/ggml-cuda/ggml-cuda.cu", "ggml/src/ggml-cuda/template-instances", "vendor/nlohmann",
                 "ggml/src/ggml-rpc/ggml-rpc.cpp",  # every build has the RPC backend
                 "common/chat.cpp", "vendor/cpp-httplib",  # the common library: the shim's chat layer
                 "models/templates/Qwen3.5-4B.jinja",  # the chat tests' templates
                 "tests/test-alloc.cpp",
                 # build --tools: llama-server (with mtmd and its empty web UI) and the tools
                 "tools/server/server-context.cpp", "tools/mtmd/clip.cpp", "tools/ui/CMakeLists.txt",
                 "tools/ui/ui.cpp.in", "scripts/ui-assets.cmake", "tools/llama-bench/llama-bench.cpp",
                 "examples/speculative-simple/speculative-simple.cpp", "tools/batched-bench", "pocs"):
        assert (source / kept).exists(), kept
    for dropped in ("docs", "models/ggml-vocab-llama-bpe.gguf", "gguf-py", "ggml/src/ggml-vulkan",
                    "ggml/src/ggml-metal", "ggml/src/ggml-sycl", "tests/CMakeLists.txt", "tools/ui/src",
                    "tools/ui/package.json", "tools/server/tests", "tools/mtmd/test-3.mp4", "examples/llama.android",
                    "scripts/compare-commits.sh"):
        assert not (source / dropped).exists(), dropped
    assert manifest["source"]["unpacked_bytes"] < 24 * MiB


def test_the_trimmed_source_configures_the_tools(source, tmp_path):
    """What ``build --tools`` reads is in the kit's tree: CMake configures its targets from it."""
    from llama_metaws_dev import tools_build

    res = subprocess.run([build._cmake(), "-S", str(source), "-B", str(tmp_path / "b"), *build._generator_args(),
                          *build.BASE_CMAKE_ARGS, *tools_build.TOOLS_CMAKE_ARGS],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    targets = subprocess.run([build._cmake(), "--build", str(tmp_path / "b"), "--target", "help"],
                             capture_output=True, text=True, timeout=120).stdout
    for name in tools_build.TOOL_TARGETS:
        assert name in targets, name


def test_the_dry_runs_namespace_has_its_loopback_and_nothing_else():
    prefix = gpukit.no_network_prefix()
    if not prefix:
        pytest.skip("unshare -rn is not allowed here: the dry run points pip's proxies at a closed port instead")
    probe = ("import socket\n"
             "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
             "socket.create_connection(s.getsockname(), timeout=5).close()\n"
             "try:\n    socket.create_connection(('1.1.1.1', 80), timeout=5)\nexcept OSError as e:\n"
             "    print('outside:', e.errno)\nelse:\n    print('outside: reached')\n")
    res = subprocess.run([*prefix, sys.executable, "-c", gpukit.LOOPBACK_UP, sys.executable, "-c", probe],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr  # 127.0.0.1 answers (llama-server's rows need it)
    assert "outside: reached" not in res.stdout and "outside:" in res.stdout
    bare = subprocess.run([*prefix, sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert bare.returncode != 0 and "unreachable" in bare.stderr  # what a new namespace is without it


def test_run_sh_is_valid_bash_with_a_usage(kit):
    assert subprocess.run(["bash", "-n", str(kit / "run.sh")]).returncode == 0
    res = subprocess.run(["bash", str(kit / "run.sh"), "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "--cpu" in res.stdout and "$OUT" in res.stdout
    res = subprocess.run(["bash", str(kit / "run.sh"), "--no-such-flag"], capture_output=True, text=True,
                         env=dict(os.environ, OUT=str(kit / "out-test")))
    assert res.returncode == 2 and "unknown argument --no-such-flag" in res.stderr
    shutil.rmtree(kit / "out-test", ignore_errors=True)


def test_the_cuda_build_asks_for_sm90_and_the_fewest_kernels():
    text = (ROOT / gpukit.TEMPLATE_DIR / "run.sh").read_text()
    for arg in ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_CUDA_FA_ALL_QUANTS=OFF",
                "-DGGML_CUDA_FA_QUANTS=f16-f16"):
        assert arg in text
    assert "pip install --no-index --find-links" in " ".join(text.split())


def test_run_sh_builds_the_tools_and_runs_the_real_shape_step_after_the_seeds_table():
    text = (ROOT / gpukit.TEMPLATE_DIR / "run.sh").read_text()
    steps = re.search(r'STEPS="\$\{KIT_STEPS:-([a-z,]+)\}"', text).group(1).split(",")
    assert steps == ["preflight", "install", "build", "devices", "test", "vram", "realshape", "report"]
    assert "llama_metaws build --tools" in text  # llama-server from the library's tree
    assert 'limit "$PY" -m llama_metaws_dev.sidebyside' in text and '--budget "$budget"' in text
    # the dry run gives the step its small shape
    assert "--shape small" in gpukit.DRY_RUN_REALSHAPE_ARGS


def test_report_summarizes_steps_tests_and_vram(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir(), work.mkdir()
    (work / "steps.tsv").write_text("install\t0\t12.5\nbuild\t0\t300.0\ntest\t1\t80.2\n")
    (out / "junit.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="3" failures="1" errors="0" skipped="0" time="80.0">'
        '<testcase classname="tests.test_workspace" name="test_a"/>'
        '<testcase classname="tests.test_workspace" name="test_b"><failure message="assert 1 == 2">x</failure></testcase>'
        '<testcase classname="tests.test_faults" name="test_c"/></testsuite></testsuites>')
    (out / "vram.json").write_text(json.dumps([
        {"name": "alias (tensor)", "result": "ok", "tokens_per_s": 50.0, "draft_acceptance": 0.5,
         "peak": {"CUDA0": 3 * MiB, "nvml:0": 900 * MiB}}]))
    (out / "realshape.json").write_text(json.dumps({"records": [{"name": "alias (tensor)", "result": "ok"}],
                                                    "table": "the real-shape table"}))
    res = subprocess.run([sys.executable, str(ROOT / gpukit.TEMPLATE_DIR / "report.py"), "--kit", str(tmp_path),
                          "--work", str(work), "--out", str(out), "--backend", "cuda", "--devices", "CUDA0,CUDA0",
                          "--steps", str(work / "steps.tsv"), "--budget", "540"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary["steps"]] == ["install", "build", "test"]
    assert summary["ok"] is False and summary["total_s"] == 392.7
    assert summary["tests"]["tests"] == 3 and summary["tests"]["failures"] == 1
    assert summary["tests"]["failed"] == [{"test": "tests.test_workspace::test_b", "kind": "failure",
                                           "message": "assert 1 == 2"}]
    assert summary["vram"][0]["peak"]["CUDA0"] == 3 * MiB
    assert "alias (tensor)" in res.stdout and "3.000" in res.stdout
    assert summary["realshape"]["records"][0]["result"] == "ok" and "the real-shape table" in res.stdout


def test_publish_turns_a_run_into_the_gpu_section(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    peak = lambda n: {"CUDA0": n, "CUDA1": n, "nvml:0": 1000 * MiB + n, "rss": 90 * MiB}  # noqa: E731
    records = [{"name": "private-meta (tensor)", "result": "ok", "tokens_per_s": 80.0, "draft_acceptance": 0.7,
                "peak": peak(5 * MiB)},
               {"name": "alias (tensor)", "result": "ok", "tokens_per_s": 81.0, "draft_acceptance": 0.7,
                "peak": peak(3 * MiB)}]
    (out / "summary.json").write_text(json.dumps({
        "date": "2027-01-01T00:00:00+00:00", "backend": "cuda", "devices": "CUDA0,CUDA0",
        "machine": {"gpus": ["0, NVIDIA H200, 143771 MiB, 580.159.04"], "cores": 16, "python": "3.12.3"},
        "kit": {"git": "abc123", "made": "2026-12-31"}, "cmake_args": "-DGGML_CUDA=ON",
        "steps": [{"name": "build", "status": "ok", "seconds": 301.5}],
        "tests": {"tests": 46, "failures": 0, "errors": 0, "skipped": 0, "seconds": 90.0, "failed": []},
        "vram": records}))
    (out / "realshape.json").write_text(json.dumps({
        "records": [dict(r, compute={"CUDA00": r["peak"]["CUDA0"]}) for r in records],
        "shape": {"name": "qwen3.6-27b", "n_vocab": 248320, "n_embd": 5120, "n_ff": 17408}, "n_layer": 16,
        "dtype": "q8_0", "devices": ["CUDA0", "CUDA0"], "synth_len": 3.25, "acceptance": 0.75, "budget_s": 200,
        "model": {"bytes": 2**30, "seconds": 10.0}, "seconds": 150,
        "settings": {"n_ctx": 16384, "n_ubatch": 512, "n_parallel": 2, "draft_max": 3, "warmup": 1,
                     "requests": 2, "prompt_tokens": 64, "n_predict": 128}}))
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import publish_gpu_kit
    finally:
        sys.path.remove(str(ROOT / "bench"))
    text = publish_gpu_kit.section(out)
    assert "NVIDIA H200" in text and "2027-01-01" in text and "| build | ok | 301.5 |" in text
    assert "CUDA subset: 46 tests, 0 failed" in text
    assert "| alias (tensor) | ok | 81.0 | 70.0% | 3,145,728 B | 3,145,728 B | 1,003.0 MiB | 90.0 MiB |" in text
    assert "peak per device saved: CUDA0 2,097,152 B, CUDA1 2,097,152 B, nvml:0 2,097,152 B" in text
    # the real-shape step's table, as docs/gpu-kit.md reads it
    assert "### The real-shape step" in text and "16 layers + 1 NextN" in text
    assert "| alias (tensor) | ok | 81.0 | 70.0% | 3.0 | 1,003.0 | 90.0 | 0 |" in text
    assert "ggml compute: CUDA00 2.0 MiB; NVML peak: nvml:0 2 MiB (the seed: 130 MiB per GPU" in text


# --------------------------------------------------------------------------------------------
# the build from a pre-patched source (LLAMA_METAWS_LLAMA_SOURCE)


def test_a_pre_patched_source_gets_a_key_of_its_own(source, monkeypatch):
    plain = build.BuildInputs.collect(cmake_args=[], compiler="gcc 12")
    monkeypatch.setenv(build.PATCHED_SOURCE_ENV, str(source))
    pre = build.BuildInputs.collect(cmake_args=[], compiler="gcc 12")
    assert pre.source == "pre-patched:" + build.tree_sha256(source)
    assert pre.key() != plain.key()
    assert pre.patches == plain.patches and pre.sdist_sha256 == plain.sdist_sha256


def test_without_it_the_key_is_the_one_it_always_was():
    import dataclasses
    import hashlib

    inputs = build.BuildInputs.collect()
    assert inputs.source == ""
    # the key's formula before the field existed: every cache made then is still found
    before = {k: v for k, v in dataclasses.asdict(inputs).items() if k != "source"}
    assert inputs.key() == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:20]
    assert build.find_build(inputs) is not None


def test_a_pre_patched_source_with_other_patches_is_refused(source, tmp_path, monkeypatch):
    other = tmp_path / "src"
    shutil.copytree(source, other)
    doc = json.loads((other / build.SOURCE_MANIFEST).read_text())
    doc["patches"] = doc["patches"][:-1]
    (other / build.SOURCE_MANIFEST).write_text(json.dumps(doc))
    monkeypatch.setenv(build.PATCHED_SOURCE_ENV, str(other))
    with pytest.raises(build.BuildError, match="other patches than patches/series"):
        build.BuildInputs.collect(cmake_args=[])


def test_a_changed_pre_patched_source_is_refused_before_building(source, tmp_path, monkeypatch):
    changed = tmp_path / "src"
    shutil.copytree(source, changed)
    monkeypatch.setenv(build.PATCHED_SOURCE_ENV, str(changed))
    monkeypatch.setenv("LLAMA_METAWS_CACHE", str(tmp_path / "cache"))
    inputs = build.BuildInputs.collect(cmake_args=[])
    with open(changed / "src" / "llama.cpp", "a") as f:
        f.write("\n// changed after the kit was made\n")
    lines = []
    with pytest.raises(build.BuildError, match="does not hash to what its lmws-source.json says"):
        build.build_library(inputs, lines.append)
    assert any("pre-patched source" in line for line in lines)
    assert not any("fetch" in line and "sdist" in line for line in lines)  # no sdist was fetched
    assert not list((tmp_path / "cache" / "builds").glob("*/build.json"))
