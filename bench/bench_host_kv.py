"""The seed's second table on the CPU test bed: host-resident KV under tensor split (``llama-metaws vram --host-kv``).

The tiny agreement model over ``CPU,CPU`` with ``offload_kqv=False`` (``-nkvo``; patches 0014-0016), MTP
drafting and the alias workspace, ``-np 2``, ``-c 512``: a short prompt, a prompt near the context
size, a short follow-up, on one ``Llama`` in one child process; the bytes per buffer type of the
target's KV cache, its recurrent state and the draft's KV cache from ggml's accounting. ``--runs``
repeats the whole configuration (fresh processes) and keeps the run with the median decode speed
of the long request. Writes the table into bench/BENCHMARKS.md.

    .venv/bin/python bench/bench_host_kv.py [--runs N] [--tokens N] [--no-write]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_metaws  # noqa: E402,F401
from llama_metaws_dev.testing import make_tiny_mtp_model  # noqa: E402
from llama_metaws.tools.vram.harness import DEFAULT_DEVICES, DEFAULT_PROMPT  # noqa: E402
from llama_metaws.tools.vram.hostkv import format_host_kv, run_host_kv  # noqa: E402

import _doc  # noqa: E402


def run(runs: int, n_tokens: int, write: bool = True) -> str:
    with tempfile.TemporaryDirectory(prefix="bench-host-kv-") as tmp:
        model = make_tiny_mtp_model(os.path.join(tmp, "tiny-mtp-agreement-0.8.gguf"), agreement=0.8)
        records = [run_host_kv(model=model, devices=DEFAULT_DEVICES, prompt=DEFAULT_PROMPT, n_ctx=512,
                               n_ubatch=64, n_predict=n_tokens, n_seq_max=2) for _ in range(runs)]
    ok = [r for r in records if r["result"] == "ok"]
    if ok:
        ok.sort(key=lambda r: r["requests"][1]["tokens_per_s"])
        record = ok[len(ok) // 2]
    else:
        record = records[0]
    lines = [
        "## Host-resident KV under tensor split: the seed's second table (bench/bench_host_kv.py, "
        "`llama-metaws vram --host-kv`)",
        "",
        f"Tiny qwen35 MTP model (agreement 0.8), `CPU,CPU`, `-sm tensor -nkvo`, draft-mtp with the alias "
        f"workspace, `-np 2 -c 512 -ub 64`, {n_tokens} tokens per request, three requests in a row on one "
        f"model; the run with the median decode speed of the long request of {runs}. Bytes are exact "
        "(llama.cpp's memory breakdown): the KV caches are in host memory (`CPU_Meta_Host`, each device "
        "working on its own KV head of them), the recurrent state in the meta buffer (its size per device).",
        "",
        "```",
        format_host_kv(record),
        "```",
        "",
        "(The seed, Qwen3.8-27B on two GPUs, -c 16384: target KV 544 MiB and draft KV 64 MiB on CUDA_Host, "
        "recurrent state 673 MiB on Meta(); 64-token prompt 44.3 t/s, 77.5 % acceptance; 2,568-token prompt "
        "prefill 488 t/s, decode 22.2 t/s, 40.7 %; short follow-up 43.7 t/s, 76.2 %. On CUDA devices this "
        "configuration is refused here: they do not compute on host memory.)",
    ]
    return _doc.publish("bench_host_kv", "\n".join(lines), write)


if __name__ == "__main__":
    _doc.main(__doc__, run, runs=3, tokens=32)
