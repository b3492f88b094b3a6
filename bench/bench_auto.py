"""``draft_max="auto"`` from the first request of a fresh process, next to no drafting and every fixed k.

One run, interleaved, side by side, on models from ``llama_metaws_dev.testing.make_mtp_model`` (the
bench shape; cached) at several agreement rates. Every configuration is a child process of its
own that loads the model and runs ONE request, the measured one (no warm-up: what a fresh
process gives its first client), pinned to the last core(s):

* ``no drafting``, ``k=1`` .. ``k=4``: ``Llama(draft=None)``, ``Llama(draft="mtp", draft_max=k)``;
* ``auto, measured at load``: ``Llama(draft="mtp", draft_max="auto")`` with an empty cost folder
  (``LLAMA_METAWS_COSTS``): the engine measures its cost prior at load (``engine/prior.py``);
* ``auto, saved curve``: the same with a cost folder the run keeps, so after its first child it
  loads the curve an earlier child saved (checked against a few timings), and starts its request
  from the acceptance the last child of the same model left there (what a user's next process
  gets from the user cache).

Reports decode tokens/s (the request's decode phase), per agreement the ratio of each auto to the
best of no drafting and k = 1..4 (issue 37: >= 0.95): the ratio of the medians over the runs, and
the median of each run's ratio; the share of plain steps, acceptance, and what the prior cost at
load (the engine's seconds, and its wall time as a share of the load). Checks every output
against no drafting's. Writes its table into bench/BENCHMARKS.md.

    .venv/bin/python bench/bench_auto.py [--runs 3] [--agreements 0.0,0.5,0.8,1.0] [--tokens 64]
        [--n-embd 768 --n-layer 24 --n-ff 2304]   (another shape: a held-out check)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_realshape import _wait, default_threads, llama_kw, pinned_cores, prompt_text  # noqa: E402

AGREEMENTS = (0.0, 0.5, 0.8, 1.0)
FIXED = ("no drafting", "k=1", "k=2", "k=3", "k=4")
AUTOS = ("auto, measured at load", "auto, saved curve")


def draft_max_of(name: str):
    return 0 if name == "no drafting" else int(name[2:]) if name.startswith("k=") else "auto"


def child(spec: dict) -> dict:
    """Load, one request (the first), its figures."""
    t0 = time.perf_counter()
    import llama_metaws  # noqa: F401
    from llama_metaws import Llama

    kw = llama_kw(spec["threads"])
    if spec["draft_max"]:
        kw.update(draft="mtp", draft_max=spec["draft_max"], phase_aware_workspace=True)
    with Llama(spec["model"], **kw) as llm:
        load_s = time.perf_counter() - t0
        stats = llm.engine_stats()
        prior, accepted_from = stats.get("cost_prior"), stats.get("acceptance_prior")
        out = llm.create_completion(spec["prompt"], max_tokens=spec["tokens"], temperature=0.0)
        t = llm.timings()
        st = llm.draft_stats.last if spec["draft_max"] else None
    return dict(decode_tps=t["decode_tokens_per_s"], text=out["choices"][0]["text"],
                tokens=out["usage"]["completion_tokens"], load_s=load_s,
                drafted=st.drafted if st else 0, accepted=st.accepted if st else 0,
                plain_share=t.get("plain_steps_share"), lengths=t.get("draft_lengths"),
                shadows=t.get("shadow_drafts", 0),
                acceptance_saved=bool(accepted_from),
                prior=None if prior is None else {k: prior[k] for k in ("source", "seconds", "wall_s", "load_s",
                                                                        "target_ms", "catch_up_ms", "draft_ms")})


def run_child(model: Path, name: str, a: argparse.Namespace, costs: str) -> dict:
    spec = dict(model=str(model), draft_max=draft_max_of(name), threads=a.threads, tokens=a.tokens,
                prompt=prompt_text(a.prompt_tokens))
    os.environ["LLAMA_METAWS_COSTS"] = costs  # the child inherits it (for a fixed k it is unused)
    rc, out, err, _ = _wait([sys.executable, __file__, "--child", json.dumps(spec)], a.timeout, a.cores)
    if rc != 0:
        raise RuntimeError(f"child {name} exited {rc}:\n{err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def shape_of(a: argparse.Namespace) -> dict:
    """The model shape: the bench shape (``BENCH_SHAPE``) with the sizes given on the command line."""
    from llama_metaws_dev.testing import BENCH_SHAPE

    return dict(BENCH_SHAPE, **{k: v for k, v in (("n_embd", getattr(a, "n_embd", None)),
                                                 ("n_layer", getattr(a, "n_layer", None)),
                                                 ("n_ff", getattr(a, "n_ff", None))) if v})


def measure(a: argparse.Namespace) -> dict:
    from llama_metaws_dev.testing import make_mtp_model

    models = {ag: make_mtp_model(agreement=ag, dtype=a.dtype, **shape_of(a)) for ag in a.agreements}
    results: Dict[float, Dict[str, List[dict]]] = {ag: {} for ag in a.agreements}
    names = list(FIXED) + [n for n in AUTOS if a.saved or n != "auto, saved curve"]
    with tempfile.TemporaryDirectory(prefix="bench-auto-") as tmp:
        saved = str(Path(tmp) / "saved")  # the curves every "saved curve" child shares
        for rep in range(a.runs):
            for ag in a.agreements:
                order = names if (rep + int(ag * 10)) % 2 == 0 else names[::-1]
                for name in order:
                    costs = saved if name == "auto, saved curve" else str(Path(tmp) / f"cold-{rep}-{ag}")
                    t0 = time.monotonic()
                    r = run_child(models[ag], name, a, costs)
                    results[ag].setdefault(name, []).append(r)
                    p = r["prior"]
                    extra = f", prior {p['source']} {p['seconds']:.2f} s" if p else ""
                    extra += ", saved acceptance" if r.get("acceptance_saved") else ""
                    extra += f", {r['shadows']} shadow draft(s)" if r.get("shadows") else ""
                    print(f"  [{rep + 1}/{a.runs}] a={ag} {name:<24} decode {r['decode_tps']:6.2f} t/s, "
                          f"lengths {r['lengths']}{extra} ({time.monotonic() - t0:.0f} s)", flush=True)
    return dict(results=results, models={ag: p.name for ag, p in models.items()})


def _med(xs):
    return statistics.median(xs) if xs else float("nan")


def table(m: dict, a: argparse.Namespace, label: str) -> str:
    res = m["results"]
    autos = tuple(n for n in AUTOS if any(n in cfgs for cfgs in res.values()))
    shape = shape_of(a)
    lines = [
        "## `draft_max=\"auto\"` from the first request of a fresh process (bench/bench_auto.py)",
        "",
        f"{label}. Models from `make_mtp_model` ({a.dtype}, qwen35, {shape['n_layer']} trunk layers of "
        f"width {shape['n_embd']}, n_ff {shape['n_ff']}, {shape['n_vocab']:,} tokens, one NextN block). Every configuration a child process of its own "
        f"that loads the model and runs one greedy request ({a.prompt_tokens}-token prompt, {a.tokens} "
        f"tokens), the first and only one (no warm-up), {a.threads} thread(s) pinned to core(s) "
        f"{','.join(map(str, a.cores))}; {a.runs} run(s), the configurations' order alternating. "
        "`auto, measured at load`: an empty cost folder, the prior measured at load; `auto, saved "
        "curve`: the run's own folder, a curve saved by its first child then checked at each load, "
        "and the acceptance the last child of the same model left (from the second run on). "
        "Decode t/s: the request's decode phase (medians over the runs).",
        "",
        "| agreement | " + " | ".join(FIXED + autos) + " |",
        "|---:|" + "---:|" * (len(FIXED) + len(autos)),
    ]
    for ag, cfgs in res.items():
        lines.append(f"| {ag} | " + " | ".join(f"{_med([r['decode_tps'] for r in cfgs.get(n, [])]):.2f}"
                                               for n in FIXED + autos) + " |")
    lines += ["", "Auto against the best of no drafting and k = 1..4 (goal >= 0.95): the ratio of the medians, "
              "then (in brackets) the median of each run's ratio to that run's best; plain steps; acceptance; "
              "the prior at load (its source in the runs, the engine's seconds, its wall time / the load's):", "",
              "| agreement | configuration | / best (>= 0.95) | best | plain steps | acceptance | prior | "
              "prior s | prior / load |", "|---:|---|---:|---|---:|---:|---|---:|---:|"]
    same = True
    for ag, cfgs in res.items():
        meds = {n: _med([r["decode_tps"] for r in cfgs.get(n, [])]) for n in FIXED}
        best = max(meds, key=meds.get)
        want = [r["text"] for r in cfgs.get("no drafting", [])]
        for n in FIXED + autos:
            same &= all(r["text"] == want[0] for r in cfgs.get(n, [])) if want else True
        for n in autos:
            runs = cfgs.get(n, [])
            if not runs:
                continue
            per_run = [r["decode_tps"] / max(cfgs[f][i]["decode_tps"] for f in FIXED) for i, r in enumerate(runs)]
            ratio = _med([r["decode_tps"] for r in runs]) / meds[best]
            drafted = sum(r["drafted"] for r in runs)
            acc = f"{sum(r['accepted'] for r in runs) / drafted:.3f}" if drafted else "-"
            sources = ", ".join(sorted({r["prior"]["source"] for r in runs if r["prior"]}))
            n_saved = sum(1 for r in runs if r.get("acceptance_saved"))
            sources += f"; saved acceptance {n_saved}/{len(runs)}" if n_saved else ""
            lines.append(f"| {ag} | {n} | {ratio:.2f} ({_med(per_run):.2f}) | {best} | "
                         f"{_med([r['plain_share'] for r in runs]):.2f} | {acc} | {sources} | "
                         f"{_med([r['prior']['seconds'] for r in runs]):.2f} | "
                         f"{_med([r['prior']['wall_s'] / r['prior']['load_s'] for r in runs]):.2f} |")
    lines += ["", f"Output check: every configuration's text equals no drafting's: {'yes' if same else 'NO'}."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--agreements", type=lambda v: tuple(float(x) for x in v.split(",")), default=AGREEMENTS,
                    help="comma-separated (0.0,0.5,0.8,1.0)")
    ap.add_argument("--runs", type=int, default=3, help="interleaved runs of every configuration (3)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request (64)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (128)")
    ap.add_argument("--threads", type=int, default=default_threads(),
                    help=f"threads, pinned to the last cores (every core but one: {default_threads()})")
    ap.add_argument("--dtype", default="q8_0", choices=("f16", "q8_0"), help="model matrices (q8_0)")
    ap.add_argument("--n-embd", type=int, help="trunk width (the bench shape's: 1024)")
    ap.add_argument("--n-layer", type=int, help="trunk layers (the bench shape's: 28)")
    ap.add_argument("--n-ff", type=int, help="feed-forward width (the bench shape's: 3072)")
    ap.add_argument("--no-saved", dest="saved", action="store_false",
                    help="leave out `auto, saved curve` (with one run it measures at load as the other does)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per child (600)")
    ap.add_argument("--label", default="", help="what this run measures (printed above the table)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--json", metavar="FILE", help="also write the run's measurements to FILE")
    ap.add_argument("--render", metavar="FILE", nargs="+",
                    help="no run: the table of runs saved with --json (several: their runs together)")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    if a.render:
        saved = [json.loads(Path(f).read_text()) for f in a.render]
        a = argparse.Namespace(**dict(vars(a), **{k: v for k, v in saved[0]["options"].items()
                                                  if k not in ("no_write", "render", "label")}))
        results: Dict[float, Dict[str, List[dict]]] = {}
        for doc in saved:
            for ag, cfgs in doc["measurements"]["results"].items():
                for name, runs in cfgs.items():
                    results.setdefault(float(ag), {}).setdefault(name, []).extend(runs)
        a.runs = min(len(runs) for cfgs in results.values() for runs in cfgs.values())
        label = a.label or "; ".join(d["label"] for d in saved)
        import _doc

        _doc.publish("bench_auto", table(dict(results=results), a, label), write=not a.no_write)
        return
    a.cores = pinned_cores(a.threads)
    t0 = time.monotonic()
    m = measure(a)
    label = (a.label or "Run") + f" ({time.monotonic() - t0:.0f} s)"
    if a.json:
        Path(a.json).write_text(json.dumps(dict(label=label, options={k: v for k, v in vars(a).items()
                                                                      if k not in ("child", "json")},
                                                measurements=m), indent=1, default=str))
    import _doc

    _doc.publish("bench_auto", table(m, a, label), write=not a.no_write)


if __name__ == "__main__":
    main()
