"""What the fault-injection hook (patch 0004, GGML_ALLOC_FAULT_INJECTION=ON) costs the build users get.

Every llama-metaws build compiles the hook in: ``ggml_backend_buft_alloc_buffer`` takes a mutex and
checks a counter before each non-empty allocation. This runs the same work on that build and on
one without the hook (``CMAKE_ARGS=-DGGML_ALLOC_FAULT_INJECTION=OFF``: a build of its own, cached
under its own key, with its own manifest, made here when missing), each measurement in a fresh
process, and the two builds' processes of a round started together, so that the machine's load
of the moment weighs on both alike (this machine is shared); per round, the ratio with the hook over
without it (time, or time per token; 1.0: no cost), and their median over the rounds:

- raw allocations: ``ggml_backend_buft_alloc_buffer`` + ``ggml_backend_buffer_free`` of CPU
  buffers (4 KiB to 4 MiB), the call the hook sits in, ns per pair (the fastest batch);
- load: the tiny MTP model, its target and draft contexts and their shared workspace (the fastest
  of three);
- requests: greedy completions with MTP drafting, each prompt growing the shared workspace and the
  decode steps shrinking it again (grows and shrinks counted), tokens per second.

    .venv/bin/python bench/bench_fault_hook.py [--runs 7] [--tokens 48] [--no-write]
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

NO_HOOK_MANIFEST = ROOT / "build" / "manifest-nofault.json"
NO_HOOK_ARGS = "-DGGML_ALLOC_FAULT_INJECTION=OFF"
SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20]
N_BATCHES, BATCH = 40, 100  # raw allocations: the fastest of these batches (the least disturbed)
N_LOADS = 3                 # load: the fastest of these
N_REQUESTS = 4


def child(n_tokens: int) -> dict:
    """One measurement in this process, on the build the manifest names."""
    import llama_metaws  # noqa: F401  (the build, before llama_cpp)
    from llama_metaws import Llama
    from llama_metaws.native.runtime import require_build
    from llama_metaws_dev.testing import make_tiny_mtp_model

    b = require_build()
    base = ctypes.CDLL(str(b.lib_dir / "libggml-base.so"))
    cpu = ctypes.CDLL(str(b.lib_dir / "libggml-cpu.so"))
    base.ggml_backend_buft_alloc_buffer.restype = ctypes.c_void_p
    base.ggml_backend_buft_alloc_buffer.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    base.ggml_backend_buffer_free.argtypes = [ctypes.c_void_p]
    cpu.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    buft = cpu.ggml_backend_cpu_buffer_type()
    hooked = hasattr(base, "ggml_backend_inject_alloc_failure")
    batches = []
    for _ in range(N_BATCHES):
        t0 = time.perf_counter_ns()
        for i in range(BATCH):
            buf = base.ggml_backend_buft_alloc_buffer(buft, SIZES[i % len(SIZES)])
            assert buf, "allocation failed"
            base.ggml_backend_buffer_free(buf)
        batches.append((time.perf_counter_ns() - t0) / BATCH)
    alloc_ns = min(batches)

    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_mtp_model(Path(tmp) / "hook.gguf", seed=11, agreement=0.8))
        loads = []
        for i in range(N_LOADS):
            t0 = time.perf_counter()
            llm = Llama(path, draft="mtp", n_ctx=512, n_batch=64, n_ubatch=64, verbose=False)
            loads.append(time.perf_counter() - t0)
            if i < N_LOADS - 1:
                llm.close()
        load_s = min(loads)
        with llm:
            prompts = [" ".join(str((7 * i + k) % 97) for i in range(120)) for k in range(N_REQUESTS)]
            n, t0 = 0, time.perf_counter()
            for p in prompts:
                out = llm(p, max_tokens=n_tokens, temperature=0.0)
                n += out["usage"]["completion_tokens"]
            tps = n / (time.perf_counter() - t0)
            grows = sum(e.n_grow for e in llm.workspace_stats())
            shrinks = sum(e.n_shrink for e in llm.workspace_stats())
    return dict(hooked=hooked, alloc_ns=alloc_ns, load_s=load_s, tps=tps, grows=grows, shrinks=shrinks,
                build=b.root.name)


def cpu_flags() -> str:
    """The CPU's model and the SIMD flags that matter to ggml, from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU flags unknown"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    have = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile")
    return f"{model}; " + " ".join(f for f in wanted if f in have) + ("" if "amx_tile" in have else "; no AMX")


