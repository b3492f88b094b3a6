"""Prompt reuse on a hybrid target with MTP drafting: a chat's second turn, reused vs afresh.

Each run: a first turn (a 984-token history, 16 tokens answered) on the reusing instance, then
the second turn (the history, the answer and 20 new tokens: 1,020 tokens) on it and, fresh, on a
second instance that last held another conversation (so it evaluates the whole prompt); then the
last message rewritten (the history and 36 other tokens), which restores the checkpoint taken
after the history (the fresh instance checks the output). Both
instances draft with the MTP head and share the workspace. Reports the second turn's prompt time
(until the first token) as medians, their ratio, cache_n / prompt_n, the checkpoint memory, and
whether the outputs were identical. The model is ``make_mtp_model``'s real-shape qwen35 (Qwen's
vocabulary, the 0.6B-class bench shape, q8_0, agreement 0.8; cached by its arguments).

    .venv/bin/python bench/bench_reuse.py [--runs 7] [--tokens 16]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_metaws  # noqa: E402,F401
from llama_metaws import Llama  # noqa: E402
from llama_metaws_dev.testing import N_VOCAB, generate_n, make_mtp_model  # noqa: E402

import _doc  # noqa: E402

HISTORY, NEW = 1000, 20
KW = dict(draft="mtp", n_ctx=2048, n_batch=512, n_ubatch=512, phase_aware_workspace=True, verbose=False)


def run(runs: int, n_tokens: int, write: bool = True) -> str:
    rng = np.random.default_rng(0)
    path = str(make_mtp_model(agreement=0.8, dtype="q8_0"))
    reuse, fresh = Llama(path, **KW), Llama(path, **KW)
    ms = {"reused": [], "afresh": [], "restored": []}
    counts, same = None, True
    for k in range(runs + 1):
        first = [int(x) for x in rng.integers(0, N_VOCAB, size=HISTORY - n_tokens)]
        answer = generate_n(reuse, first, n_tokens)
        second = first + answer + [int(x) for x in rng.integers(0, N_VOCAB, size=NEW)]
        generate_n(fresh, [int(x) for x in rng.integers(0, N_VOCAB, size=50)], 2)  # another chat
        order = [(reuse, "reused"), (fresh, "afresh")]
        outs = {}
        for llm, name in (order if k % 2 else order[::-1]):
            outs[name] = generate_n(llm, second, n_tokens)
            t = llm.timings()
            if k:  # the first run warms up
                ms[name].append(t["prompt_ms"])
            if name == "reused":
                counts = (t["cache_n"], t["prompt_n"], t["prompt_tokens"])
            else:
                assert t["cache_n"] == 0
        same = same and outs["reused"] == outs["afresh"]
        # the user rewrites the last message instead: back to the checkpoint after `first`
        edited = first + [int(x) for x in rng.integers(0, N_VOCAB, size=n_tokens + NEW)]
        got = generate_n(reuse, edited, n_tokens)
        t = reuse.timings()
        if k:
            ms["restored"].append(t["prompt_ms"])
        restored = (t["cache_n"], t["prompt_n"])
        same = same and got == generate_n(fresh, edited, n_tokens)
    stats = reuse.checkpoint_stats()
    reuse.close()
    fresh.close()

    med = {n: statistics.median(v) for n, v in ms.items()}
    speedup = med["afresh"] / med["reused"]
    lines = [
        "## Prompt reuse on a hybrid target with MTP drafting (bench/bench_reuse.py)",
        "",
        f"The second turn of a chat: a {HISTORY - n_tokens}-token history, its {n_tokens}-token answer "
        f"and {NEW} new tokens ({counts[2]} tokens), greedy, {runs} interleaved runs. `make_mtp_model`'s "
        "real-shape qwen35 (151,936 tokens, 28 layers of width 1024, q8_0, agreement 0.8) with n_ctx "
        "2048, one CPU device, MTP drafting with the workspace. Outputs identical: "
        f"{'yes' if same else 'NO'}.",
        "",
        "| second turn | prompt ms (median) | cache_n | prompt_n |",
        "|---|---:|---:|---:|",
        f"| reused (live state) | {med['reused']:.1f} | {counts[0]} | {counts[1]} |",
        f"| afresh | {med['afresh']:.1f} | 0 | {counts[2]} |",
        f"| last message rewritten (a checkpoint restored) | {med['restored']:.1f} | {restored[0]} | "
        f"{restored[1]} |",
        "",
        f"Reuse vs afresh: **{speedup:.1f}x** faster to the first token (goal >= 5x); from the "
        f"checkpoint {med['afresh'] / med['restored']:.1f}x. Checkpoints held "
        f"after the runs: {stats['count']} ({stats['bytes']:,} bytes of at most {stats['max_bytes']:,}).",
    ]
    return _doc.publish("bench_reuse", "\n".join(lines), write)


if __name__ == "__main__":
    _doc.main(__doc__, run, runs=7, tokens=16)
