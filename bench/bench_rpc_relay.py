"""Patch 0020 on and off: tensor split over two RPC servers, with and without MTP drafting.

The series without 0020 is built once (cached like any build: its own key, its own manifest in a
temporary source root holding this checkout's patches minus 0020 and its shim); then each round
runs, in child processes and alternating between the two builds, one Llama per variant (its own
two ``llama-metaws rpc-server`` processes from the same build) for a few greedy requests. Decode
tokens/s are medians; the ratio is with 0020 over without. Round trips per token are the same in
both (``bench_rpc.py`` counts them): 0020 overlaps them.

    .venv/bin/python bench/bench_rpc_relay.py [--runs 3] [--tokens 48]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _doc  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PATCH = "0020-"
REQUESTS = 3


def _child(variant: str, n_tokens: int) -> None:
    import llama_metaws  # noqa: F401
    from llama_metaws import Llama
    from llama_metaws_dev.testing import free_port, make_tiny_mtp_model, start_rpc_server, stop_process

    path = str(make_tiny_mtp_model(Path(tempfile.gettempdir()) / "bench-rpc-mtp.gguf", seed=31, agreement=0.8))
    procs = [start_rpc_server(free_port(), stderr=subprocess.DEVNULL) for _ in range(2)]
    try:
        with Llama(path, draft="mtp" if variant == "tensor+mtp" else None, rpc_servers=[p.endpoint for p in procs],
                   split_mode="tensor", n_ctx=512, n_batch=64, n_ubatch=64, n_threads=1, verbose=False) as llm:
            tps, text = [], None
            for k in range(REQUESTS + 1):
                out = llm.create_completion("the quick brown fox jumps over the lazy dog", max_tokens=n_tokens,
                                            temperature=0.0)["choices"][0]["text"]
                text = text or out
                if k:
                    tps.append(llm.timings()["decode_tokens_per_s"])
    finally:
        for p in procs:
            stop_process(p)
    print(json.dumps(dict(tps=tps, text=text)))


def _baseline_env(tmp: Path) -> dict:
    """A source root with the series minus 0020, built (cached) and its manifest."""
    shutil.copytree(ROOT / "native", tmp / "native")
    (tmp / "patches").mkdir()
    names = [n for n in (ROOT / "patches" / "series").read_text().split() if not n.startswith(PATCH)]
    for n in names:
        shutil.copy(ROOT / "patches" / n, tmp / "patches" / n)
    (tmp / "patches" / "series").write_text("\n".join(names) + "\n")
    env = dict(os.environ, LLAMA_METAWS_SOURCE_ROOT=str(tmp), LLAMA_METAWS_MANIFEST=str(tmp / "manifest.json"))
    subprocess.run([sys.executable, "-m", "llama_metaws", "build"], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return env


def run(runs: int, n_tokens: int, write: bool = True) -> str:
    variants = ("tensor", "tensor+mtp")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"with 0020": dict(os.environ), "without 0020": _baseline_env(Path(tmp))}
        tps = {(b, v): [] for b in builds for v in variants}
        texts = set()
        for k in range(runs):
            for b in (list(builds) if k % 2 == 0 else list(builds)[::-1]):
                for v in variants:
                    res = subprocess.run([sys.executable, __file__, "--child", v, "--tokens", str(n_tokens)],
                                         env=builds[b], capture_output=True, text=True, timeout=600, check=True)
                    doc = json.loads(res.stdout.strip().splitlines()[-1])
                    tps[(b, v)] += doc["tps"]
                    texts.add((v, doc["text"]))
    med = {key: statistics.median(x) for key, x in tps.items()}
    lines = [
        "## Patch 0020 on and off: the relayed all-reduce over RPC (bench/bench_rpc_relay.py)",
        "",
        f"Tensor split over two `llama-metaws rpc-server` processes on 127.0.0.1 (1 thread each), the "
        f"tiny qwen35 MTP model, {n_tokens} tokens greedy, {runs} rounds alternating between this "
        f"build and the series built without 0020, {REQUESTS} requests per child (medians of decode "
        f"t/s); {time.monotonic() - t0:.0f} s. Same output with and without: "
        f"{'yes' if len(texts) == len(variants) else 'NO'}.",
        "",
        "| variant | with 0020 t/s | without 0020 t/s | with / without |",
        "|---|---:|---:|---:|",
    ]
    for v in variants:
        a, b = med[("with 0020", v)], med[("without 0020", v)]
        lines.append(f"| {v.replace('+mtp', ' + MTP')} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
    return _doc.publish("bench_rpc_relay", "\n".join(lines), write)


if __name__ == "__main__":
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        _child(sys.argv[i + 1], int(sys.argv[sys.argv.index("--tokens") + 1]))
    else:
        _doc.main(__doc__, run, runs=3, tokens=48)
