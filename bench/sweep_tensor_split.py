"""Tensor split over CPU devices at many shapes: which models work, which are refused, which abort.

For every family llama.cpp splits (the MTP families not in ``NO_TENSOR_SPLIT_ARCHS``, and the
plain tiny archs), models at a range of sizes and seeds (widths, query and K/V heads, head sizes,
FFN and expert widths, expert counts, the delta net's groups, heads and state, layer counts),
each run in a child process of its own, so that an abort is a row of the table and not the end of
the sweep:

* the reference: one device, no drafting, with flash attention as a tensor split runs it (without,
  the reference takes the other attention kernel, whose rounding is ~1e-3 away on its own);
* under ``split_mode="tensor"`` over 2 and 3 CPU devices, with and without ``draft="mtp"``:
  prompts of 1, 2, 7 and 70 tokens one at a time, then two sequences in one batch; greedy tokens
  and their logits rows against the reference.

Cells: ``ok`` (tokens equal, rows within ``LOGIT_TOLERANCE``), ``tie`` (tokens part at a near tie
of the reference, rows close before it), ``REFUSED`` (``Llama`` raised ``ValueError`` before
loading: the message is listed), ``ABORT`` (the child died: the assertion is listed), ``DIFF``
(tokens or rows differ), ``ERROR`` (another exception). The reference failing (a shape the loader
refuses) marks the row ``bad model``. Exit status 1 when any cell is ABORT, DIFF or ERROR.

    .venv/bin/python bench/sweep_tensor_split.py [--only qwen3next,glm4moe] [--devices 2,3]
        [--quick] [--json out.json] [--list] [--summary out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

HERE = Path(__file__).resolve().parent

#: prompts (token ids below the TEST vocabulary's end token) run one at a time, then PAIR together
PROMPTS = {"p1": [5], "p2": [3, 9], "p7": [1, 2, 3, 4, 5, 6, 7], "p70": [(7 * i + 3) % 120 for i in range(70)]}
PAIR = ("p7", "p70")
N_TOKENS = 8
#: logits of one device against a tensor split (partial sums added in another order): measured up to
#: ~2e-4 at the tiny widths (tests/test_family_paths.py)
LOGIT_TOLERANCE = 2e-3
KW = dict(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1, n_seq_max=2, verbose=True)  # verbose: an abort while loading prints its message
CHILD_TIMEOUT = 300


# ---------------------------------------------------------------------------------------------
# shapes


@dataclasses.dataclass(frozen=True)
class Shape:
    kind: str              # family | plain | tiny | tiny_mtp | realshape
    arch: str
    over: Tuple[Tuple[str, object], ...] = ()  # Dims fields (family, plain) or make_mtp_model kwargs
    seed: int = 0

    @property
    def label(self) -> str:
        short = {"n_embd": "E", "n_head": "H", "n_head_kv": "KV", "head_dim": "hd", "n_ff": "ff",
                 "n_expert": "X", "n_expert_used": "Xu", "n_ff_exp": "ffx", "n_ff_shexp": "ffs",
                 "ssm_groups": "g", "ssm_heads": "sh", "ssm_state": "ss", "n_layer": "L",
                 "q_lora": "ql", "head_dim_v": "hdv", "dtype": "", "n_vocab": "V"}
        parts = [f"{short.get(k, k)}={v}" if short.get(k, k) else str(v) for k, v in self.over]
        kind = "" if self.kind in ("family", "plain") else f"[{self.kind}]"
        return f"{self.arch}{kind} " + " ".join(parts + [f"s{self.seed}"])

    @property
    def has_nextn(self) -> bool:
        if self.kind in ("tiny_mtp", "realshape"):
            return True
        if self.kind == "family":
            from llama_metaws_dev.testing.families import FAMILIES
            return FAMILIES[self.arch].mtp_graph
        return False


def _s(kind, arch, seed=0, **over) -> Shape:
    return Shape(kind, arch, tuple(over.items()), seed)


def shapes(quick: bool = False) -> List[Shape]:
    """The sweep's shapes: per family its tiny model, one dimension at a time around it, and
    a few combinations; ``quick``: the awkward ones only."""
    out: List[Shape] = []
    fam = lambda arch, seed=0, **o: out.append(_s("family", arch, seed, **o))  # noqa: E731

    # qwen's hybrids: the delta net's groups (K heads), V heads and state, the attention heads
    for arch in ("qwen35", "qwen35moe", "qwen3next"):
        fam(arch)
        fam(arch, 1)
        for g, h in ((1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (3, 3), (3, 6)):
            fam(arch, ssm_groups=g, ssm_heads=h)
        for ss in (16, 32, 128):
            fam(arch, ssm_state=ss)
        fam(arch, ssm_groups=1, ssm_heads=2, ssm_state=128)
        fam(arch, ssm_groups=4, ssm_heads=8, ssm_state=128, n_embd=256)
        fam(arch, ssm_groups=2, ssm_heads=4, ssm_state=128, n_embd=512)
        for h, kv in ((2, 1), (4, 1), (4, 2), (4, 4), (8, 2), (3, 1), (6, 2)):
            fam(arch, n_head=h, n_head_kv=kv)
        fam(arch, n_head=4, n_head_kv=2, head_dim=128, n_embd=512)
        fam(arch, n_head=8, n_head_kv=1, head_dim=128, n_embd=1024, ssm_groups=4, ssm_heads=8, ssm_state=128)
        fam(arch, n_embd=64)
        fam(arch, n_embd=256, n_layer=4)
        fam(arch, n_ff=96, n_ff_exp=32, n_ff_shexp=32)
        fam(arch, n_ff=384, n_ff_exp=256, n_ff_shexp=128)
        fam(arch, n_expert=8, n_expert_used=2)
        fam(arch, n_expert=3, n_expert_used=1)
        fam(arch, 2, n_layer=4, full_attn_interval=2)

    # grouped-query attention with experts, the multi-head families
    for arch in ("glm4moe", "mimo2", "step35", "hy_v3", "cohere2moe"):
        fam(arch)
        fam(arch, 1)
        for h, kv in ((2, 1), (4, 1), (4, 2), (4, 4), (8, 2), (8, 1), (3, 1), (6, 3), (6, 2)):
            fam(arch, n_head=h, n_head_kv=kv)
        for hd in (32, 128, 80):
            fam(arch, head_dim=hd)
        fam(arch, n_embd=64)
        fam(arch, n_embd=256)
        fam(arch, n_embd=512, n_head=8, n_head_kv=2)
        fam(arch, n_embd=1024, n_head=8, n_head_kv=1, head_dim=128)
        fam(arch, n_ff=96, n_ff_exp=32, n_ff_shexp=32)
        fam(arch, n_ff=384, n_ff_exp=192, n_ff_shexp=192)
        fam(arch, n_ff_exp=96)
        fam(arch, n_expert=8, n_expert_used=2)
        fam(arch, n_expert=3, n_expert_used=1)
        fam(arch, 2, n_layer=4)
    fam("mimo2", head_dim_v=32)  # d_k != d_v: K and V split as separate segments
    fam("mimo2", n_head=4, n_head_kv=1, head_dim_v=32)

    # deepseek4: a fixed trunk of two blocks (its compression ratios), one shared K/V head
    fam("deepseek4")
    fam("deepseek4", 1)
    for h in (2, 4, 8, 6):
        fam("deepseek4", n_head=h)
    fam("deepseek4", n_embd=256)
    fam("deepseek4", head_dim=128)
    fam("deepseek4", n_ff_exp=96)
    fam("deepseek4", n_expert=8, n_expert_used=2)

    # the plain archs of make_tiny_model at other shapes
    for arch in ("llama", "qwen3"):
        out.append(_s("plain", arch))
        for h, kv in ((2, 1), (4, 1), (4, 2), (8, 2), (3, 1), (6, 3)):
            out.append(_s("plain", arch, n_head=h, n_head_kv=kv))
        for e, h, kv, hd in ((64, 2, 1, 32), (512, 8, 2, 64), (1024, 8, 1, 128), (1024, 16, 4, 64)):
            out.append(_s("plain", arch, n_embd=e, n_head=h, n_head_kv=kv, head_dim=hd))
        out.append(_s("plain", arch, head_dim=80))
        out.append(_s("plain", arch, n_ff=96))
        out.append(_s("plain", arch, n_ff=1000))
        out.append(_s("plain", arch, 1, n_layer=5))

    # the tiny models the tests use, at other seeds; make_mtp_model (real proportions) small
    for arch in ("llama", "qwen3", "qwen35"):
        out += [_s("tiny", arch, seed) for seed in (0, 3)]
    out += [_s("tiny_mtp", "qwen35", seed) for seed in (0, 5)]
    for e, ff, dtype in ((256, 512, "f16"), (512, 1024, "f16"), (768, 1536, "f16"), (1024, 2048, "f16"),
                         (256, 512, "q8_0"), (512, 1024, "q8_0")):
        out.append(_s("realshape", "qwen35", n_embd=e, n_ff=ff, n_layer=4, n_vocab=256, dtype=dtype))

    if quick:
        awkward = lambda s: any(k in ("ssm_groups", "n_head_kv", "head_dim", "n_embd", "n_ff_exp", "head_dim_v")  # noqa: E731
                                for k, _ in s.over) or s.kind in ("tiny_mtp", "realshape")
        out = [s for s in out if awkward(s)]
    return out


def build(shape: Shape, path: Path) -> Path:
    """Write the shape's model; exceptions (a shape the builders refuse) go to the caller."""
    over = dict(shape.over)
    if shape.kind == "family":
        from llama_metaws_dev.testing.families import FAMILIES, family_layout
        from llama_metaws.tools.layouts.layout import materialize, write

        fam = FAMILIES[shape.arch]
        dims = dataclasses.replace(fam.dims, **over)
        layout = family_layout(shape.arch, dims)
        return write(layout, path, materialize(layout, np.random.default_rng(shape.seed), None))
    if shape.kind == "plain":
        return _plain(shape.arch, over, shape.seed, path)
    if shape.kind == "tiny":
        from llama_metaws_dev.testing import make_tiny_model
        return make_tiny_model(path, arch=shape.arch, seed=shape.seed)
    if shape.kind == "tiny_mtp":
        from llama_metaws_dev.testing import make_tiny_mtp_model
        return make_tiny_mtp_model(path, seed=shape.seed)
    if shape.kind == "realshape":
        from llama_metaws.demo.realshape import make_mtp_model
        return make_mtp_model(path, agreement=0.8, seed=shape.seed, **over)
    raise ValueError(shape.kind)


