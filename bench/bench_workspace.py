"""Private vs shared compute buffers for a target and its MTP draft (the phase-aware workspace).

One run, side by side: the same tiny qwen35 MTP model, one pair of contexts per mode, requests
interleaved (private, shared, private, shared, ...) so that machine noise hits both alike.
Reports peak compute bytes (exact, ggml accounting, sampled in one more, untimed request before
every verification and after every accepted token, so the prompt phase is seen too), the
tokens/s ratio (median over the interleaved runs), and grows/shrinks per request. Writes the
table it prints into bench/BENCHMARKS.md.

    .venv/bin/python bench/bench_workspace.py [--runs 9] [--tokens 48]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_metaws  # noqa: E402,F401  (the patched build, before llama_cpp)
from llama_metaws.engine.contexts import load_model, new_context  # noqa: E402
from llama_metaws_dev.testing import make_tiny_mtp_model  # noqa: E402
from llama_metaws.engine.workspace import Workspace  # noqa: E402

import _doc  # noqa: E402
from _drafter import Drafter  # noqa: E402


DRAFT_MAX = 3
N_UBATCH = 64


def make_pair(model, mode):
    target = new_context(model, n_ctx=512, n_batch=256, n_ubatch=N_UBATCH, n_rs_seq=DRAFT_MAX)
    draft = new_context(model, n_ctx=512, n_batch=256, n_ubatch=N_UBATCH, mtp=True)
    ws = Workspace(target, draft, mode="off" if mode == "private" else "alias", n_decode_tokens=DRAFT_MAX + 1)
    return target, draft, ws, Drafter(target, draft, draft_max=DRAFT_MAX)


def run(runs: int, n_tokens: int, write: bool = True) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_mtp_model(Path(tmp) / "bench-mtp.gguf", seed=11, agreement=0.8)
        model = load_model(path, load_mtp=True)
        modes = ("private", "shared")
        pairs = {m: make_pair(model, m) for m in modes}
        prompts = [[(7 * i + k) % 128 for i in range(200)] for k in range(runs)]  # > n_ubatch
        tps = {m: [] for m in modes}
        peak = {m: 0 for m in modes}
        roles = {m: 0 for m in modes}  # at the peak: max(owner, borrower) per shared entry
        grows = {m: [] for m in modes}
        shrinks = {m: [] for m in modes}
        outputs = {m: [] for m in modes}

        def counts(ws):
            entries = ws.stats()
            return sum(e.n_grow for e in entries), sum(e.n_shrink for e in entries)

        for k in range(runs + 1):  # run 0 warms up and is not counted
            for m in (modes if k % 2 else modes[::-1]):  # alternate who goes first
                target, draft, ws, drafter = pairs[m]
                g0, s0 = counts(ws)
                t0 = time.perf_counter()
                out = drafter.generate(prompts[k % runs], n_tokens)
                dt = time.perf_counter() - t0
                g1, s1 = counts(ws)
                if k == 0:
                    continue
                tps[m].append((len(prompts[k % runs]) + n_tokens) / dt)
                grows[m].append(g1 - g0)
                shrinks[m].append(s1 - s0)
                outputs[m].append(out)

        # memory in an untimed request: sampled after every engine step (the prompt's chunks
        # included)
        for m in modes:
            target, draft, ws, drafter = pairs[m]

            def sample(*_args, ws=ws, m=m):
                entries = ws.stats()
                total = sum(e.allocated for e in entries)
                if total > peak[m]:
                    peak[m] = total
                    roles[m] = sum(max(e.owner_need, e.borrower_need) if e.shared else e.allocated
                                   for e in entries)

            drafter.generate(prompts[0], n_tokens, on_step=sample)
        for m in modes:
            target, draft, ws, drafter = pairs[m]
            ws.close()
            draft.close()
            target.close()
        model.close()

    identical = outputs["private"] == outputs["shared"]
    med = {m: statistics.median(tps[m]) for m in modes}
    ratio = med["shared"] / med["private"]
    lines = [
        "## Phase-aware workspace: private vs shared (bench/bench_workspace.py)",
        "",
        f"Tiny qwen35 MTP model, one CPU device, draft_max {DRAFT_MAX}, n_ubatch {N_UBATCH}, "
        f"{runs} interleaved requests per mode (200-token prompt, {n_tokens} generated). "
        f"Output identical across modes: {'yes' if identical else 'NO'}.",
        "",
        "| mode | peak compute bytes (CPU) | vs private | tokens/s ratio (median) | grows/request | shrinks/request |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for m in modes:
        lines.append(
            f"| {m} | {peak[m]:,} | {peak[m] / peak['private']:.3f} | "
            f"{med[m] / med['private']:.3f} | {statistics.mean(grows[m]):.1f} | {statistics.mean(shrinks[m]):.1f} |")
    lines += ["", f"Shared / private tokens/s: **{ratio:.3f}** (goal >= 0.98). Shared peak = "
              f"{peak['shared']:,} B = max(owner, borrower) at that moment "
              f"({roles['shared']:,} B, the limit of sharing); private = {peak['private']:,} B "
              f"(owner + borrower): {peak['private'] - peak['shared']:,} B saved."]
    return _doc.publish("bench_workspace", "\n".join(lines), write)


if __name__ == "__main__":
    _doc.main(__doc__, run, runs=15, tokens=48)
