"""Real-shape speed: the plugin's MTP drafting next to llama.cpp's own draft-mtp, at Qwen's vocabulary.

One run, interleaved, side by side, on models from ``llama_metaws_dev.testing.make_mtp_model`` (the
default bench shape: qwen35, 28 trunk layers of width 1024, n_ff 3072, 151,936 tokens, one NextN
block; cached by its arguments) at several agreement rates:

* ``plugin, no drafting``: ``llama_metaws.Llama`` without a draft;
* ``plugin MTP``: ``Llama(draft="mtp", draft_max=k, phase_aware_workspace=True)``;
* ``llama.cpp draft-mtp``: ``llama-speculative-simple --spec-type draft-mtp --spec-draft-n-max k``;
* ``llama-bench``: llama.cpp's own prompt (pp) and decode (tg) speed, no drafting;
* ``plugin MTP auto``: ``Llama(draft="mtp", draft_max="auto")``, the adaptive draft length
  (``--no-auto`` leaves it out).

Every configuration runs in a child process of its own (the plugin's through this script's
``--child``), so its peak RSS (``getrusage`` of that child) is its own. The prompt goal (prompt
tokens/s with drafting against without) is measured apart, paired: one child per draft length
and run holds a drafting and a plain ``Llama`` over the same model and alternates prompts between
them (``--prompt-pairs`` of each; a prompt's cost does not depend on the agreement rate, so this
runs on the first agreement's model), since one prompt per process moves by 10-15% on this
machine. The acceptance goal takes llama.cpp's steps begun within ``-n``, from one more, untimed
``llama-speculative-simple`` run per agreement and k at ``-lv 5`` (its per-step log): it stops only
once past ``-n`` and drafts a full k on a step with no budget left, which the plugin never takes
and its printed counts include. The tools come from
``llama-metaws build --tools`` (built here when missing). Greedy decoding throughout. Reports decode
and prompt tokens/s, draft acceptance and peak RSS, the issue's goals as ratios, writes its table
into bench/BENCHMARKS.md and a plot (decode t/s against agreement) to bench/realshape.png.

    .venv/bin/python bench/bench_realshape.py [--quick] [--threads 2] [--dtype q8_0]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _serve  # noqa: E402

AGREEMENTS = (0.0, 0.5, 0.8, 1.0)
DRAFT_MAX = (1, 2, 3, 4)
QUICK_AGREEMENTS = (0.0, 0.8)
QUICK_DRAFT_MAX = (3,)
PLOT = HERE / "realshape.png"

# a prompt of about PROMPT_TOKENS tokens: the TEST tokenizer makes one token of every 5 bytes
PROMPT_TOKENS = 256
N_CTX = 1024
N_BATCH = 512


def prompt_text(n_tokens: int) -> str:
    words = "speculative decoding with the model's own multi token prediction head "
    return (words * (5 * n_tokens // len(words) + 1))[: 5 * n_tokens]


# --------------------------------------------------------------------------------------------
# the plugin, in a child process


def llama_kw(threads: int) -> dict:
    """The ``Llama`` options every plugin child shares (llama.cpp's tools get the same by flag)."""
    return dict(n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH, n_threads=threads,
                n_threads_batch=threads, verbose=False)


def child(spec: dict) -> dict:
    """One plugin configuration: load, one warm-up request, one measured request, then
    ``prompt_repeats - 1`` more prompts of the same length (one token generated) for the
    prompt figure, the median of them all (each evaluated whole: no prefix shared)."""
    import llama_metaws  # noqa: F401
    from llama_metaws import Llama

    kw = llama_kw(spec["threads"])
    if spec["draft_max"]:
        kw.update(draft="mtp", draft_max=spec["draft_max"], phase_aware_workspace=True)
    with Llama(spec["model"], **kw) as llm:
        # a warm-up request sharing no prefix with the measured one: that one evaluates its whole
        # prompt (with drafting, prompt reuse would otherwise restore the warm-up's checkpoint)
        llm.create_completion("warm-up " + spec["prompt"][:32], max_tokens=4, temperature=0.0)
        out = llm.create_completion(spec["prompt"], max_tokens=spec["tokens"], temperature=0.0)
        t = llm.timings()
        st = llm.draft_stats.last if spec["draft_max"] else None
        assert t["cache_n"] == 0, t  # the whole prompt evaluated
        res = dict(decode_tps=t["decode_tokens_per_s"], prompt_tokens=t["prompt_tokens"],
                   tokens=out["usage"]["completion_tokens"], text=out["choices"][0]["text"],
                   drafted=st.drafted if st else 0, accepted=st.accepted if st else 0,
                   plain_share=t.get("plain_steps_share"), lengths=t.get("draft_lengths"))
        prompts, ttfts = [t["prompt_tokens_per_s"]], [t["ttft_ms"]]
        for i in range(1, spec["prompt_repeats"]):
            head = f"again {i} "  # the measured prompt's length, a prefix of its own
            llm.create_completion(head + spec["prompt"][len(head):], max_tokens=1, temperature=0.0)
            t = llm.timings()
            assert t["cache_n"] == 0 and t["prompt_tokens"] == res["prompt_tokens"], t
            prompts.append(t["prompt_tokens_per_s"])
            ttfts.append(t["ttft_ms"])
        res.update(prompt_tps=statistics.median(prompts), ttft_ms=statistics.median(ttfts))
    res["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res


def pair_child(spec: dict) -> dict:
    """The prompt goal, paired: a plain and a drafting ``Llama`` in one process, each with one
    warm-up, then ``pairs`` prompts of the measured length on each, alternating which goes first
    (each evaluated whole: no prefix shared); the ratios of their prompt tokens/s, pair by pair."""
    from llama_metaws import Llama

    kw = llama_kw(spec["threads"])
    prompt = spec["prompt"]
    with Llama(spec["model"], **kw) as plain, \
            Llama(spec["model"], draft="mtp", draft_max=spec["draft_max"], phase_aware_workspace=True, **kw) as mtp:
        for llm in (plain, mtp):
            llm.create_completion("warm-up " + prompt[:32], max_tokens=4, temperature=0.0)
        ratios = []
        for i in range(spec["pairs"]):
            head = f"pair {i} "
            tps = {}
            for llm in (plain, mtp) if i % 2 == 0 else (mtp, plain):
                llm.create_completion(head + prompt[len(head):], max_tokens=1, temperature=0.0)
                t = llm.timings()
                assert t["cache_n"] == 0, t
                tps[llm is mtp] = t["prompt_tokens_per_s"]
            ratios.append(tps[True] / tps[False])
    return dict(ratios=ratios)


def default_threads() -> int:
    """Every core but one (1 on this 2-core machine): a core left to the rest of the machine
    keeps a busy neighbour from stalling the configurations' thread barriers."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def pinned_cores(threads: int) -> List[int]:
    """The cores every configuration is pinned to: the last ``threads`` this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[-threads:] if threads < len(cores) else cores


def _wait(cmd: List[str], timeout: float, cores: Optional[List[int]] = None) -> Tuple[int, str, str, int]:
    """Run a child (pinned to ``cores``); (exit status, stdout, stderr, its peak RSS in bytes from wait4)."""
    import tempfile

    pin = None if not cores else (lambda: os.sched_setaffinity(0, cores))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, preexec_fn=pin)
        t0 = time.monotonic()
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - t0 > timeout:
                proc.kill()
                pid, status, ru = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"), \
            ru.ru_maxrss * 1024


def run_plugin(model: Path, draft_max, a: argparse.Namespace) -> dict:
    spec = dict(model=str(model), draft_max=draft_max, threads=a.threads, tokens=a.tokens,
                prompt=prompt_text(a.prompt_tokens), prompt_repeats=a.prompt_repeats)
    rc, out, err, rss = _wait([sys.executable, __file__, "--child", json.dumps(spec)], a.timeout, a.cores)
    if rc != 0:
        raise RuntimeError(f"plugin child (draft_max={draft_max}) exited {rc}:\n{err[-2000:]}")
    res = json.loads(out.strip().splitlines()[-1])
    res["peak_rss"] = max(res["peak_rss"], rss)
    return res


def run_pairs(model: Path, draft_max: int, a: argparse.Namespace) -> dict:
    spec = dict(model=str(model), draft_max=draft_max, threads=a.threads, prompt=prompt_text(a.prompt_tokens),
                pairs=a.prompt_pairs)
    rc, out, err, _ = _wait([sys.executable, __file__, "--pair-child", json.dumps(spec)], a.timeout, a.cores)
    if rc != 0:
        raise RuntimeError(f"prompt pair child (draft_max={draft_max}) exited {rc}:\n{err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# llama.cpp's tools


def run_speculative(tool: Path, model: Path, draft_max: int, a: argparse.Namespace, steps: bool = False) -> dict:
    """One llama-speculative-simple run; with ``steps``, at log verbosity 5 (debug), its steps as
    (accepted, drafted) pairs from its per-step ``accepted A/D draft tokens`` lines (not timed)."""
    cmd = [str(tool), "-m", str(model), "-p", prompt_text(a.prompt_tokens), "-n", str(a.tokens),
           "-c", str(N_CTX), "-b", str(N_BATCH), "-ub", str(N_BATCH), "-t", str(a.threads),
           "-tb", str(a.threads), "-td", str(a.threads), "--spec-type", "draft-mtp",
           "--spec-draft-n-max", str(draft_max), "--temp", "0", "--seed", "0", "-ngl", "0"]
    if steps:
        cmd += ["-lv", "5"]
    rc, out, err, rss = _wait(cmd, a.timeout, a.cores)
    text = out + err
    if rc != 0:
        raise RuntimeError(f"llama-speculative-simple exited {rc}:\n{text[-3000:]}")

    def grab(pat: str) -> float:
        m = re.search(pat, text)
        if not m:
            raise RuntimeError(f"llama-speculative-simple: no {pat!r} in its output:\n{text[-3000:]}")
        return float(m.group(1))

    res = dict(prompt_tps=grab(r"encoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s"),
               decode_tps=grab(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s"),
               drafted=int(grab(r"n_drafted\s*=\s*(\d+)")), accepted=int(grab(r"n_accept\s*=\s*(\d+)")),
               tokens=int(grab(r"n_predict\s*=\s*(\d+)")), peak_rss=rss)
    if steps:
        res["steps"] = [(int(x), int(y)) for x, y in re.findall(r"accepted (\d+)/(\d+) draft tokens", text)]
        if sum(x + 1 for x, _ in res["steps"]) != res["tokens"]:
            raise RuntimeError(f"llama-speculative-simple: its steps do not add up to n_predict:\n{text[-3000:]}")
    return res


def within_budget(steps: List[Tuple[int, int]], tokens: int) -> Tuple[int, int]:
    """(drafted, accepted) over the steps llama-speculative-simple began with budget left, the
    steps the plugin takes for ``tokens`` tokens: a step that begins with ``n`` tokens made drafts
    at most ``tokens - n - 1``, and at 0 or below (it stops only once past ``tokens``) a full k,
    which the plugin, stopping at ``tokens``, never drafts."""
    n = drafted = accepted = 0
    for acc, dr in steps:
        if tokens - n - 1 > 0:
            drafted, accepted = drafted + dr, accepted + acc
        n += acc + 1
    return drafted, accepted


def run_llama_bench(tool: Path, model: Path, a: argparse.Namespace) -> dict:
    cmd = [str(tool), "-m", str(model), "-p", str(a.prompt_tokens), "-n", str(a.tokens),
           "-b", str(N_BATCH), "-ub", str(N_BATCH), "-t", str(a.threads), "-r", str(a.bench_reps),
           "-ngl", "0", "-o", "json"]
    rc, out, err, rss = _wait(cmd, a.timeout, a.cores)
    if rc != 0:
        raise RuntimeError(f"llama-bench exited {rc}:\n{(out + err)[-3000:]}")
    rows = json.loads(out)
    pp = [r["avg_ts"] for r in rows if r.get("n_prompt") and not r.get("n_gen")]
    tg = [r["avg_ts"] for r in rows if r.get("n_gen") and not r.get("n_prompt")]
    return dict(prompt_tps=pp[0], decode_tps=tg[0], peak_rss=rss)


# --------------------------------------------------------------------------------------------
# the run


def _med(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def measure(a: argparse.Namespace) -> dict:
    from llama_metaws_dev.testing import BENCH_SHAPE, make_mtp_model

    tools = _serve.llama_tools()
    shape = dict(BENCH_SHAPE, n_vocab=a.n_vocab, n_embd=a.n_embd, n_layer=a.n_layer, n_ff=a.n_ff)
    models = {}
    for ag in a.agreements:
        t0 = time.monotonic()
        models[ag] = make_mtp_model(agreement=ag, dtype=a.dtype, seed=a.seed, **shape)
        print(f"model agreement {ag}: {models[ag].name} ({models[ag].stat().st_size / 2**20:.0f} MiB, "
              f"{time.monotonic() - t0:.1f} s)", flush=True)

    # results[agreement][config] = list of runs
    results: Dict[float, Dict[str, List[dict]]] = {ag: {} for ag in a.agreements}
    pairs: Dict[int, List[float]] = {}  # draft_max -> prompt ratios, pair by pair
    for rep in range(a.runs):
        for ag in a.agreements:
            jobs = [("no drafting", lambda ag=ag: run_plugin(models[ag], 0, a)),
                    ("llama-bench", lambda ag=ag: run_llama_bench(tools["llama-bench"], models[ag], a))]
            for k in a.draft_max:
                pair = [(f"plugin MTP k={k}", lambda ag=ag, k=k: run_plugin(models[ag], k, a)),
                        (f"llama.cpp k={k}", lambda ag=ag, k=k: run_speculative(
                            tools["llama-speculative-simple"], models[ag], k, a))]
                jobs += pair if (rep + k) % 2 == 0 else pair[::-1]
            if a.auto:
                jobs.append(("plugin MTP auto", lambda ag=ag: run_plugin(models[ag], "auto", a)))
            if rep % 2:
                jobs = jobs[::-1]
            for name, job in jobs:
                t0 = time.monotonic()
                r = job()
                results[ag].setdefault(name, []).append(r)
                acc = f", accept {r['accepted'] / r['drafted']:.3f}" if r.get("drafted") else ""
                print(f"  [{rep + 1}/{a.runs}] a={ag} {name:<18} decode {r['decode_tps']:7.2f} t/s, "
                      f"prompt {r['prompt_tps']:8.1f} t/s{acc}, rss {r['peak_rss'] / 2**20:.0f} MiB "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)
        for k in a.draft_max if a.prompt_pairs else ():
            t0 = time.monotonic()
            r = run_pairs(models[a.agreements[0]], k, a)["ratios"]
            pairs.setdefault(k, []).extend(r)
            print(f"  [{rep + 1}/{a.runs}] prompt pairs k={k}: with / without drafting "
                  f"{', '.join(f'{x:.2f}' for x in r)} ({time.monotonic() - t0:.0f} s)", flush=True)
    # llama.cpp's acceptance over the steps the plugin takes: one more run of each (agreement, k),
    # untimed, with its per-step log (greedy: the steps of every timed run)
    steps: Dict[float, Dict[int, List[Tuple[int, int]]]] = {ag: {} for ag in a.agreements}
    for ag in a.agreements:
        for k in a.draft_max:
            r = run_speculative(tools["llama-speculative-simple"], models[ag], k, a, steps=True)
            steps[ag][k] = r["steps"]
            d, acc = within_budget(r["steps"], a.tokens)
            print(f"  steps a={ag} llama.cpp k={k}: {len(r['steps'])} steps, accepted {acc}/{d} "
                  f"within -n {a.tokens} ({r['accepted']}/{r['drafted']} in all)", flush=True)
    return dict(shape=shape, results=results, pairs=pairs, steps=steps,
                models={ag: str(p.name) for ag, p in models.items()})


def summarize(m: dict) -> Tuple[dict, List[str]]:
    """Medians per (agreement, config), and the identity check (MTP text == no-drafting text)."""
    s: dict = {}
    notes = []
    for ag, cfgs in m["results"].items():
        s[ag] = {}
        ref = cfgs.get("no drafting", [{}])[0].get("text")
        for name, runs in cfgs.items():
            drafted = sum(r.get("drafted", 0) for r in runs)
            s[ag][name] = dict(decode=_med([r["decode_tps"] for r in runs]),
                               decode_lo=min(r["decode_tps"] for r in runs),
                               decode_hi=max(r["decode_tps"] for r in runs),
                               prompt=_med([r["prompt_tps"] for r in runs]),
                               ttft=_med([r["ttft_ms"] for r in runs if "ttft_ms" in r]),
                               accept=(sum(r.get("accepted", 0) for r in runs) / drafted) if drafted else None,
                               rss=max(r["peak_rss"] for r in runs))
            if name.startswith("plugin MTP") and ref is not None:
                if any(r.get("text") != ref for r in runs):
                    notes.append(f"agreement {ag}, {name}: output differs from no drafting")
    return s, notes


def paired(m: dict, ag: float, f) -> float:
    """The median over the runs of ``f(run)``, ``run`` mapping each configuration to its result
    in that run: a ratio of configurations measured side by side, minutes apart at most."""
    cfgs = m["results"][ag]
    n = min(len(v) for v in cfgs.values())
    return _med([f({name: v[i] for name, v in cfgs.items()}) for i in range(n)])


def _f(x: Optional[float], fmt: str) -> str:
    return "-" if x is None or x != x else format(x, fmt)


def table(m: dict, a: argparse.Namespace, label: str) -> str:
    s, notes = summarize(m)
    shape = m["shape"]
    lines = [
        "## Real-shape speed: the plugin's MTP drafting vs llama.cpp's draft-mtp (bench_realshape.py)",
        "",
        f"{label}. Models from `make_mtp_model` ({a.dtype}): qwen35, {shape['n_layer']} trunk layers of "
        f"width {shape['n_embd']}, n_ff {shape['n_ff']}, {shape['n_vocab']:,} tokens, one NextN block, "
        f"the MTP head agreeing with the target at the given rate. Prompt {a.prompt_tokens} tokens, "
        f"{a.tokens} generated, greedy, {a.threads} thread(s), n_ctx {N_CTX}, n_batch/n_ubatch "
        f"{N_BATCH}; each configuration in its own process, the configurations interleaved, "
        f"{a.runs} run(s) each (medians; the decode range is the runs' lowest and highest; a plugin "
        f"child's prompt figure is the median of {a.prompt_repeats} prompts of that length), every "
        f"child pinned to core(s) {','.join(map(str, a.cores))}. `plugin MTP` is `Llama(draft=\"mtp\", "
        f"draft_max=k, phase_aware_workspace=True)`; `llama.cpp` is `llama-speculative-simple "
        f"--spec-type draft-mtp --spec-draft-n-max k`; `llama-bench` is pp{a.prompt_tokens}/tg{a.tokens}. "
        f"With drafting both loops hold the prompt's last token back and decode it with the first "
        f"draft, and both report llama-speculative-simple's phases: the prompt figure is its "
        f"`encoded` line (the prompt but its last token, on the target and the draft context; "
        f"llama.cpp divides all {a.prompt_tokens} tokens by that time, the plugin the tokens "
        f"decoded in it), the decode figure every token over the steps after it. Without drafting "
        f"the prompt phase ends with the first token, as in llama-bench's pp. "
        f"Peak RSS is the child's (file-backed model pages included). Acceptance is not the "
        f"agreement rate: the head's agreeing positions follow a regular pattern along the cycle, "
        f"and a drafting loop's steps can fall in phase with it (k=1 at agreement 0.5 drafts "
        f"mostly agreeing positions); both loops start alike (the prompt's last token held back, "
        f"the first draft made from it), so they visit the same positions.",
        "",
        "| agreement | configuration | decode t/s | decode range | prompt t/s | acceptance | peak RSS MiB |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for ag, cfgs in s.items():
        for name, r in cfgs.items():
            lines.append(f"| {ag:.1f} | {name} | {_f(r['decode'], '.2f')} | {_f(r['decode_lo'], '.2f')}-"
                         f"{_f(r['decode_hi'], '.2f')} | {_f(r['prompt'], '.1f')} | "
                         f"{_f(r['accept'], '.3f')} | {r['rss'] / 2**20:.0f} |")
    paired_prompt = bool(m.get("pairs"))
    budget = bool(m.get("steps"))  # llama.cpp's acceptance over the plugin's steps (older runs: its printed counts)
    prompt_head = ("prompt with / without drafting, separate processes" if paired_prompt
                   else "prompt with / without drafting (>= 0.9)")
    lines += ["", "Goals (ratios: the median over the runs of each run's ratio, its configurations "
              "measured side by side; time to first token is not a goal, shown for what it costs):", "",
              "| agreement | k | MTP decode / llama.cpp's (>= 0.95) | speed-up / llama.cpp's speed-up "
              f"(>= 0.95) | {prompt_head} | acceptance - llama.cpp's"
              + (f" within `-n {a.tokens}`" if budget else "")
              + " (within 2 points) | time to first token with / without |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    verdict = {"decode": True, "speedup": True, "prompt": True, "accept": True}
    over, missed = {}, []  # llama.cpp past its budget: (agreement, k) -> tokens; acceptance missed
    for ag, cfgs in s.items():
        for k in a.draft_max:
            pk, ck = f"plugin MTP k={k}", f"llama.cpp k={k}"
            p, c = cfgs[pk], cfgs[ck]
            r_dec = paired(m, ag, lambda r: r[pk]["decode_tps"] / r[ck]["decode_tps"])
            r_sp = paired(m, ag, lambda r: (r[pk]["decode_tps"] / r["no drafting"]["decode_tps"])
                          / (r[ck]["decode_tps"] / r["llama-bench"]["decode_tps"]))
            r_pr = paired(m, ag, lambda r: r[pk]["prompt_tps"] / r["no drafting"]["prompt_tps"])
            r_ttft = paired(m, ag, lambda r: r[pk].get("ttft_ms", float("nan"))
                            / r["no drafting"].get("ttft_ms", float("nan")))
            d_acc = d_printed = 100 * ((p["accept"] or 0) - (c["accept"] or 0))
            st = m.get("steps", {}).get(ag, {}).get(k)
            if st is not None:
                d, acc = within_budget(st, a.tokens)
                d_acc = 100 * ((p["accept"] or 0) - (acc / d if d else 0))
                whole = (sum(x for _, x in st), sum(x for x, _ in st))
                if any((r["drafted"], r["accepted"]) != whole for r in m["results"][ag][ck]):
                    notes.append(f"agreement {ag}, {ck}: its per-step run drafted/accepted {whole[0]}/{whole[1]}, "
                                 "not what its timed runs printed")
            verdict["decode"] &= r_dec >= 0.95
            verdict["speedup"] &= r_sp >= 0.95
            if not paired_prompt:
                verdict["prompt"] &= r_pr >= 0.9
            verdict["accept"] &= abs(d_acc) <= 2
            made = max(r.get("tokens", 0) for r in m["results"][ag][ck])
            mark = ""
            if made > a.tokens:
                over[(ag, k)], mark = made, " †"
            if abs(d_acc) > 2:
                missed.append((ag, k))
            if st is not None and mark:
                mark = f" ({d_printed:+.1f}{mark})"
            lines.append(f"| {ag:.1f} | {k} | {r_dec:.2f} | {r_sp:.2f} | {r_pr:.2f} | {d_acc:+.1f}{mark} | "
                         f"{_f(r_ttft, '.2f')} |")
    if over:
        lines += ["", "† llama-speculative-simple generated more than its `-n " + str(a.tokens) + "` ("
                  + ", ".join(f"{n} at {ag:.1f}/k={k}" for (ag, k), n in over.items())
                  + "): it stops only once past `-n`, and a step with no budget left (`n_predict - n - 1` "
                  "at 0 or below) drafts a full k (its draft wrapper truncates only a positive `n_max`); "
                  "its counts include those steps, the plugin's cover the " + str(a.tokens)
                  + " tokens asked for."
                  + (" The acceptance goal compares the plugin with llama.cpp's steps begun with budget left, "
                     "read from one more, untimed run of each (its per-step `accepted A/D draft tokens` "
                     "lines at `-lv 5`); in brackets, against its printed counts." if budget else "")]
    if paired_prompt:
        lines += ["", f"The prompt goal, paired: prompt tokens/s with drafting against without, a drafting and a "
                  f"plain `Llama` in one process, {a.prompt_tokens}-token prompts alternating between them "
                  f"({a.prompt_pairs} of each per run, in every run; the median and range of the ratios, pair by pair):", "",
                  "| k | prompt with / without drafting (>= 0.9) | range | pairs |", "|---:|---:|---:|---:|"]
        for k, r in sorted(m["pairs"].items()):
            verdict["prompt"] &= _med(r) >= 0.9
            lines.append(f"| {k} | {_med(r):.2f} | {min(r):.2f}-{max(r):.2f} | {len(r)} |")
    accept = "yes" if verdict["accept"] else "no" + (
        " (only where llama.cpp ran past its budget, †)" if not budget and all(c in over for c in missed) else "")
    lines += ["", "Met at every agreement and k: " + ", ".join(
        f"{name} {'yes' if ok else 'no'}" for name, ok in
        (("decode", verdict["decode"]), ("speed-up", verdict["speedup"]),
         ("prompt", verdict["prompt"]))) + f", acceptance {accept}."]
    if a.auto:
        lines += ["", "`draft_max=\"auto\"` (each step's length chosen from acceptance and measured costs), "
                  "decode t/s against the best of not drafting and the plugin's fixed k (issue 29: >= 0.95), "
                  "llama.cpp's best fixed k and not drafting (the moonshot: >= 1 for both), each the median "
                  "over the runs of that run's ratio; plain steps: the share of decode steps that drafted "
                  "nothing:", "",
                  "| agreement | auto t/s | / best of none and plugin k (>= 0.95) | best of those | "
                  "/ llama.cpp's best k | / no drafting | plain steps | acceptance |",
                  "|---:|---:|---:|---|---:|---:|---:|---:|"]
        ours = ["no drafting"] + [f"plugin MTP k={k}" for k in a.draft_max]
        theirs = [f"llama.cpp k={k}" for k in a.draft_max]
        for ag, cfgs in s.items():
            auto = cfgs["plugin MTP auto"]
            best_name = max(ours, key=lambda n: cfgs[n]["decode"])
            r_best = paired(m, ag, lambda r: r["plugin MTP auto"]["decode_tps"] / max(r[n]["decode_tps"] for n in ours))
            r_cpp = paired(m, ag, lambda r: r["plugin MTP auto"]["decode_tps"] / max(r[n]["decode_tps"] for n in theirs))
            r_none = paired(m, ag, lambda r: r["plugin MTP auto"]["decode_tps"] / r["no drafting"]["decode_tps"])
            plain = [r["plain_share"] for r in m["results"][ag]["plugin MTP auto"] if r.get("plain_share") is not None]
            lines.append(f"| {ag:.1f} | {auto['decode']:.2f} | {r_best:.2f} | {best_name} | {r_cpp:.2f} | "
                         f"{r_none:.2f} | {_f(statistics.mean(plain) if plain else None, '.2f')} | "
                         f"{_f(auto['accept'], '.3f')} |")
    nb = {ag: cfgs["no drafting"] for ag, cfgs in s.items()}
    lb = {ag: cfgs["llama-bench"] for ag, cfgs in s.items()}
    lines += ["", "Without drafting, plugin vs llama-bench: decode " + ", ".join(
        f"{nb[ag]['decode'] / lb[ag]['decode']:.2f}" for ag in s) + "; prompt " + ", ".join(
        f"{nb[ag]['prompt'] / lb[ag]['prompt']:.2f}" for ag in s) + " (per agreement)."]
    if notes:
        lines += ["", "Output checks: " + "; ".join(notes) + "."]
    else:
        lines += ["", "Output check: the plugin's MTP text equals its no-drafting text in every run."]
    lines += ["", f"![decode t/s against agreement]({PLOT.name})"]
    return "\n".join(lines)


def plot(m: dict, a: argparse.Namespace, label: str) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    s, _ = summarize(m)
    ags = sorted(s)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, k in enumerate(a.draft_max):
        ax.plot(ags, [s[g][f"plugin MTP k={k}"]["decode"] for g in ags], "o-", color=f"C{i}",
                label=f"plugin MTP, k={k}")
        ax.plot(ags, [s[g][f"llama.cpp k={k}"]["decode"] for g in ags], "s--", color=f"C{i}",
                label=f"llama.cpp draft-mtp, k={k}")
    if a.auto:
        ax.plot(ags, [s[g]["plugin MTP auto"]["decode"] for g in ags], "D-", color="black",
                label="plugin MTP, draft_max=auto")
    ax.plot(ags, [s[g]["no drafting"]["decode"] for g in ags], "k:", label="plugin, no drafting")
    ax.plot(ags, [s[g]["llama-bench"]["decode"] for g in ags], color="grey", ls="-.", label="llama-bench tg")
    ax.set_xlabel("MTP head agreement with the target")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"qwen35 {m['shape']['n_layer']}x{m['shape']['n_embd']}, {m['shape']['n_vocab']:,} tokens, "
                 f"{a.dtype}, {a.threads} thread(s): plugin (solid) vs llama.cpp (dashed)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    return PLOT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--pair-child", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true",
                    help=f"agreements {QUICK_AGREEMENTS}, draft_max {QUICK_DRAFT_MAX}, 32 tokens: a few minutes")
    ap.add_argument("--agreements", type=lambda v: tuple(float(x) for x in v.split(",")),
                    help=f"comma-separated (default {','.join(map(str, AGREEMENTS))})")
    ap.add_argument("--draft-max", type=lambda v: tuple(int(x) for x in v.split(",")),
                    help=f"comma-separated (default {','.join(map(str, DRAFT_MAX))})")
    ap.add_argument("--runs", type=int, default=5, help="interleaved runs of every configuration, medians (5; --quick 1)")
    ap.add_argument("--tokens", type=int, help="tokens generated per request (64; --quick 32)")
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help=f"prompt length ({PROMPT_TOKENS})")
    ap.add_argument("--prompt-repeats", type=int, default=1,
                    help="prompts per plugin child for its prompt figure, the median (1)")
    ap.add_argument("--prompt-pairs", type=int, default=2,
                    help="prompts of each kind per run and draft length for the paired prompt goal (2; 0: none)")
    ap.add_argument("--threads", type=int, default=default_threads(),
                    help=f"threads for every configuration, each pinned to the last cores (every core but one: {default_threads()})")
    ap.add_argument("--dtype", default="q8_0", choices=("f16", "q8_0"), help="model matrices (q8_0)")
    ap.add_argument("--n-vocab", type=int, default=151936)
    ap.add_argument("--n-embd", type=int, default=1024)
    ap.add_argument("--n-layer", type=int, default=28)
    ap.add_argument("--n-ff", type=int, default=3072)
    ap.add_argument("--seed", type=int, default=0, help="model seed (0)")
    ap.add_argument("--bench-reps", type=int, default=2, help="llama-bench -r (2)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration (900)")
    ap.add_argument("--label", default="", help="what this run measures (printed above the table)")
    ap.add_argument("--no-auto", dest="auto", action="store_false",
                    help="leave out the adaptive draft length (draft_max=\"auto\")")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--json", metavar="FILE", help="also write the run's measurements and options to FILE")
    ap.add_argument("--render", metavar="FILE", help="no run: the table (and plot) of a run saved with --json")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    if a.pair_child:
        print(json.dumps(pair_child(json.loads(a.pair_child))))
        return
    if a.render:
        saved = json.loads(Path(a.render).read_text())
        a = argparse.Namespace(**dict(vars(a), **saved["options"]))
        saved_m = saved["measurements"]
        m = dict(saved_m, results={float(ag): cfgs for ag, cfgs in saved_m["results"].items()},
                 pairs={int(k): r for k, r in saved_m.get("pairs", {}).items()},
                 steps={float(ag): {int(k): st for k, st in ks.items()} for ag, ks in saved_m.get("steps", {}).items()})
        _publish(m, a, saved["label"])
        return
    a.agreements = a.agreements or (QUICK_AGREEMENTS if a.quick else AGREEMENTS)
    a.draft_max = a.draft_max or (QUICK_DRAFT_MAX if a.quick else DRAFT_MAX)
    a.tokens = a.tokens or (32 if a.quick else 64)
    if a.quick and "--runs" not in sys.argv:
        a.runs = 1
    a.cores = pinned_cores(a.threads)
    t0 = time.monotonic()
    m = measure(a)
    label = a.label or ("Quick run" if a.quick else "Full run")
    label += f" ({time.monotonic() - t0:.0f} s)"
    if a.json:
        options = {k: v for k, v in vars(a).items() if k not in ("child", "pair_child", "json", "render", "no_write")}
        Path(a.json).write_text(json.dumps(dict(label=label, options=options, measurements=m), indent=1))
    _publish(m, a, label)


def _publish(m: dict, a: argparse.Namespace, label: str) -> None:
    import _doc

    _doc.publish("bench_realshape", table(m, a, label), write=not a.no_write)
    if not a.no_write and plot(m, a, label) is not None:
        print(f"plot: {PLOT}")


if __name__ == "__main__":
    main()