def ensure_no_hook_build() -> None:
    if NO_HOOK_MANIFEST.is_file():
        return
    env = dict(os.environ, CMAKE_ARGS=NO_HOOK_ARGS, LLAMA_METAWS_MANIFEST=str(NO_HOOK_MANIFEST))
    subprocess.run([sys.executable, "-m", "llama_metaws", "build"], env=env, check=True)


def measure_pair(n_tokens: int) -> dict:
    """One round: the hook's build and the hookless one, measured at the same time."""
    procs = {}
    for name, manifest in (("hook", None), ("none", NO_HOOK_MANIFEST)):
        env = dict(os.environ)
        if manifest is not None:
            env["LLAMA_METAWS_MANIFEST"] = str(manifest)
        procs[name] = subprocess.Popen([sys.executable, __file__, "--child", str(n_tokens)], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = {}
    for name, proc in procs.items():
        stdout, _ = proc.communicate()
        assert proc.returncode == 0, f"the {name} build's measurement failed"
        out[name] = json.loads(stdout.strip().splitlines()[-1])
    return out


def run(runs: int, n_tokens: int, write: bool = True) -> str:
    import _doc

    ensure_no_hook_build()
    rounds = [measure_pair(n_tokens) for _ in range(runs)]
    results = {name: [r[name] for r in rounds] for name in ("hook", "none")}
    assert all(x["hooked"] for x in results["hook"]) and not any(x["hooked"] for x in results["none"]), \
        "the two builds are not the hook's and the hookless one"
    med = {name: {k: statistics.median(x[k] for x in xs) for k in ("alloc_ns", "load_s", "tps", "grows", "shrinks")}
           for name, xs in results.items()}
    h, n = med["hook"], med["none"]
    # per round, the hook's cost over the hookless build's: time, or time per token (1.0: no cost)
    cost = {"alloc_ns": lambda r: r["hook"]["alloc_ns"] / r["none"]["alloc_ns"],
            "load_s": lambda r: r["hook"]["load_s"] / r["none"]["load_s"],
            "tps": lambda r: r["none"]["tps"] / r["hook"]["tps"]}
    ratios = {k: sorted(f(r) for r in rounds) for k, f in cost.items()}
    of_medians = {"alloc_ns": h["alloc_ns"] / n["alloc_ns"], "load_s": h["load_s"] / n["load_s"],
                  "tps": n["tps"] / h["tps"]}
    rows = [(label, h[k], n[k], of_medians[k], statistics.median(ratios[k]), ratios[k][0], ratios[k][-1])
            for label, k in (("raw allocation + free (ns per pair)", "alloc_ns"),
                             ("load: model, contexts, workspace (s)", "load_s"), ("requests: tokens/s", "tps"))]
    table = [
        "## The fault-injection hook in user builds: with it and without it (bench/bench_fault_hook.py)",
        "",
        f"Every llama-metaws build compiles patch 0004's hook (GGML_ALLOC_FAULT_INJECTION=ON). The same work on "
        f"that build ({results['hook'][0]['build']}) and on one without the hook ({results['none'][0]['build']}, "
        f"{NO_HOOK_ARGS}), {runs} rounds, each a fresh process per build, the two started together. Raw: CPU "
        f"buffers of 4 KiB to 4 MiB allocated and freed, the fastest of {N_BATCHES} batches of {BATCH}; load: the "
        f"fastest of {N_LOADS}. Requests: the tiny MTP model with drafting and the shared workspace, "
        f"{N_REQUESTS} requests of a 120-number prompt and {n_tokens} tokens, the workspace growing and "
        f"shrinking {h['grows']:.0f} / {h['shrinks']:.0f} times. Medians over the rounds; a ratio is the time with "
        "the hook over the time without (for requests, per token): 1.0 is no cost, below 1 the hook's side was "
        "faster. First of the medians, then per round (its median and range: the rounds' own noise).",
        "",
        "| figure | with the hook | without | ratio of the medians | per round: median | per round: range |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    table += [f"| {name} | {a:,.3f} | {b:,.3f} | {ratio:.3f} | {per:.3f} | {lo:.3f} to {hi:.3f} |"
              for name, a, b, ratio, per, lo, hi in rows]
    return _doc.publish("bench_fault_hook", "\n".join(table), write, where=f"{_doc.machine()}, {cpu_flags()}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(child(int(sys.argv[2]))))
    else:
        import _doc

        _doc.main(__doc__, run, runs=7, tokens=48)
