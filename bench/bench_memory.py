"""Compute memory side by side with llama-server: ggml's own accounting against llama-server's log.

Issue 25 item 4. On the real-shape bench model (``llama_metaws_dev.testing.make_mtp_model`` defaults,
agreement 0.8, q8_0; cached after the first make), MTP drafting with k = 3, ``-ub 512 -b 512
-c 4096``, flash attention on, for ``N`` sequences (``-np N``; N = 1, 2, 4):

* ``llama-server``: built from the same patched tree (``llama-metaws build --tools``), run with
  ``-np N -ub 512 -b 512 -c 4096 -fa on --spec-type draft-mtp --spec-draft-n-max 3 -lv 4``; its
  target and draft compute buffers are parsed from its own log (``sched_reserve: CPU compute
  buffer size = X MiB``, two decimals; a context is the draft when it follows ``creating MTP draft
  context``), with each context's ``n_outputs_max`` as it logs it. Read at load and again after the
  first request (a re-reservation would log again);
* ``Llama, private``: ``llama_metaws.Llama(path, draft="mtp", draft_max=3, n_seq_max=N, n_ctx=4096,
  n_ubatch=512, n_batch=512, flash_attn=True, phase_aware_workspace=False)`` in a child process; held
  compute read exactly from ggml's accounting (``llama_metaws.engine.buffers.compute_buffers`` of the
  target and the draft context) after load and after the first request;
* ``Llama, workspace``: the same with ``phase_aware_workspace=True``; held compute is the
  workspace's (``Llama.workspace_stats()``: a shared buffer counted once), the target's and the
  draft's requirements its owner and borrower needs;
* ``serve, workspace``: ``llama-metaws serve`` with the same flags and ``--phase-aware-workspace
  --metrics``; held compute from its ``llamametaws:workspace_bytes`` gauges (ggml's accounting,
  through the server) before and after the first request.

The plugin's children run with llama.cpp's log on, and the same parser reads it: it gives each
context's ``n_outputs_max``, and the output check sets the logged compute of the private contexts
beside ggml's accounting. Ratios are ours / llama-server's
(target + draft compute). Memory does not depend on timing, so each configuration runs once; it
measures whatever the checkout holds (the ``n_outputs_max`` the plugin's contexts were given is
shown: 0 means llama.cpp's default, n_batch rows).

    .venv/bin/python bench/bench_memory.py [--quick] [--np 1,2,4] [--json FILE] [--render FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _serve  # noqa: E402

NP = (1, 2, 4)
DRAFT_MAX = 3
N_CTX = 4096
N_UBATCH = 512
N_BATCH = 512
AGREEMENT = 0.8
MIB = 2**20


def prompt_text(n_tokens: int) -> str:
    # the model's TEST tokenizer makes one token of every 5 bytes
    words = "compute memory of the target and the draft context, side by side with llama-server "
    return (words * (5 * n_tokens // len(words) + 1))[: 5 * n_tokens]


# --------------------------------------------------------------------------------------------
# llama.cpp's log (llama-server's, and ours with verbose=True)

_CTX_START = re.compile(r"llama_context: constructing llama_context")
_DRAFT_MARK = re.compile(r"creating MTP draft context")
_RESERVING = re.compile(r"sched_reserve: reserving \.\.\.")
_COMPUTE = re.compile(r"sched_reserve:\s+(\S+) compute buffer size =\s+([\d.]+) MiB")
_FIELD = re.compile(r"llama_context: (n_seq_max|n_ctx|n_batch|n_ubatch|n_rs_seq|n_outputs_max|"
                    r"n_outputs_max_per_seq|flash_attn|kv_unified)\s+= (\S+)")


def parse_contexts(text: str, second_is_draft: bool = False) -> List[dict]:
    """Every llama_context the log constructs, in order: ``{draft, fields, reserves}``, ``reserves``
    one ``{buffer type: MiB}`` per ``sched_reserve`` (each makes a new scheduler: the last is what
    the context holds). A context is the draft when llama-server's ``creating MTP draft context``
    comes before it, or (``second_is_draft``, the plugin's log: the target, then its draft) when it
    is the second."""
    out: List[dict] = []
    draft_next = False
    for line in text.splitlines():
        if _DRAFT_MARK.search(line):
            draft_next = True
        elif _CTX_START.search(line):
            out.append(dict(draft=draft_next or (second_is_draft and len(out) == 1), fields={}, reserves=[]))
            draft_next = False
        elif not out:
            continue
        elif (m := _FIELD.search(line)):
            out[-1]["fields"][m.group(1)] = m.group(2)
        elif _RESERVING.search(line):
            out[-1]["reserves"].append({})
        elif (m := _COMPUTE.search(line)):
            if not out[-1]["reserves"]:
                out[-1]["reserves"].append({})
            out[-1]["reserves"][-1][m.group(1)] = float(m.group(2))
    return out


def logged_compute(text: str, second_is_draft: bool = False) -> dict:
    """``{target, draft}``: the MiB the last target and the last draft context of the log hold
    (their last reservation, every buffer type summed), every reservation's MiB (``reserved``) and
    their logged fields; None where absent."""
    res: Dict[str, Optional[dict]] = dict(target=None, draft=None)
    for c in parse_contexts(text, second_is_draft):
        if not c["reserves"]:
            continue  # a context that reserved nothing (no_alloc probes)
        res["draft" if c["draft"] else "target"] = dict(mib=sum(c["reserves"][-1].values()), fields=c["fields"],
                                                        reserved=[sum(r.values()) for r in c["reserves"]])
    return res


# --------------------------------------------------------------------------------------------
# the plugin, in a child process


def child(spec: dict) -> dict:
    import llama_metaws  # noqa: F401
    from llama_metaws import Llama
    from llama_metaws.engine.buffers import compute_buffers

    t = spec["threads"]
    kw = dict(draft="mtp", draft_max=spec["draft_max"], n_seq_max=spec["np"], n_ctx=N_CTX, n_ubatch=N_UBATCH,
              n_batch=N_BATCH, flash_attn=spec["flash_attn"], phase_aware_workspace=spec["workspace"],
              n_threads=t, n_threads_batch=t, verbose=True)

    def read(llm) -> dict:
        target = sum(b.size for b in compute_buffers(llm._ctx))
        draft = sum(b.size for b in compute_buffers(llm._draft_ctx))
        if llm._workspace is not None:
            ws = llm.workspace_stats()  # a shared entry once
            return dict(target=sum(e.owner_need for e in ws), draft=sum(e.borrower_need for e in ws),
                        held=sum(e.allocated for e in ws), shared=any(e.shared for e in ws))
        return dict(target=target, draft=draft, held=target + draft, shared=False)

    from llama_metaws.tools.vram.probe import DECODE_HOOK, ContextGroup

    with Llama(spec["model"], **kw) as llm:
        load = read(llm)
        print("@@ loaded", file=sys.stderr, flush=True)  # the log before this line is the load's
        # the held compute right after every decode of the request (the vram harness's reading):
        # its peak is the prompt phase's, which the workspace gives back for decoding
        group, peak = ContextGroup.from_llama(llm), [0]

        def on_decode(ctx) -> None:
            if group.owns(ctx):
                peak[0] = max(peak[0], sum(v for k, v in group.read().items() if k not in ("kv", "weights")))

        DECODE_HOOK.add(on_decode)
        try:
            out = llm.create_completion(spec["prompt"], max_tokens=spec["tokens"], temperature=0.0)
        finally:
            DECODE_HOOK.remove(on_decode)
        after = read(llm)
        after["peak"] = peak[0]
        res = dict(load=load, after=after, text=out["choices"][0]["text"])
    res["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return res


def run_child(spec: dict, a: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pin = lambda: os.sched_setaffinity(0, a.cores)  # noqa: E731
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, preexec_fn=pin)
        try:
            rc = proc.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()  # our own child, by its PID
            proc.wait()
            rc = "timeout"
        out.seek(0)
        err.seek(0)
        stdout, log = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if rc != 0:
        raise RuntimeError(f"plugin child ({spec}) exited {rc}:\n{log[-3000:]}")
    res = json.loads(stdout.strip().splitlines()[-1])
    at_load = log.split("@@ loaded", 1)[0]
    res["log_load"], res["log_after"] = logged_compute(at_load, True), logged_compute(log, True)
    return res


# --------------------------------------------------------------------------------------------
# the servers


def run_llama_server(tool: Path, model: Path, n: int, a: argparse.Namespace, logdir: Path) -> dict:
    port = _serve.free_port()
    cmd = [str(tool), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", str(n),
           "-c", str(N_CTX), "-b", str(N_BATCH), "-ub", str(N_UBATCH), "-fa", a.flash_attn,
           "-t", str(a.threads), "-tb", str(a.threads), "-ngl", "0",
           "--spec-type", "draft-mtp", "--spec-draft-n-max", str(DRAFT_MAX), "-lv", "4"]
    srv = _serve.Server(f"llama-server -np {n}", cmd, port, a.cores, logdir / f"llama-server-np{n}.log",
                        start_timeout=a.timeout)
    with srv:
        at_load = srv.log_text()
        r = _serve.complete(port, prompt_text(a.prompt_tokens), a.tokens, stream=False)
        time.sleep(0.2)
        after = srv.log_text()
    load, aft = logged_compute(at_load), logged_compute(after)
    if load["target"] is None or load["draft"] is None:
        raise RuntimeError(f"llama-server -np {n}: no target and draft compute buffers in its log "
                           f"({srv.log_path}):\n{at_load[-3000:]}")
    return dict(load=load, after=aft, text=r["text"], timings=r["timings"], peak_rss=srv.peak_rss)


def _metrics(port: int) -> Dict[str, float]:
    status, text = _serve.request(port, "GET", "/metrics", timeout=30)
    out: Dict[str, float] = {}
    if status != 200 or not isinstance(text, str):
        return out
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


def run_serve(model: Path, n: int, a: argparse.Namespace, logdir: Path) -> dict:
    port = _serve.free_port()
    cmd = [sys.executable, "-m", "llama_metaws", "serve", "-m", str(model), "--port", str(port), "-np", str(n),
           "-c", str(N_CTX), "-b", str(N_BATCH), "-ub", str(N_UBATCH), "-fa", a.flash_attn,
           "-t", str(a.threads), "--spec-type", "draft-mtp", "--spec-draft-n-max", str(DRAFT_MAX),
           "--phase-aware-workspace", "--metrics"]
    srv = _serve.Server(f"llama-metaws serve -np {n}", cmd, port, a.cores, logdir / f"serve-np{n}.log",
                        start_timeout=a.timeout)
    with srv:
        before = _metrics(port)
        r = _serve.complete(port, prompt_text(a.prompt_tokens), a.tokens, stream=False)
        after = _metrics(port)

    def held(m: Dict[str, float], key: str) -> Optional[int]:
        vals = [v for k, v in m.items() if k.startswith(f"llamametaws:workspace_{key}{{")]
        return int(sum(vals)) if vals else None

    return dict(load=held(before, "bytes"), after=held(after, "bytes"), target=held(before, "owner_need_bytes"),
                draft=held(before, "borrower_need_bytes"), text=r["text"], peak_rss=srv.peak_rss)


# --------------------------------------------------------------------------------------------
# the run


def measure(a: argparse.Namespace) -> dict:
    from llama_metaws_dev.testing import make_mtp_model

    tools = _serve.llama_tools()
    model = make_mtp_model(agreement=AGREEMENT, dtype=a.dtype)
    logdir = Path(tempfile.mkdtemp(prefix="bench_memory-"))
    print(f"model {model.name}; server logs in {logdir}", flush=True)
    rows: Dict[int, dict] = {}
    for n in a.np:
        spec = dict(model=str(model), draft_max=DRAFT_MAX, np=n, flash_attn=a.flash_attn == "on",
                    threads=a.threads, prompt=prompt_text(a.prompt_tokens), tokens=a.tokens)
        cells = {}
        for name, job in (("llama-server", lambda: run_llama_server(tools["llama-server"], model, n, a, logdir)),
                          ("Llama, private", lambda: run_child(dict(spec, workspace=False), a)),
                          ("Llama, workspace", lambda: run_child(dict(spec, workspace=True), a)),
                          ("serve, workspace", lambda: run_serve(model, n, a, logdir))):
            if name == "serve, workspace" and not a.serve:
                continue
            t0 = time.monotonic()
            cells[name] = job()
            print(f"  -np {n} {name:<17} done ({time.monotonic() - t0:.0f} s)", flush=True)
        rows[n] = cells
    return dict(model=model.name, rows=rows)


def _mib(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / MIB:,.2f}"


def _ratio(x: Optional[float], y: Optional[float]) -> str:
    return "-" if x is None or not y else f"{x / y:.2f}"


def table(m: dict, a: argparse.Namespace, label: str) -> str:
    lines = [
        "## Compute memory against llama-server's own buffers (bench/bench_memory.py)",
        "",
        f"{label}. Model `{m['model']}` (`make_mtp_model` defaults, agreement {AGREEMENT}, {a.dtype}: qwen35, "
        f"28 trunk layers of width 1024, 151,936 tokens, one NextN block). MTP drafting k={DRAFT_MAX}, "
        f"`-ub {N_UBATCH} -b {N_BATCH} -c {N_CTX} -fa {a.flash_attn}`, one CPU device, {a.threads} thread(s); "
        f"one request of {a.prompt_tokens} prompt tokens and {a.tokens} generated. llama-server: "
        f"`-np N --spec-type draft-mtp --spec-draft-n-max {DRAFT_MAX} -lv 4`, its compute buffers as it "
        "logs them (`sched_reserve: CPU compute buffer size`, 0.01 MiB; each reservation makes a new "
        "scheduler, so a context holds its last). `Llama, private` / `Llama, workspace`: `Llama(path, "
        f"draft=\"mtp\", draft_max={DRAFT_MAX}, n_seq_max=N, n_ctx={N_CTX}, n_ubatch={N_UBATCH}, "
        "phase_aware_workspace=False / True)`, exact bytes from ggml's accounting (`compute_buffers` of both "
        "contexts; with the workspace `workspace_stats()`, the shared buffer once, and target / draft are "
        "the owner's and the borrower's needs at load); the request's peak is read right after each of "
        "its decodes (the vram harness's reading). `serve, workspace`: `llama-metaws serve` with the "
        "same flags, its `llamametaws:workspace_bytes` gauges before and after the request. "
        "`n_outputs_max` is each context's (target / draft) as llama.cpp logs it (n_batch = "
        f"{N_BATCH} where none was set). MiB; ratios ours / llama-server's target + draft compute.",
        "",
        "| N | configuration | n_outputs_max target / draft | target compute | draft compute | held at load | "
        "peak in the 1st request | held after it | / llama-server: load | peak | after | peak RSS MiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes, ws = [], {}
    for n, cells in m["rows"].items():
        ls = cells["llama-server"]
        ref = (ls["after"]["target"]["mib"] + ls["after"]["draft"]["mib"]) * MIB
        ref_load = (ls["load"]["target"]["mib"] + ls["load"]["draft"]["mib"]) * MIB

        def outs(logged: dict) -> str:
            return " / ".join((logged.get(k) or {}).get("fields", {}).get("n_outputs_max", "?")
                              for k in ("target", "draft"))

        lines.append(f"| {n} | llama-server | {outs(ls['load'])} | {ls['load']['target']['mib']:,.2f} | "
                     f"{ls['load']['draft']['mib']:,.2f} | {_mib(ref_load)} | {_mib(ref)} | {_mib(ref)} | 1.00 | "
                     f"1.00 | 1.00 | {ls['peak_rss'] / MIB:,.0f} |")
        for name in ("Llama, private", "Llama, workspace"):
            c = cells[name]
            ld, af = c["load"], c["after"]
            lines.append(f"| {n} | {name} | {outs(c['log_load'])} | {_mib(ld['target'])} | {_mib(ld['draft'])} | "
                         f"{_mib(ld['held'])} | {_mib(af['peak'])} | {_mib(af['held'])} | "
                         f"{_ratio(ld['held'], ref_load)} | {_ratio(af['peak'], ref)} | {_ratio(af['held'], ref)} | "
                         f"{c['peak_rss'] / MIB:,.0f} |")
            lg = c["log_load"]
            if name == "Llama, private" and lg["target"] and lg["draft"]:
                exact = (ld["target"] / MIB, ld["draft"] / MIB)
                logged = (lg["target"]["mib"], lg["draft"]["mib"])
                if any(abs(x - y) > 0.006 for x, y in zip(exact, logged)):
                    notes.append(f"N={n}: llama.cpp logs {logged[0]:.2f} / {logged[1]:.2f} MiB for the plugin's "
                                 f"private contexts, ggml's accounting holds {exact[0]:.2f} / {exact[1]:.2f}")
            if name == "Llama, workspace":
                ws[n] = (ld["held"] / ref_load, af["peak"] / ref, af["held"] / ref)
        if "serve, workspace" in cells:
            s = cells["serve, workspace"]
            lines.append(f"| {n} | serve, workspace | - | {_mib(s['target'])} | {_mib(s['draft'])} | "
                         f"{_mib(s['load'])} | - | {_mib(s['after'])} | {_ratio(s['load'], ref_load)} | - | "
                         f"{_ratio(s['after'], ref)} | {s['peak_rss'] / MIB:,.0f} |")
        texts = {name: c.get("text") for name, c in cells.items()}
        if len(set(texts.values())) > 1:
            notes.append(f"N={n}: the first request's text differs: "
                         + ", ".join(f"{k}: {v[:40]!r}" for k, v in texts.items()))
    lines += ["", "Held compute with the workspace, ours / llama-server's target + draft, at load, at the "
              "first request's peak and after it: "
              + "; ".join(f"N={n}: {x:.2f}, {y:.2f}, {z:.2f}" for n, (x, y, z) in ws.items())
              + ". Issue 25 expects about 0.55 at N=2 once the contexts get llama-server's `n_outputs_max` "
              "(the larger of target and draft against their sum): that is the load and peak figures; "
              "after a request the workspace holds the decode phase's need only."]
    lines.append("")
    if any(len(c["llama-server"]["load"]["draft"].get("reserved", [])) > 1 for c in m["rows"].values()):
        lines += ["llama-server's draft context reserves twice at load: once when it is made, and again "
                  "after `common_speculative` has set its backend sampler (`backend_sampling=1` in its log; "
                  "`llama_set_sampler` asks for a new reservation) and masked NextN rows on it (patch 0017's "
                  "smaller MTP graph); it holds the second, smaller one. The plugin's private draft context "
                  "keeps its first reservation, made before the rows were masked "
                  "(`llama_set_embeddings_nextn` asks for none); with the workspace, attaching it reserves "
                  "again, masked, and its need is llama-server's.", ""]
    for n, cells in m["rows"].items():
        for k in ("target", "draft"):
            lg = cells["llama-server"]["load"][k]
            f = lg["fields"]
            again = (f"; reserved {' then '.join(f'{x:.2f}' for x in lg['reserved'])} MiB at load"
                     if len(lg.get("reserved", [])) > 1 else "")
            lines.append(f"- llama-server N={n}, {k}: n_seq_max {f.get('n_seq_max', '?')}, n_outputs_max "
                         f"{f.get('n_outputs_max', '?')} (per sequence {f.get('n_outputs_max_per_seq', '?')}), "
                         f"n_rs_seq {f.get('n_rs_seq', '?')}, kv_unified {f.get('kv_unified', '?')}, "
                         f"flash_attn {f.get('flash_attn', '?')}{again}.")
    lines += ["", "Output check: " + ("; ".join(notes) if notes else
                                      "the first request's text is the same in every configuration; llama.cpp's "
                                      "log of the plugin's private contexts equals ggml's accounting (0.01 MiB).")]
    return "\n".join(lines)


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="-np 2 only, no serve row")
    ap.add_argument("--np", type=lambda v: tuple(int(x) for x in v.split(",")),
                    help=f"comma-separated sequence counts (default {','.join(map(str, NP))})")
    ap.add_argument("--threads", type=int, default=2, help="threads, pinned to the last cores (2)")
    ap.add_argument("--flash-attn", "-fa", default="on", choices=("on", "off"), help="flash attention (on)")
    ap.add_argument("--dtype", default="q8_0", choices=("f16", "q8_0"), help="model matrices (q8_0)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="the first request's prompt length (64)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens the first request generates (16)")
    ap.add_argument("--no-serve", dest="serve", action="store_false", help="leave out the `serve` row")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration (600)")
    ap.add_argument("--label", default="", help="what this run measures (printed above the table)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--json", metavar="FILE", help="also write the run's measurements and options to FILE")
    ap.add_argument("--render", metavar="FILE", help="no run: the table of a run saved with --json")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return
    if a.render:
        saved = json.loads(Path(a.render).read_text())
        a = argparse.Namespace(**dict(vars(a), **saved["options"]))
        m = dict(saved["measurements"], rows={int(n): c for n, c in saved["measurements"]["rows"].items()})
        _publish(m, a, saved["label"])
        return
    a.np = a.np or ((2,) if a.quick else NP)
    if a.quick:
        a.serve = False
    a.cores = _serve.pinned_cores(a.threads)
    # a SIGTERM to the bench ends it like ^C does: the servers it started are stopped by PID
    signal.signal(signal.SIGTERM, _interrupted)
    t0 = time.monotonic()
    m = measure(a)
    label = a.label or ("Quick run" if a.quick else "Full run")
    label += f" ({time.monotonic() - t0:.0f} s)"
    if a.json:
        options = {k: v for k, v in vars(a).items() if k not in ("child", "json", "render", "no_write")}
        Path(a.json).write_text(json.dumps(dict(label=label, options=options, measurements=m), indent=1))
    _publish(m, a, label)


def _publish(m: dict, a: argparse.Namespace, label: str) -> None:
    import _doc

    _doc.publish("bench_memory", table(m, a, label), write=not a.no_write)


if __name__ == "__main__":
    main()