def _plain(arch: str, over: dict, seed: int, path: Path) -> Path:
    """``make_tiny_model``'s llama / qwen3 at other dimensions (its blocks, the families' layout)."""
    from llama_metaws.tools.layouts.blocks import attention, decoder, embeddings
    from llama_metaws.tools.layouts.layout import Dims, Layout, materialize, write

    dims = Dims(**dict(dict(n_embd=256, n_head=2, n_head_kv=2, head_dim=128, n_ff=384, n_nextn=0), **over))
    L = Layout(arch, dims)
    L.set(feed_forward_length=dims.n_ff, attention__head_count=dims.n_head, attention__head_count_kv=dims.n_head_kv,
          attention__layer_norm_rms_epsilon=dims.rms_eps, rope__dimension_count=dims.head_dim,
          attention__key_length=dims.head_dim, attention__value_length=dims.head_dim, rope__freq_base=10000.0)
    if arch == "llama":
        L.set(vocab_size=dims.n_vocab)
    embeddings(L)
    for il in L.layers:
        decoder(L, il, lambda L, il: attention(L, il, qk_norm=arch == "qwen3"), is_moe=lambda il: False)
    return write(L, path, materialize(L, np.random.default_rng(seed), None))


# ---------------------------------------------------------------------------------------------
# the child: one model, one mode


