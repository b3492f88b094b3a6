"""N concurrent clients: our `serve` next to llama-server, with MTP drafting and without.

Issues 28 and 29. Five servers on the real-shape bench model (``make_mtp_model`` defaults,
agreement 0.8, q8_0; cached after the first make; ``--agreement`` for another), each pinned to
the same cores with the same thread count, ``-np 4 -c 4096 -fa on``:

* ``serve, draft-mtp``: ``llama-metaws serve --spec-type draft-mtp --spec-draft-n-max 3
  --phase-aware-workspace``;
* ``serve, auto``: the same with ``--spec-draft-n-max auto`` (each step's lengths chosen from
  acceptance and measured costs);
* ``serve, no drafting``: ``llama-metaws serve``;
* ``llama-server, draft-mtp``: llama.cpp's server built from the same patched tree (``llama-metaws
  build --tools``), ``--spec-type draft-mtp --spec-draft-n-max 3``;
* ``llama-server, no drafting``;
* named with ``--servers`` only: ``serve, k=1``, ``serve, k=2``, ``serve, k=4`` (our server at the
  other fixed draft lengths; ``serve, draft-mtp`` is k=3), the field ``serve, auto`` is weighed
  against (the best of them and ``serve, no drafting``).

Our servers get an empty ``LLAMA_METAWS_COSTS`` folder: ``serve, auto`` measures its cost prior at
load (``engine/prior.py``), as a first start on a machine does.

All of them run for the whole bench (started at once, each warmed up with one request, stopped by
PID at the end: their peak RSS is VmHWM / ``wait4``'s over the run). Each round runs every cell
(N = 1, 2, 4 concurrent clients x the servers), N outermost, the servers' order rotated by one
each round. A cell sends the same ``--prompts`` distinct prompts (8; they differ from their first
token, so no request shares a prefix with the one before it) as greedy streamed ``POST
/v1/completions`` of ``--tokens`` (64) tokens from N client threads that take the next prompt as
soon as their last request ends. Every request carries ``"cache_prompt": false``: both servers
would otherwise reuse the prompts of earlier rounds their slots hold (llama-server its RAM cache
too); every request's ``cache_n`` is shown.

Per cell: aggregate t/s (the tokens of every request over the cell's wall time, first request
sent to last reply), per-request t/s (median of the server's ``timings.predicted_per_second``),
time to first token (median, as the client sees it: queueing included), acceptance (the cell's
``draft_n_accepted`` over ``draft_n`` from each reply's ``timings``), graphs per step (from the
reply's ``timings``: ``graphs_per_step``, or ``n_graphs`` over ``n_steps``; else from ``/metrics``:
``llamametaws:graphs_target_total`` and ``llamametaws:graphs_draft_total`` over
``llamametaws:steps_total``; else n/a), the share of plain steps (``llamametaws:plain_steps_share``
over the cell, from ``draft_length_steps_total``), and whether each output
equals the same server's solo output of that prompt (its N=1 cell of the first round; greedy: the
text must be identical). Ratios are the median over rounds of each round's ratio.

    .venv/bin/python bench/bench_concurrency.py [--quick] [--rounds 3] [--json FILE] [--render FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _serve  # noqa: E402

NS = (1, 2, 4)
DRAFT_MAX = 3
N_PARALLEL = 4
N_CTX = 4096
AGREEMENT = 0.8
PLOT = HERE / "concurrency.png"
SERVERS = ("serve, draft-mtp", "serve, auto", "serve, no drafting", "llama-server, draft-mtp",
           "llama-server, no drafting")
#: our server at the other fixed draft lengths (``serve, draft-mtp`` is k=3): not run unless named
FIXED_K = ("serve, k=1", "serve, k=2", "serve, k=4")
KNOWN = SERVERS + FIXED_K
MIB = 2**20


def prompts(n: int, n_tokens: int) -> List[str]:
    """``n`` distinct prompts of about ``n_tokens`` tokens (the TEST tokenizer: a token per 5
    bytes), each with a head of its own (its first token) and a body of its own."""
    words = ("several clients at once on one server, each with a prompt of its own and a "
             "continuation the greedy sampler must reproduce exactly ")
    out = []
    for i in range(n):
        body = words[(7 * i) % len(words):] + words
        body = (body * (5 * n_tokens // len(body) + 1))
        out.append((f"{i:04d} " + body)[: 5 * n_tokens])
    return out


# --------------------------------------------------------------------------------------------
# the servers


def server_cmds(name: str, tools: dict, model: Path, port: int, a: argparse.Namespace) -> List[str]:
    common = ["-m", str(model), "--port", str(port), "-np", str(N_PARALLEL), "-c", str(N_CTX), "-fa", "on",
              "-t", str(a.threads), "-tb", str(a.threads)]
    k = "auto" if name.endswith("auto") else name.rsplit("k=", 1)[1] if "k=" in name else str(DRAFT_MAX)
    spec = ["--spec-type", "draft-mtp", "--spec-draft-n-max", k]
    if name.startswith("serve"):
        cmd = [sys.executable, "-m", "llama_metaws", "serve", *common, "--metrics"]
        return cmd + spec + ["--phase-aware-workspace"] if "no drafting" not in name else cmd
    cmd = [str(tools["llama-server"]), "--host", "127.0.0.1", *common, "-ngl", "0", "--metrics"]
    return cmd + spec if "draft-mtp" in name else cmd


def request_extra(name: str) -> dict:
    return {"cache_prompt": False}


def _metrics(port: int) -> Dict[str, float]:
    try:
        status, text = _serve.request(port, "GET", "/metrics", timeout=30)
    except OSError:
        return {}
    out: Dict[str, float] = {}
    if status != 200 or not isinstance(text, str):
        return out
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            pass
    return out


def graphs_per_step(results: List[dict], m0: Dict[str, float], m1: Dict[str, float]) -> Optional[float]:
    """Graphs computed per decoding step, where the server says so (see the module docstring)."""
    ts = [r["timings"] for r in results]
    if ts and all("graphs_per_step" in t for t in ts):
        return statistics.mean(float(t["graphs_per_step"]) for t in ts)
    if ts and all("n_graphs" in t and "n_steps" in t for t in ts):
        steps = sum(t["n_steps"] for t in ts)
        return sum(t["n_graphs"] for t in ts) / steps if steps else None
    gs, s = ("llamametaws:graphs_target_total", "llamametaws:graphs_draft_total"), "llamametaws:steps_total"
    if all(g in m1 for g in gs) and s in m1 and m1[s] - m0.get(s, 0.0) > 0:
        return sum(m1[g] - m0.get(g, 0.0) for g in gs) / (m1[s] - m0.get(s, 0.0))
    return None


def plain_share(m0: Dict[str, float], m1: Dict[str, float]) -> Optional[float]:
    """The cell's share of plain decode steps (``draft_length_steps_total{length="0"}``), where
    the server counts its steps by draft length."""
    key = "llamametaws:draft_length_steps_total"
    steps = {k: m1[k] - m0.get(k, 0.0) for k in m1 if k.startswith(key)}
    total = sum(steps.values())
    return steps.get(key + '{length="0"}', 0.0) / total if total > 0 else None


def run_cell(port: int, name: str, n: int, texts: List[str], a: argparse.Namespace) -> dict:
    """``n`` client threads over the prompts; every reply and the cell's wall time."""
    todo: "queue.Queue[int]" = queue.Queue()
    for i in range(len(texts)):
        todo.put(i)
    results: List[Optional[dict]] = [None] * len(texts)
    errors: List[str] = []

    def client() -> None:
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = _serve.complete(port, texts[i], a.tokens, request_extra(name), stream=True,
                                             timeout=a.timeout)
            except Exception as e:  # noqa: BLE001 - reported with the cell
                errors.append(f"prompt {i}: {e}")

    m0 = _metrics(port)
    threads = [threading.Thread(target=client, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(a.timeout * len(texts))
    if errors or any(r is None for r in results):
        raise RuntimeError(f"{name}, N={n}: " + ("; ".join(errors) or "a request did not finish"))
    m1 = _metrics(port)
    rs: List[dict] = results  # type: ignore[assignment]
    wall = max(r["t1"] for r in rs) - min(r["t0"] for r in rs)
    tokens = [int(r["timings"].get("predicted_n") or r["usage"].get("completion_tokens") or 0) for r in rs]
    drafted = sum(int(r["timings"].get("draft_n") or 0) for r in rs)
    accepted = sum(int(r["timings"].get("draft_n_accepted") or 0) for r in rs)
    return dict(
        wall=wall, tokens=sum(tokens), agg_tps=sum(tokens) / wall if wall > 0 else float("nan"),
        req_tps=statistics.median(float(r["timings"].get("predicted_per_second") or 0.0) for r in rs),
        ttft_ms=statistics.median(1e3 * r["ttft_s"] for r in rs if r["ttft_s"] is not None),
        drafted=drafted, accepted=accepted, graphs_per_step=graphs_per_step(rs, m0, m1),
        plain_share=plain_share(m0, m1),
        cache_n=sum(int(r["timings"].get("cache_n") or 0) for r in rs),
        texts=[r["text"] for r in rs], n_tokens=tokens)


# --------------------------------------------------------------------------------------------
# the run


def measure(a: argparse.Namespace, keep: Optional[Callable[[dict], None]] = None) -> dict:
    """Every cell of every round; ``keep`` gets the measurements so far after each cell (--json
    writes them: a run stopped part-way keeps its cells for --render)."""
    from llama_metaws_dev.testing import make_mtp_model

    tools = _serve.llama_tools()
    model = make_mtp_model(agreement=a.agreement, dtype=a.dtype)
    texts = prompts(a.prompts, a.prompt_tokens)
    logdir = Path(tempfile.mkdtemp(prefix="bench_concurrency-"))
    print(f"bench pid {os.getpid()}; model {model.name}; server logs in {logdir}", flush=True)
    servers: Dict[str, _serve.Server] = {}
    cells: Dict[str, Dict[int, List[dict]]] = {name: {n: [] for n in a.ns} for name in a.servers}

    def so_far(rounds_done: int, partial: bool) -> dict:
        # peak RSS: VmHWM of a live server, wait4's once it is stopped
        rss = {name: max(srv.peak_rss, _serve.peak_rss_now(srv.pid) if srv.alive() else 0)
               for name, srv in servers.items()}
        return dict(model=model.name, cells=cells, rss=rss, prompts=len(texts), rounds_done=rounds_done,
                    partial=partial)

    try:
        for name in a.servers:
            port = _serve.free_port()
            # draft_max="auto" measures its cost prior at load (a fresh folder: no curve saved before)
            env = dict(os.environ, LLAMA_METAWS_COSTS=str(logdir / "costs"))
            srv = _serve.Server(name, server_cmds(name, tools, model, port, a), port, a.cores,
                                logdir / (name.replace(", ", "-").replace(" ", "_").replace("=", "") + ".log"),
                                env=env, start_timeout=a.timeout)
            t0 = time.monotonic()
            servers[name] = srv.start()
            _serve.complete(port, "warm-up " + texts[0][:40], 4, request_extra(name), stream=True, timeout=a.timeout)
            print(f"  started {name} (pid {srv.pid}, {time.monotonic() - t0:.0f} s with a warm-up request)", flush=True)
        for rnd in range(a.rounds):
            order = list(a.servers[rnd % len(a.servers):]) + list(a.servers[:rnd % len(a.servers)])
            for n in a.ns:
                for name in order:
                    srv = servers[name]
                    if not srv.alive():
                        raise _serve.ServerError(f"{name} died:\n{srv.log_text()[-3000:]}")
                    c = run_cell(srv.port, name, n, texts, a)
                    cells[name][n].append(c)
                    acc = f", accept {c['accepted'] / c['drafted']:.3f}" if c["drafted"] else ""
                    print(f"  [{rnd + 1}/{a.rounds}] N={n} {name:<26} {c['agg_tps']:6.2f} t/s aggregate, "
                          f"{c['req_tps']:6.2f} per request, ttft {c['ttft_ms']:7.0f} ms{acc} "
                          f"({c['wall']:.0f} s)", flush=True)
                    if keep is not None:
                        keep(so_far(min(len(v) for by_n in cells.values() for v in by_n.values()), partial=True))
    finally:
        for srv in servers.values():
            srv.stop()
    return so_far(a.rounds, partial=False)


def _med(xs: List[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def _f(x: Optional[float], fmt: str) -> str:
    return "n/a" if x is None or x != x else format(x, fmt)


def summarize(m: dict) -> dict:
    """Per server and N: medians over the rounds, acceptance over every request, outputs against
    the server's solo run (its first N=1 cell)."""
    s: dict = {}
    for name, by_n in m["cells"].items():
        solo = by_n[1][0]["texts"] if by_n.get(1) else None  # no N=1 cell: no solo to compare with
        s[name] = {}
        for n, runs in by_n.items():
            drafted = sum(c["drafted"] for c in runs)
            gps = [c["graphs_per_step"] for c in runs if c.get("graphs_per_step") is not None]
            plain = [c["plain_share"] for c in runs if c.get("plain_share") is not None]
            same = total = 0
            for c in runs:
                for i, t in enumerate(c["texts"]):
                    total += 1
                    same += solo is not None and t == solo[i]
            outputs = f"{same}/{total}" if solo is not None else "n/a"
            s[name][n] = dict(agg=_med([c["agg_tps"] for c in runs]), req=_med([c["req_tps"] for c in runs]),
                              ttft=_med([c["ttft_ms"] for c in runs]),
                              accept=sum(c["accepted"] for c in runs) / drafted if drafted else None,
                              gps=statistics.mean(gps) if gps else None, same=same, total=total, outputs=outputs,
                              plain=statistics.mean(plain) if plain else None,
                              cache_n=sum(c["cache_n"] for c in runs))
    return s


def paired(m: dict, n: int, num: str, den: str) -> float:
    """The median over rounds of ``num``'s aggregate t/s over ``den``'s in the same round."""
    a, b = m["cells"].get(num, {}).get(n, []), m["cells"].get(den, {}).get(n, [])
    return _med([x["agg_tps"] / y["agg_tps"] for x, y in zip(a, b)])


def paired_best(m: dict, n: int, num: str, dens: List[str]) -> float:
    """The median over rounds of ``num``'s aggregate t/s over the best of ``dens`` in that round."""
    a = m["cells"].get(num, {}).get(n, [])
    bs = [m["cells"].get(d, {}).get(n, []) for d in dens]
    return _med([x["agg_tps"] / max(y["agg_tps"] for y in ys) for x, *ys in zip(a, *bs)])


def lead_share(m: dict, n: int, num: str, ref: str, den: str) -> float:
    """How much of ``ref``'s lead over ``den`` ``num`` has: ``(num/den - 1) / (ref/den - 1)`` from the
    medians over rounds of the paired ratios (nan where ``ref`` does not lead)."""
    r_num, r_ref = paired(m, n, num, den), paired(m, n, ref, den)
    return (r_num - 1) / (r_ref - 1) if r_ref > 1 else float("nan")


def table(m: dict, a: argparse.Namespace, label: str) -> str:
    s = summarize(m)
    names = list(m["cells"])
    lines = [
        "## N concurrent clients: our `serve` next to llama-server (bench/bench_concurrency.py)",
        "",
        f"{label}. Model `{m['model']}` (`make_mtp_model` defaults, agreement {a.agreement}, {a.dtype}: qwen35, "
        f"28 trunk layers of width 1024, 151,936 tokens, one NextN block). Every server `-np {N_PARALLEL} -c "
        f"{N_CTX} -fa on -t {a.threads}`, pinned to core(s) {','.join(map(str, a.cores))}; drafting is "
        f"`--spec-type draft-mtp --spec-draft-n-max {DRAFT_MAX}` (ours with `--phase-aware-workspace`; "
        "`serve, auto`: `--spec-draft-n-max auto`). "
        f"Each cell: {m['prompts']} distinct prompts of about {a.prompt_tokens} tokens, {a.tokens} tokens "
        f"each, greedy, streamed `POST /v1/completions` from N client threads; {a.rounds} round(s), N "
        "outermost, the servers' order rotated each round (medians over the rounds run). Every request "
        "has `\"cache_prompt\": false`. Aggregate t/s: every request's tokens over the cell's wall time; per "
        "request: the server's `predicted_per_second` (median); time to first token: the client's "
        "(queueing included, median); acceptance: `draft_n_accepted / draft_n` from the replies' "
        "`timings`; graphs per step (target and draft): n/a where the server does not report it; plain "
        "steps: the share of decode steps that drafted nothing (ours); peak RSS: the server "
        "process over the whole run; outputs: replies equal to the same server's solo (N=1) reply.",
        "",
        "| server | N | aggregate t/s | per request t/s | time to first token ms | acceptance | "
        "graphs per step | plain steps | outputs = solo | peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        for n, r in s[name].items():
            lines.append(f"| {name} | {n} | {r['agg']:.2f} | {r['req']:.2f} | {r['ttft']:,.0f} | "
                         f"{_f(r['accept'], '.3f')} | {_f(r['gps'], '.2f')} | {_f(r.get('plain'), '.2f')} | "
                         f"{r['outputs']} | "
                         f"{m['rss'].get(name, 0) / MIB:,.0f} |")
    ns = sorted({n for name in names for n in s[name]})
    pairs = [("serve, draft-mtp", "llama-server, draft-mtp"), ("serve, no drafting", "llama-server, no drafting")]
    lines += ["", "Goals (issues 28 and 29; ratios of aggregate t/s, median over rounds of each round's ratio):", "",
              "| goal | " + " | ".join(f"N={n}" for n in ns) + " |", "|---|" + "---:|" * len(ns)]
    for ours, theirs in pairs:
        if ours in s and theirs in s:
            lines.append(f"| {ours} / {theirs} (>= 0.9) | "
                         + " | ".join(_f(paired(m, n, ours, theirs), ".2f") for n in ns) + " |")
    ours = [x for x in ("serve, no drafting", "serve, k=1", "serve, k=2", "serve, draft-mtp", "serve, k=4") if x in s]
    if "serve, auto" in s and len(ours) > 1:
        named = ", ".join(x.replace("serve, ", "").replace("draft-mtp", "k=3") for x in ours)
        lines.append(f"| serve, auto / the best of serve with {named} (>= 0.95) | "
                     + " | ".join(_f(paired_best(m, n, "serve, auto", ours), ".2f") for n in ns) + " |")
    ls = "llama-server, draft-mtp"
    if "serve, auto" in s and ls in s:
        lines.append(f"| serve, auto / {ls} | "
                     + " | ".join(_f(paired(m, n, "serve, auto", ls), ".2f") for n in ns) + " |")
        if "serve, no drafting" in s:
            lines.append(f"| serve, no drafting / {ls} | "
                         + " | ".join(_f(paired(m, n, "serve, no drafting", ls), ".2f") for n in ns) + " |")
            lines.append(f"| serve, auto's lead over {ls} / serve, no drafting's (>= 0.9 at N=1) | "
                         + " | ".join(_f(lead_share(m, n, "serve, auto", "serve, no drafting", ls), ".2f")
                                      for n in ns) + " |")
    for name in ("serve, draft-mtp", "llama-server, draft-mtp"):
        if name in s and 1 in s[name]:
            base = s[name][1]["accept"]
            lines.append(f"| {name}: acceptance - solo's, points (within 2) | "
                         + " | ".join("n/a" if base is None or s[name][n]["accept"] is None
                                      else f"{100 * (s[name][n]['accept'] - base):+.1f}" for n in ns) + " |")
    for name in names:
        if 1 in s[name]:
            lines.append(f"| {name}: aggregate / its N=1 | "
                         + " | ".join(_f(s[name][n]["agg"] / s[name][1]["agg"], ".2f") for n in ns) + " |")
    if "serve, draft-mtp" in s and 1 in s["serve, draft-mtp"] and 4 in s["serve, draft-mtp"]:
        r = s["serve, draft-mtp"][4]["agg"] / s["serve, draft-mtp"][1]["agg"]
        lines += ["", f"Our N=4 / our N=1 with drafting: {r:.2f} (goal >= 1.5)."]
    notes = []
    solos = {name: m["cells"][name][1][0]["texts"] for name in names if m["cells"][name].get(1)}
    if len(solos) > 1:
        ref_name = names[0]
        for name, t in solos.items():
            if name != ref_name and t != solos[ref_name]:
                diff = sum(x != y for x, y in zip(t, solos[ref_name]))
                notes.append(f"{name}'s solo replies differ from {ref_name}'s on {diff} of {len(t)} prompts")
    caches = {name: sum(r["cache_n"] for r in s[name].values()) for name in names}
    if any(caches.values()):
        notes.append("prompt tokens reused (cache_n summed over the run): "
                     + ", ".join(f"{k} {v}" for k, v in caches.items()))
    lines += ["", "Output check: " + ("; ".join(notes) + "." if notes else
                                      "every server's solo replies are the same text, and no request reused "
                                      "a prompt prefix (cache_n 0 throughout).")]
    lines += ["", f"![aggregate t/s against concurrent clients]({PLOT.name})"]
    return "\n".join(lines)


def plot(m: dict, a: argparse.Namespace) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    s = summarize(m)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    style = {"serve, draft-mtp": ("C0", "o-"), "serve, auto": ("C2", "o--"), "serve, no drafting": ("C0", "o:"),
             "llama-server, draft-mtp": ("C1", "s-"), "llama-server, no drafting": ("C1", "s:"),
             "serve, k=1": ("C3", "^-"), "serve, k=2": ("C4", "v-"), "serve, k=4": ("C5", "d-")}
    for name, by_n in s.items():
        ns = sorted(by_n)
        color, fmt = style.get(name, ("k", "x-"))
        ax1.plot(ns, [by_n[n]["agg"] for n in ns], fmt, color=color, label=name)
        ax2.plot(ns, [by_n[n]["ttft"] for n in ns], fmt, color=color, label=name)
    for ax, what in ((ax1, "aggregate tokens/s"), (ax2, "time to first token, ms (median)")):
        ax.set_xlabel("concurrent clients N")
        ax.set_ylabel(what)
        ax.set_xticks(sorted({n for by_n in s.values() for n in by_n}))
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(f"real-shape qwen35 MTP model, {a.dtype}, -np {N_PARALLEL}, {a.threads} thread(s), "
                 f"greedy {a.tokens} tokens per request", fontsize=9)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    return PLOT


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 round, 4 prompts, 32 tokens: a few minutes")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, the servers' order rotated each (3; --quick 1)")
    ap.add_argument("--ns", type=lambda v: tuple(int(x) for x in v.split(",")),
                    help=f"comma-separated client counts (default {','.join(map(str, NS))}; at most {N_PARALLEL})")
    ap.add_argument("--servers", type=lambda v: tuple(x.strip() for x in v.split(";")),
                    help="semicolon-separated, of: " + "; ".join(KNOWN) + " (default: the first five)")
    ap.add_argument("--prompts", type=int, help="distinct prompts per cell (8; --quick 4)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length in tokens (128)")
    ap.add_argument("--tokens", type=int, help="tokens per request (64; --quick 32)")
    ap.add_argument("--threads", type=int, default=2, help="threads of every server, pinned to the last cores (2)")
    ap.add_argument("--dtype", default="q8_0", choices=("f16", "q8_0"), help="model matrices (q8_0)")
    ap.add_argument("--agreement", type=float, default=AGREEMENT,
                    help=f"how often the model's MTP head agrees with its trunk ({AGREEMENT})")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds for a server to start and for one request (600)")
    ap.add_argument("--label", default="", help="what this run measures (printed above the table)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--json", metavar="FILE", help="also write the run's measurements and options to FILE")
    ap.add_argument("--render", metavar="FILE", help="no run: the table (and plot) of a run saved with --json")
    a = ap.parse_args()
    if a.render:
        saved = json.loads(Path(a.render).read_text())
        a = argparse.Namespace(**dict(vars(a), **saved["options"]))
        sm = saved["measurements"]
        m = dict(sm, cells={name: {int(n): c for n, c in by_n.items()} for name, by_n in sm["cells"].items()})
        _publish(m, a, saved["label"])
        return
    a.ns = a.ns or NS
    if max(a.ns) > N_PARALLEL:
        ap.error(f"--ns: at most {N_PARALLEL} clients (the servers' -np)")
    a.servers = a.servers or SERVERS
    unknown = [x for x in a.servers if x not in KNOWN]
    if unknown:
        ap.error(f"--servers: unknown {unknown}; choose from {KNOWN}")
    a.prompts = a.prompts or (4 if a.quick else 8)
    a.tokens = a.tokens or (32 if a.quick else 64)
    if a.quick and "--rounds" not in sys.argv:
        a.rounds = 1
    a.cores = _serve.pinned_cores(a.threads)
    # a SIGTERM to the bench ends it like ^C does: the servers it started are stopped by PID
    signal.signal(signal.SIGTERM, _interrupted)
    t0 = time.monotonic()
    base = a.label or ("Quick run" if a.quick else "Full run")
    options = {k: v for k, v in vars(a).items() if k not in ("json", "render", "no_write")}

    def keep(m: dict) -> None:
        if a.json:
            label = base + (f" (stopped part-way: {m['rounds_done']} of {a.rounds} round(s) complete, "
                            f"{time.monotonic() - t0:.0f} s)" if m.get("partial") else f" ({time.monotonic() - t0:.0f} s)")
            tmp = Path(a.json + ".tmp")
            tmp.write_text(json.dumps(dict(label=label, options=options, measurements=m), indent=1))
            os.replace(tmp, a.json)

    m = measure(a, keep)
    keep(m)
    _publish(m, a, base + f" ({time.monotonic() - t0:.0f} s)")


def _publish(m: dict, a: argparse.Namespace, label: str) -> None:
    import _doc

    _doc.publish("bench_concurrency", table(m, a, label), write=not a.no_write)
    if not a.no_write and plot(m, a) is not None:
        print(f"plot: {PLOT}")


if __name__ == "__main__":
    main()
