#!/usr/bin/env bash
# The llama-metaws GPU run kit's one command (made by `llama-metaws-dev gpu-kit`; docs/gpu-kit.md).
# On a machine with an NVIDIA GPU and no network, from this folder alone:
#
#   preflight  the machine: GPUs, nvcc, cuBLAS, the driver library, cmake, a C compiler, Python.h
#   install    the wheels in wheels/ with pip --no-index (nothing is fetched)
#   build      llama.cpp from llama.cpp.tar.gz (patched, trimmed) for CUDA sm_90, the shim, and
#              llama-server (and llama.cpp's other tools) in the same CMake tree
#   devices    ggml's devices; the tensor split's devices (one GPU: listed twice) checked with
#              one repro case, falling back to two virtual devices (GGML_CUDA_DEVICES=2)
#   test       the CUDA subset of the suite: workspace, tensor split, repro, faults
#   vram       llama-metaws vram --nvidia: the seed's configurations, pynvml sampling
#   realshape  a qwen35 MTP model at Qwen3.5/3.6-27B's width and vocabulary written into --work
#              (as many layers as the time left allows), then ours (alias, private meta buffers,
#              no drafting, layer split) and llama-server (draft-mtp, no drafting) side by side
#              at 75% synthetic acceptance: tokens/s, acceptance, compute bytes, NVML peaks
#   report     summary.json: each step's status and seconds, the tests, the vram table, the
#              real-shape table
#
# Each step prints its time; a failed install or build stops the steps that need it, any other
# failed step lets the others run on. Everything lands in $OUT: run.log, summary.json,
# vram.json, vram.png, junit.xml, realshape.json (rewritten after each of its rows: a step cut
# by the deadline keeps the rows it finished) and sidebyside-logs/ (llama-server's logs). Exit
# status 0 when every step passed.
#
#   bash run.sh [--cpu] [--steps a,b,...] [--devices LIST]
#
# Options (and the environment they default to):
#   --cpu              build for the CPU, run on CPU,CPU (the dry run; KIT_BACKEND=cpu)
#   --steps LIST       the steps to run (KIT_STEPS; default all of the above)
#   --devices LIST     the tensor split's devices (KIT_DEVICES; default auto)
#   --python PY        the interpreter to install into and run with (KIT_PYTHON; default python3;
#                      use a virtual environment's python to keep the system's untouched)
#   --work DIR         unpacked source and build cache (KIT_WORK; default /tmp/llama-metaws-kit)
#   --out DIR          where the results go (OUT; default ./out beside this script)
#   --budget S         the whole run's deadline in seconds (KIT_BUDGET_S; default 540): each
#                      step gets what is left, less what the report needs
# and KIT_TESTS (pytest's arguments, default the CUDA subset), KIT_VRAM_ARGS (more arguments
# for llama-metaws vram), KIT_VRAM_RESERVE_S (seconds the tests leave for vram, default 90),
# KIT_REALSHAPE_ARGS (more arguments for the real-shape step: --layers N, --shape small, ...;
# python -m llama_metaws_dev.sidebyside --help), KIT_REALSHAPE_RESERVE_S (seconds vram
# leaves for it, default 60; it takes what the CUDA subset and vram leave), KIT_CMAKE_ARGS (more
# CMake arguments), KIT_CUDA_DIRS (more folders to look for cuBLAS in).
#
# A second call with the same --work on the same machine reuses the unpacked source, the
# finished build, what preflight found and the real-shape model: `--steps preflight,install,build,report`
# in one command, `--steps devices,test,vram,realshape,report` in the next, when one command's time
# is short (the real-shape step then has more time: more layers).
set -uo pipefail

KIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BACKEND="${KIT_BACKEND:-cuda}"
STEPS="${KIT_STEPS:-preflight,install,build,devices,test,vram,realshape,report}"
DEVICES="${KIT_DEVICES:-auto}"
PY="${KIT_PYTHON:-python3}"
WORK="${KIT_WORK:-/tmp/llama-metaws-kit}"
OUTDIR="${OUT:-$KIT/out}"
BUDGET="${KIT_BUDGET_S:-540}"
REPORT_RESERVE=20

while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) BACKEND=cpu ;;
        --cuda) BACKEND=cuda ;;
        --steps) STEPS="$2"; shift ;;
        --devices) DEVICES="$2"; shift ;;
        --python) PY="$2"; shift ;;
        --work) WORK="$2"; shift ;;
        --out) OUTDIR="$2"; shift ;;
        --budget) BUDGET="$2"; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