def child(path: str, mode: str, draft: Optional[str], out: str) -> None:
    from llama_metaws import Llama

    kw = dict(KW)
    if mode == "one-fa":  # a tensor split runs flash attention: so does its reference
        kw.update(flash_attn=True)
    elif mode != "one":
        kw.update(split_mode="tensor", devices=["CPU"] * int(mode[1:]))
    got: Dict[str, object] = {}

    def stage(name):
        print(f"STAGE {name}", flush=True)

    stage("load")
    try:
        llm = Llama(path, draft=draft, **kw)
    except ValueError as e:
        got["refused"] = str(e)
        Path(out).write_bytes(pickle.dumps(got))
        return
    with llm:
        for name, prompt in PROMPTS.items():
            stage(name)
            got[name] = greedy_rows(llm, [prompt], N_TOKENS)[0]
        stage("pair")
        got["pair"] = greedy_rows(llm, [PROMPTS[p] for p in PAIR], N_TOKENS)
        got["busy"] = llm.engine_stats()["slots_busy_max"]
    Path(out).write_bytes(pickle.dumps(got))


def greedy_rows(llm, prompts, n):
    """Each prompt's greedy tokens and the logits row of each, all submitted at once (one batch)."""
    from llama_metaws.engine.request import Request
    from llama_metaws.engine.samplers import SamplingParams

    reqs = [llm._engine.submit(Request(list(p), SamplingParams(temp=0.0), max_tokens=n, logits_rows=True))
            for p in prompts]
    got = []
    for r in reqs:
        toks, rows = [], []
        for out in r.outputs(timeout=CHILD_TIMEOUT):
            toks += out.tokens
            rows += out.rows or []
        got.append((toks, [np.asarray(x) for x in rows]))
    return got


