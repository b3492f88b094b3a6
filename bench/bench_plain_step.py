"""What a plain decode step costs on a target that could draft: no drafting, next to the same
target with rollback snapshots and next to ``draft_max="auto"`` where it never drafts.

A drafting engine's target keeps ``n_rs_seq`` rollback snapshots of its recurrent state (qwen35:
``n_rs_seq = draft_max``, 6 for ``"auto"``), so that a rejected draft can be undone. Where drafts
do not pay (agreement 0.0 here), ``"auto"`` decodes one token a step, as no drafting does, and
what is left between the two is the snapshots' cost, the draft context's and the policy's.
Configurations, each a child process of its own (load, one greedy request: the first):

* ``no drafting``: ``Llama(draft=None)``;
* ``snapshots, no drafting``: the same with the target's ``n_rs_seq`` at ``AUTO_DRAFT_MAX``
  (``llama_context_params.n_rs_seq``, set by its declared name);
* ``auto``: ``Llama(draft="mtp", draft_max="auto", phase_aware_workspace=True)``.

Prints decode t/s (medians over the runs) and each configuration's ratio to no drafting (the
median of each run's ratio). Run it on two builds (``patches/series`` with and without a patch)
to see what a patch saves.

    .venv/bin/python bench/bench_plain_step.py [--runs 5] [--agreement 0.0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_realshape import _wait, default_threads, llama_kw, pinned_cores, prompt_text  # noqa: E402

CONFIGS = ("no drafting", "snapshots, no drafting", "auto")


def child(spec: dict) -> dict:
    import llama_metaws  # noqa: F401
    import llama_cpp
    import llama_metaws.api.llama as _llama
    from llama_metaws import Llama
    from llama_metaws.engine.limits import AUTO_DRAFT_MAX

    kw = llama_kw(spec["threads"])
    if spec["name"] == "auto":
        kw.update(draft="mtp", draft_max="auto", phase_aware_workspace=True)
    if spec["name"] == "snapshots, no drafting":
        fields = _llama._contexts.context_fields

        def with_snapshots(**k):
            target, draft = fields(**k)
            return dict(target, n_rs_seq=AUTO_DRAFT_MAX), draft

        _llama._contexts.context_fields = with_snapshots
    with Llama(spec["model"], **kw) as llm:
        out = llm.create_completion(spec["prompt"], max_tokens=spec["tokens"], temperature=0.0)
        t = llm.timings()
        n_rs = int(llama_cpp.llama_n_rs_seq(llm._ctx.ctx))
    return dict(decode_tps=t["decode_tokens_per_s"], text=out["choices"][0]["text"], n_rs_seq=n_rs,
                lengths=t.get("draft_lengths"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs of every configuration (5)")
    ap.add_argument("--agreement", type=float, default=0.0, help="the MTP head's agreement (0.0: auto stays plain)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request (64)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (128)")
    ap.add_argument("--threads", type=int, default=default_threads(), help="threads, pinned to the last cores")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per child (600)")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    from llama_metaws_dev.testing import BENCH_SHAPE, make_mtp_model

    model = make_mtp_model(agreement=a.agreement, dtype="q8_0", **BENCH_SHAPE)
    cores = pinned_cores(a.threads)
    runs = {n: [] for n in CONFIGS}
    for rep in range(a.runs):
        for name in (CONFIGS if rep % 2 == 0 else CONFIGS[::-1]):
            spec = dict(model=str(model), name=name, threads=a.threads, tokens=a.tokens,
                        prompt=prompt_text(a.prompt_tokens))
            rc, out, err, _ = _wait([sys.executable, __file__, "--child", json.dumps(spec)], a.timeout, cores)
            if rc != 0:
                raise RuntimeError(f"child {name} exited {rc}:\n{err[-2000:]}")
            r = json.loads(out.strip().splitlines()[-1])
            runs[name].append(r)
            print(f"  [{rep + 1}/{a.runs}] {name:<24} decode {r['decode_tps']:6.2f} t/s, n_rs_seq {r['n_rs_seq']}, "
                  f"lengths {r['lengths']}", flush=True)
    base = runs["no drafting"]
    print(f"\n{model.name}, {a.runs} runs, {a.threads} thread(s) pinned to core(s) {','.join(map(str, cores))}\n")
    print("| configuration | target n_rs_seq | decode t/s | / no drafting (per-run median) | text = no drafting's |")
    print("|---|---:|---:|---:|---|")
    for name in CONFIGS:
        rs = runs[name]
        ratio = statistics.median(r["decode_tps"] / b["decode_tps"] for r, b in zip(rs, base))
        same = all(r["text"] == base[0]["text"] for r in rs)
        print(f"| {name} | {rs[0]['n_rs_seq']} | {statistics.median(r['decode_tps'] for r in rs):.2f} | "
              f"{ratio:.3f} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