mkdir -p "$OUTDIR" "$WORK"
OUTDIR="$(cd "$OUTDIR" && pwd)"
WORK="$(cd "$WORK" && pwd)"
LOG="$OUTDIR/run.log"
STEPS_TSV="$WORK/steps.tsv"
: >"$STEPS_TSV"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
trap 'exec 1>&- 2>&-; wait $TEE_PID 2>/dev/null' EXIT

T0=$(date +%s.%N)
now() { date +%s.%N; }
elapsed() { awk -v a="$T0" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
left() { awk -v a="$T0" -v b="$(now)" -v t="$BUDGET" -v r="$REPORT_RESERVE" \
    'BEGIN { s = t - r - (b - a); if (s < 5) s = 5; printf "%d", s }'; }
# a command under the deadline
limit() { timeout --kill-after=10 "$(left)" "$@"; }
# the same, leaving S seconds for the steps after it
limit_leaving() {
    local s=$(( $(left) - $1 ))
    shift
    [ "$s" -lt 5 ] && s=5
    timeout --kill-after=10 "$s" "$@"
}

# pip from this kit alone: no configuration files, no index, no environment of pip's own
for v in $(compgen -e | grep '^PIP_' || true); do unset "$v"; done
export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export PYTHONUNBUFFERED=1 GGML_NO_BACKTRACE=1
# the build and the tests read the kit, never the network or another checkout
export LLAMA_METAWS_LLAMA_SOURCE="$WORK/llama.cpp" LLAMA_METAWS_SOURCE_ROOT="$KIT/repo"
export LLAMA_METAWS_CACHE="$WORK/cache"
unset LLAMA_CPP_LIB_PATH
# The libstdc++ the build links is loaded first: in the CUDA image's Python (the torch
# environment, numpy 2.5.2) an import of numpy before the shim made the static init of
# libllama-common's std::regex crash (SIGSEGV, seen on an H200 machine on 2026-12-04)
STDCXX="$(${CXX:-c++} -print-file-name=libstdc++.so.6 2>/dev/null || g++ -print-file-name=libstdc++.so.6 2>/dev/null || true)"
case "$STDCXX" in
    /*) [ -f "$STDCXX" ] && export LD_PRELOAD="$STDCXX${LD_PRELOAD:+:$LD_PRELOAD}" ;;
esac

BASE_CMAKE_ARGS=""
if [ "$BACKEND" = cuda ]; then
    # sm_90 only; the fewest kernels the tests need: flash attention for f16 K/V alone (no
    # all-quants), no NCCL (one GPU, listed twice); uncompressed fatbins (faster to make).
    # Left at their defaults on purpose: GGML_CUDA_GRAPHS (on, as users run it: graph capture
    # must live with the workspace's resizes) and GGML_NATIVE (the CPU backend only; no kernels)
    BASE_CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA_ALL_QUANTS=OFF"
    BASE_CMAKE_ARGS+=" -DGGML_CUDA_FA_QUANTS=f16-f16 -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_COMPRESSION_MODE=none"
fi
# the build's and, to find that build, every later step's; a rerun without preflight takes
# what the last preflight found
export CMAKE_ARGS="$BASE_CMAKE_ARGS"
[ -f "$WORK/cmake_args" ] && CMAKE_ARGS="$(cat "$WORK/cmake_args")"
ORIG_LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
[ -f "$WORK/ld_path" ] && export LD_LIBRARY_PATH="$(cat "$WORK/ld_path")${ORIG_LD_LIBRARY_PATH:+:$ORIG_LD_LIBRARY_PATH}"
[ -f "$WORK/devices" ] && DEVICES="$(cat "$WORK/devices")"
[ -f "$WORK/virtual" ] && export GGML_CUDA_DEVICES="$(cat "$WORK/virtual")"

FAILED=""
want() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
run_step() {  # run_step NAME: the function step_NAME, timed, recorded in steps.tsv
    local name="$1" t rc
    want "$name" || return 0
    echo
    echo "== $name: starting at +$(elapsed) s ($(left) s left)"
    t=$(now)
    "step_$name"
    rc=$?
    local s
    s=$(awk -v a="$t" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
    printf '%s\t%s\t%s\n' "$name" "$rc" "$s" >>"$STEPS_TSV"
    if [ "$rc" -eq 0 ]; then
        echo "== $name: ok in $s s (total $(elapsed) s)"
    else
        echo "== $name: FAILED (exit $rc) in $s s (total $(elapsed) s)"
        FAILED="$FAILED $name"
    fi
    return "$rc"
}

# ------------------------------------------------------------------------------------------

# Print where a file is found first among folders, nothing if nowhere.
find_first() {
    local pattern="$1" d
    shift
    for d in "$@"; do
        [ -d "$d" ] || continue
        local hit
        hit=$(find "$d" -maxdepth 3 -name "$pattern" 2>/dev/null | sort | head -1)
        if [ -n "$hit" ]; then echo "$hit"; return 0; fi
    done
    return 1
}

step_preflight() {
    local ok=0
    echo "kit: $(grep -m1 '"made"' "$KIT/MANIFEST.json" | tr -d ' ,') $(grep -m1 '"git"' "$KIT/MANIFEST.json" | tr -d ' ,')"
    echo "machine: $(uname -srm), $(nproc) cores, $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo)"
    echo "python: $PY = $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])' 2>&1)" || ok=1
    "$PY" -c 'import sysconfig, os, sys; h = os.path.join(sysconfig.get_paths()["include"], "Python.h"); print("Python.h:", h if os.path.exists(h) else "MISSING"); sys.exit(0 if os.path.exists(h) else 1)' || ok=1
    local cmake
    cmake=$("$PY" -c 'import os, shutil, sys; p = os.path.join(os.path.dirname(sys.executable), "cmake"); print(p if os.access(p, os.X_OK) else (shutil.which("cmake") or ""))')
    echo "cmake: ${cmake:-MISSING} $([ -n "$cmake" ] && "$cmake" --version | head -1)"
    [ -n "$cmake" ] || ok=1
    echo "ninja: $(command -v ninja || echo 'none (make is used)')"
    echo "cc: $(cc --version 2>/dev/null | head -1 || echo MISSING)"
    command -v cc >/dev/null && command -v c++ >/dev/null || ok=1
    [ "$BACKEND" = cuda ] || { echo "backend: cpu"; CMAKE_ARGS=""; : >"$WORK/cmake_args"; return $ok; }

    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
    local nvcc="${CUDACXX:-$(command -v nvcc || true)}"
    [ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
    if [ -z "$nvcc" ]; then echo "nvcc: MISSING"; return 1; fi
    # the real compiler (a wrapper script may stand on PATH): nvcc names its own folder
    local here
    here=$("$nvcc" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -1)
    [ -n "$here" ] && [ -x "$here/nvcc" ] && nvcc="$here/nvcc"
    nvcc=$(readlink -f "$nvcc")
    local root
    root=$(dirname "$(dirname "$nvcc")")
    echo "nvcc: $nvcc ($("$nvcc" --version | grep -o 'release [0-9.]*'))"
    local args="$BASE_CMAKE_ARGS -DCMAKE_CUDA_COMPILER=$nvcc -DCUDAToolkit_ROOT=$root"
    # cuBLAS: beside nvcc, else in a Python package (nvidia-cublas: nvidia/cu13 or nvidia/cublas)
    local sites
    sites=$("$PY" -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)
    local dirs=("$root" "$root/targets/x86_64-linux" /usr/local/cuda /usr/local/cuda/targets/x86_64-linux)
    local s
    for s in $sites /opt/*/.venv/lib/python3*/site-packages ${KIT_CUDA_DIRS:-}; do
        dirs+=("$s/nvidia/cu13" "$s/nvidia/cublas" "$s/nvidia/cu12" "$s")
    done
    local header lib lt
    header=$(find_first cublas_v2.h "${dirs[@]}")
    lib=$(find_first 'libcublas.so*' "${dirs[@]}")
    lt=$(find_first 'libcublasLt.so*' "$(dirname "${lib:-/nonexistent}")" "${dirs[@]}")
    echo "cuBLAS: header ${header:-MISSING}, library ${lib:-MISSING}, Lt ${lt:-MISSING}"
    if [ -z "$header" ] || [ -z "$lib" ] || [ -z "$lt" ]; then return 1; fi
    case "$header" in
        "$root"/*) ;;
        *) args+=" -DCMAKE_CUDA_FLAGS=-I$(dirname "$header")" ;;  # not where nvcc looks
    esac
    args+=" -DCUDA_cublas_LIBRARY=$lib -DCUDA_cublasLt_LIBRARY=$lt"
    local ld="$(dirname "$lib")"
    # the driver library (VMM pools link to it): ldconfig's, the driver's mount, or the stub
    local drv
    drv=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so(\.1)? / { print $NF; exit }')
    [ -z "$drv" ] && drv=$(find_first 'libcuda.so*' /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu /usr/lib64 "$root/lib64/stubs" "$root/lib/stubs")
    if [ -n "$drv" ]; then
        echo "driver library: $drv"
        args+=" -DCUDA_cuda_driver_LIBRARY=$drv"
        case "$drv" in */stubs/*) ;; *) ld+=":$(dirname "$drv")" ;; esac
    else
        echo "driver library: not found; building with GGML_CUDA_NO_VMM=ON (legacy memory pool)"
        args+=" -DGGML_CUDA_NO_VMM=ON"
    fi
    local cudart
    cudart=$(find_first 'libcudart.so*' "$root/lib64" "$root/lib" "$root/targets/x86_64-linux/lib" "${dirs[@]}")
    echo "CUDA runtime: ${cudart:-MISSING}"
    [ -n "$cudart" ] || return 1
    ld+=":$(dirname "$cudart")"
    case "$cudart" in
        "$root"/*) ;;
        *) args+=" -DCUDA_CUDART=$cudart" ;;  # FindCUDAToolkit looks for it beside nvcc only
    esac
    args+=" ${KIT_CMAKE_ARGS:-}"
    echo "$args" >"$WORK/cmake_args"
    echo "$ld" >"$WORK/ld_path"
    CMAKE_ARGS="$args"
    export LD_LIBRARY_PATH="$ld${ORIG_LD_LIBRARY_PATH:+:$ORIG_LD_LIBRARY_PATH}"
    echo "CMAKE_ARGS: $CMAKE_ARGS"
    echo "LD_LIBRARY_PATH: $LD_LIBRARY_PATH"
    return $ok
}

step_install() {
    local req
    local dev
    req=$(tr -d '\n' <"$KIT/repo/pyproject.toml" | grep -o 'version = "[^"]*"' | head -1 | cut -d'"' -f2)
    dev=$(tr -d '\n' <"$KIT/repo/dev/pyproject.toml" | grep -o 'version = "[^"]*"' | head -1 | cut -d'"' -f2)
    limit "$PY" -m pip install --no-index --find-links "$KIT/wheels" --no-cache-dir --no-compile --progress-bar off \
        "llama-metaws[nvidia]==$req" "llama-metaws-dev==$dev" "pytest>=7.4" "setuptools>=70" || return 1
    # llama_cpp loads its library at import: only its version here (the build comes next)
    "$PY" -c 'import importlib.metadata as m, cffi, gguf, pynvml, pytest; print("installed:", ", ".join(n + " " + m.version(n) for n in ("llama-metaws", "llama-cpp-python", "cffi", "gguf", "numpy", "pytest", "nvidia-ml-py")))'
}

step_build() {
    if [ ! -f "$WORK/llama.cpp/lmws-source.json" ]; then
        rm -rf "$WORK/llama.cpp"
        "$PY" -c 'import sys, tarfile
t = tarfile.open(sys.argv[1])
try:
    t.extractall(sys.argv[2], filter="data")
except TypeError:
    t.extractall(sys.argv[2])' "$KIT/llama.cpp.tar.gz" "$WORK" || return 1
    fi
    echo "CMAKE_ARGS=$CMAKE_ARGS"
    # llama-server for the real-shape step, compiled in the library's CMake tree (ggml and llama
    # once); when the tools fail, the library alone, so the other steps still run
    CMAKE_ARGS="$CMAKE_ARGS" limit "$PY" -m llama_metaws build --tools && return 0
    echo "build: the tools failed (above); the library alone: the real-shape step runs without llama-server"
    CMAKE_ARGS="$CMAKE_ARGS" limit "$PY" -m llama_metaws build
}

step_devices() {
    local listing
    listing=$(limit "$PY" -m llama_metaws devices) || { echo "$listing"; return 1; }
    echo "$listing"
    [ "$DEVICES" = auto ] || { echo "$DEVICES" >"$WORK/devices"; echo "tensor split over $DEVICES (given)"; return 0; }
    if [ "$BACKEND" = cpu ]; then DEVICES=CPU,CPU; echo "$DEVICES" >"$WORK/devices"; return 0; fi
    local n
    n=$(echo "$listing" | grep -c '^  CUDA[0-9]')
    local try=(CUDA0,CUDA0)
    [ "$n" -ge 2 ] && try=(CUDA0,CUDA1)
    local d
    for d in "${try[@]}"; do
        echo "checking the tensor split over $d: repro --level llama --mode alias"
        if limit "$PY" -m llama_metaws_dev repro --level llama --mode alias --device "$d" --model "$KIT/models/tiny-qwen35-mtp-agreement-0.8.gguf"; then
            DEVICES=$d; echo "$d" >"$WORK/devices"; echo "tensor split over $d"; return 0
        fi
    done
    if [ "$n" -eq 1 ]; then
        echo "one GPU listed twice failed: trying two virtual devices (GGML_CUDA_DEVICES=2) CUDA0,CUDA1"
        if GGML_CUDA_DEVICES=2 limit "$PY" -m llama_metaws_dev repro --level llama --mode alias --device CUDA0,CUDA1 --model "$KIT/models/tiny-qwen35-mtp-agreement-0.8.gguf"; then
            export GGML_CUDA_DEVICES=2; echo 2 >"$WORK/virtual"
            DEVICES=CUDA0,CUDA1; echo "$DEVICES" >"$WORK/devices"; echo "tensor split over CUDA0,CUDA1 (virtual)"; return 0
        fi
    fi
    DEVICES="${try[0]}"; echo "$DEVICES" >"$WORK/devices"
    echo "no tensor split passed the check: the tests and vram run over $DEVICES anyway"
    return 1
}

step_test() {
    local tests="${KIT_TESTS:-tests/test_workspace.py tests/test_tensor_split.py tests/test_faults.py}"
    [ "$DEVICES" = auto ] && DEVICES=$([ "$BACKEND" = cpu ] && echo CPU,CPU || echo CUDA0,CUDA0)
    echo "LLAMA_METAWS_TEST_DEVICES=$DEVICES${GGML_CUDA_DEVICES:+ GGML_CUDA_DEVICES=$GGML_CUDA_DEVICES}"
    # shellcheck disable=SC2086
    local reserve=0
    want vram && reserve="${KIT_VRAM_RESERVE_S:-90}"  # the seed's table must still fit after the tests
    (cd "$KIT/repo" && LLAMA_METAWS_TEST_DEVICES="$DEVICES" limit_leaving "$reserve" "$PY" -m pytest -p no:cacheprovider -rfE \
        --durations=15 --junitxml="$OUTDIR/junit.xml" $tests)
}

step_vram() {
    [ "$DEVICES" = auto ] && DEVICES=$([ "$BACKEND" = cpu ] && echo CPU,CPU || echo CUDA0,CUDA0)
    local extra=()
    [ "$BACKEND" = cuda ] && extra+=(--nvidia)
    "$PY" -c 'import matplotlib' 2>/dev/null && extra+=(--plot "$OUTDIR/vram.png")
    local reserve=0  # the real-shape step gets what the tests and vram leave; vram leaves it this much
    want realshape && reserve="${KIT_REALSHAPE_RESERVE_S:-60}"
    # shellcheck disable=SC2086
    limit_leaving "$reserve" "$PY" -m llama_metaws vram --json --device "$DEVICES" \
        --model "$KIT/models/tiny-qwen35-mtp-agreement-0.8.gguf" "${extra[@]}" ${KIT_VRAM_ARGS:-} \
        >"$OUTDIR/vram.json"
}

step_realshape() {
    [ "$DEVICES" = auto ] && DEVICES=$([ "$BACKEND" = cpu ] && echo CPU,CPU || echo CUDA0,CUDA0)
    local extra=()
    [ "$BACKEND" = cuda ] && extra+=(--nvidia)
    # the step keeps to its own deadline (rows that would start past it are cut and reported);
    # the outer limit is the backstop
    local budget=$(( $(left) - 5 ))
    [ "$budget" -lt 5 ] && budget=5
    # shellcheck disable=SC2086
    limit "$PY" -m llama_metaws_dev.sidebyside --work "$WORK" --out "$OUTDIR/realshape.json" \
        --device "$DEVICES" --budget "$budget" "${extra[@]}" ${KIT_REALSHAPE_ARGS:-}
}

step_report() {
    local p="$PY"
    "$p" -c 'import sys' 2>/dev/null || p=python3
    "$p" "$KIT/report.py" --kit "$KIT" --work "$WORK" --out "$OUTDIR" --backend "$BACKEND" \
        --devices "$DEVICES" --steps "$STEPS_TSV" --budget "$BUDGET"
}

echo "llama-metaws GPU run kit: $BACKEND, steps $STEPS, budget $BUDGET s, out $OUTDIR, work $WORK"
echo "preloaded: ${LD_PRELOAD:-nothing}"
run_step preflight  # a missing piece is named there; the steps that need it fail on their own
run_step install || FATAL=1
if [ -z "${FATAL:-}" ]; then run_step build || FATAL=1; fi
if [ -z "${FATAL:-}" ]; then
    run_step devices
    run_step test
    run_step vram
    run_step realshape
fi
[ -n "${FATAL:-}" ] && echo "== stopped after a failed step:$FAILED (later steps need it)"
run_step report
echo
echo "== total $(elapsed) s; failed:${FAILED:- none}"
[ -z "$FAILED" ]