def _run_child(path: Path, mode: str, draft: Optional[str], tmp: Path) -> dict:
    out = tmp / f"{mode}-{draft}.pkl"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--child", str(path), mode, str(draft), str(out)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        stages = re.findall(r"STAGE (\S+)", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""))
        return {"status": "TIMEOUT", "stage": stages[-1] if stages else "?"}
    stages = re.findall(r"STAGE (\S+)", p.stdout)
    stage = stages[-1] if stages else "start"
    if p.returncode != 0 or not out.exists():
        return {"status": "ABORT" if p.returncode < 0 else "ERROR", "stage": stage, "why": _why(p.stderr),
                "rc": p.returncode}
    got = pickle.loads(out.read_bytes())
    if "refused" in got:
        return {"status": "REFUSED", "stage": stage, "why": got["refused"]}
    return {"status": "done", "got": got}


def _why(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for key in ("GGML_ASSERT", "GGML_ABORT", "error", "Error", "Traceback"):
        hits = [ln for ln in lines if key in ln]
        if hits:
            line = hits[-1] if key != "Traceback" else lines[-1]
            return re.sub(r"^.*/(?=[\w.-]+:\d+:)", "", line)[:200]
    return (lines[-1] if lines else "(no output)")[:200]


def compare(ref: dict, got: dict) -> Tuple[str, str]:
    """(status, where) of a run against the reference."""
    worst = 0.0
    for name in list(PROMPTS) + ["pair"]:
        want_list = [ref[p] for p in PAIR] if name == "pair" else [ref[name]]
        got_list = got[name] if name == "pair" else [got[name]]
        for (wt, wr), (gt, gr) in zip(want_list, got_list):
            n = min(len(wt), len(gt))
            for i in range(n):
                if not np.all(np.isfinite(gr[i])):
                    return "DIFF", f"{name}: NaN/inf at token {i}"
                d = float(np.abs(np.asarray(gr[i]) - np.asarray(wr[i])).max())
                worst = max(worst, d)
                if wt[i] != gt[i]:
                    top = np.sort(np.asarray(wr[i]))[::-1]
                    if top[0] - top[1] <= 2 * d + LOGIT_TOLERANCE and d <= LOGIT_TOLERANCE * 10:
                        return "tie", f"{name}: token {i} at a gap of {top[0] - top[1]:.1e}"
                    return "DIFF", f"{name}: token {i} {gt[i]} != {wt[i]} (rows {d:.1e} apart)"
                if d > LOGIT_TOLERANCE:
                    return "DIFF", f"{name}: rows {d:.1e} apart at token {i}"
            if len(wt) != len(gt):
                return "DIFF", f"{name}: {len(gt)} tokens, one device {len(wt)}"
    return "ok", f"max |d logits| {worst:.1e}"


def sweep(args) -> List[dict]:
    rows = []
    todo = shapes(args.quick)
    if args.only:
        keep = set(args.only.split(","))
        todo = [s for s in todo if s.arch in keep]
    if args.match:
        todo = [s for s in todo if re.search(args.match, s.label)]
    devices = [int(d) for d in args.devices.split(",")]
    with tempfile.TemporaryDirectory(prefix="sweep-ts-") as tmp_s:
        tmp = Path(tmp_s)
        for k, shape in enumerate(todo):
            row = {"shape": shape.label, "arch": shape.arch, "cells": {}}
            rows.append(row)
            t0 = time.time()
            path = tmp / "model.gguf"
            try:
                build(shape, path)
            except Exception as e:  # noqa: BLE001 - a shape the builder refuses is a row, not the end
                row["bad"] = f"build: {type(e).__name__}: {e}"[:200]
                _progress(k, len(todo), row, t0)
                continue
            ref = _run_child(path, "one-fa", None, tmp)
            if ref["status"] != "done":
                row["bad"] = f"one device: {ref['status']} {ref.get('why', '')}"[:200]
                _progress(k, len(todo), row, t0)
                continue
            for n in devices:
                for draft in ((None, "mtp") if shape.has_nextn else (None,)):
                    col = f"t{n}" + ("+mtp" if draft else "")
                    r = _run_child(path, f"t{n}", draft, tmp)
                    if r["status"] == "done":
                        status, where = compare(ref["got"], r["got"])
                        r = {"status": status, "why": where}
                    else:
                        r = {k2: v for k2, v in r.items() if k2 != "got"}
                    row["cells"][col] = r
            _progress(k, len(todo), row, t0)
            if args.json:  # after every shape: a sweep stopped half-way keeps what it found
                Path(args.json).write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return rows


def _progress(k, n, row, t0):
    cells = " ".join(f"{c}:{r['status']}" + (f"@{r['stage']}" if r.get("stage") else "")
                     for c, r in row["cells"].items())
    print(f"[{k + 1}/{n}] {row['shape']}: {row.get('bad') or cells} ({time.time() - t0:.1f}s)",
          file=sys.stderr, flush=True)


COLUMNS = ("t2", "t2+mtp", "t3", "t3+mtp")


def table(rows: List[dict]) -> str:
    notes: Dict[str, int] = {}

    def cell(r):
        if r is None:
            return "-"
        s = r["status"]
        if s in ("ok",):
            return s
        why = r.get("why", "")
        if s in ("ABORT", "ERROR", "REFUSED", "TIMEOUT"):
            key = re.sub(r"\d+(\.\d+)?", "N", why) if s == "REFUSED" else why
            notes.setdefault(f"{s}: {key}", len(notes) + 1)
            return f"{s}@{r.get('stage', '?')} [{notes[f'{s}: {key}']}]"
        return f"{s} ({why})" if s == "DIFF" else s

    lines = ["| shape | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for row in rows:
        if row.get("bad"):
            lines.append(f"| {row['shape']} | bad model: {row['bad']} |" + " |" * (len(COLUMNS) - 1))
            continue
        lines.append(f"| {row['shape']} | " + " | ".join(cell(row["cells"].get(c)) for c in COLUMNS) + " |")
    counts: Dict[str, int] = {}
    for row in rows:
        for r in row["cells"].values():
            counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines.append("")
    lines.append("cells: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) +
                 f"; shapes {len(rows)}, bad models {sum(1 for r in rows if r.get('bad'))}")
    for text, n in notes.items():
        lines.append(f"[{n}] {text}")
    return "\n".join(lines)


def summary(rows: List[dict]) -> str:
    """Per architecture: shapes and cells of each status; then every cell that is not ok."""
    archs: Dict[str, Dict[str, int]] = {}
    for row in rows:
        counts = archs.setdefault(row["arch"], {"shapes": 0})
        counts["shapes"] += 1
        if row.get("bad"):
            counts["bad model"] = counts.get("bad model", 0) + 1
        for r in row["cells"].values():
            counts[r["status"]] = counts.get(r["status"], 0) + 1
    statuses = sorted({k for c in archs.values() for k in c if k != "shapes"}, key=lambda k: (k != "ok", k))
    lines = ["| arch | shapes | " + " | ".join(statuses) + " |", "|---|---:|" + "---:|" * len(statuses)]
    for arch, c in archs.items():
        lines.append(f"| {arch} | {c['shapes']} | " + " | ".join(str(c.get(k, 0)) for k in statuses) + " |")
    odd = [f"- {row['shape']}: {row['bad']}" for row in rows if row.get("bad")]
    odd += [f"- {row['shape']} {col}: {r['status']}" + (f"@{r['stage']}" if r.get("stage") else "") + f" ({r.get('why', '')})"
            for row in rows for col, r in row["cells"].items() if r["status"] != "ok"]
    return "\n".join(lines + ([""] + odd if odd else []))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", nargs=4, metavar=("PATH", "MODE", "DRAFT", "OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--only", help="comma-separated architectures")
    ap.add_argument("--match", help="a regular expression the shape's label must match")
    ap.add_argument("--devices", default="2,3", help="device counts of the tensor split (default 2,3)")
    ap.add_argument("--quick", action="store_true", help="the awkward shapes only")
    ap.add_argument("--json", help="write the rows as JSON here too (after every shape)")
    ap.add_argument("--list", action="store_true", help="list the shapes and exit")
    ap.add_argument("--summary", metavar="JSON", help="print a --json file's counts per architecture and its cells that are not ok, and exit")
    args = ap.parse_args(argv)
    if args.summary:
        print(summary(json.loads(Path(args.summary).read_text())))
        return 0
    if args.child:
        path, mode, draft, out = args.child
        child(path, mode, None if draft == "None" else draft, out)
        return 0
    if args.list:
        for s in shapes(args.quick):
            print(s.label)
        return 0
    import llama_metaws  # noqa: F401  (the patched build is there before any child starts)

    rows = sweep(args)
    print(table(rows))
    bad = {"ABORT", "DIFF", "ERROR", "TIMEOUT"}
    return 1 if any(r["status"] in bad for row in rows for r in row["cells"].values()) else 0


if __name__ == "__main__":
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    sys.exit(main())
