"""Multi-head MTP in its place: the plugin's drafted and accepted counts next to llama.cpp's own.

mimo2 (three NextN layers) and step35 (three chained heads) draft step k with head k in llama.cpp's
draft-mtp (``chain_heads`` in common/speculative.cpp). Probe models of both families, written by
``llama_metaws_dev.testing.families`` with the agreement design and one rate per head (head k drafts
the target's next token at its rate: ``[1, 0, 0]`` is a head 0 always right and later heads always
wrong), run greedy through:

* ``llama.cpp``: ``llama-speculative-simple --spec-type draft-mtp --spec-draft-n-max 3 -lv 5``
  (``llama-metaws build --tools``, the same patched tree), its steps from its per-step
  ``accepted A/D draft tokens`` lines;
* ``plugin``: ``Llama(draft="mtp", draft_max=3)`` over the same prompt tokens, its steps recorded
  at each verification;
* ``plugin, head 0 at every depth``: the same with the chaining turned off (what the plugin did
  before: every draft step under head 0).

Compared: the steps each took while at least a full draft's budget was left (llama-speculative-simple
drafts a full ``n_max`` whatever ``-n`` leaves, and stops only once past it; the plugin drafts what
the budget leaves), as a sequence of ``(accepted, drafted)``, and their sums. Equal sequences mean
the same heads drafted the same tokens at the same depths.

    .venv/bin/python bench/bench_heads.py [--tokens 48] [--no-write]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _doc  # noqa: E402

ARCHS = ("mimo2", "step35")
RATES = ([1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.75, 0.5, 0.25])
DRAFT_MAX = 3
SEED = 4
N_CTX, N_BATCH = 512, 64
PROMPT = "multi token prediction heads each in their place " * 3

Steps = List[Tuple[int, int]]  # (accepted, drafted) per verification


def llama_cpp_steps(tool: Path, model: Path, tokens: int, timeout: float) -> Tuple[Steps, int, int]:
    """llama-speculative-simple's steps with a draft (from its debug log), and its printed
    n_drafted / n_accept."""
    cmd = [str(tool), "-m", str(model), "-p", PROMPT, "-n", str(tokens), "-c", str(N_CTX), "-b", str(N_BATCH),
           "-ub", str(N_BATCH), "-t", "1", "-tb", "1", "--spec-type", "draft-mtp", "--spec-draft-n-max",
           str(DRAFT_MAX), "--temp", "0", "--seed", "0", "-ngl", "0", "-lv", "5"]
    for _ in range(3):  # its log is written by a thread of its own: on a loaded machine the end can be lost
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        text = p.stdout + p.stderr
        if p.returncode != 0:
            raise RuntimeError(f"llama-speculative-simple exited {p.returncode}:\n{text[-3000:]}")
        steps = [(int(a), int(d)) for a, d in re.findall(r"accepted (\d+)/(\d+) draft tokens", text)]
        drafted = re.search(r"n_drafted\s*=\s*(\d+)", text)
        accepted = re.search(r"n_accept\s*=\s*(\d+)", text)
        if steps and drafted is not None and accepted is not None:
            return [s for s in steps if s[1]], int(drafted.group(1)), int(accepted.group(1))
    raise RuntimeError(f"llama-speculative-simple: no steps or counts in its output:\n{text[-3000:]}")


def plugin_steps(model: Path, tokens: int, chained: bool = True) -> Tuple[Steps, int, int]:
    """The plugin's steps with a draft over the same prompt tokens, and its draft counts."""
    from llama_metaws import Llama

    with Llama(str(model), draft="mtp", draft_max=DRAFT_MAX, n_ctx=N_CTX, n_batch=N_BATCH, n_ubatch=N_BATCH,
               n_threads=1, n_threads_batch=1, verbose=False) as llm:
        engine = llm._engine
        engine.head.chained = chained
        steps: Steps = []
        roll_back = engine.roll_back

        def recording(verdicts):
            steps.extend((v.accepted, v.drafted) for v in verdicts if v.segment.kind == "decode" and v.drafted)
            return roll_back(verdicts)

        engine.roll_back = recording
        prompt = llm.tokenize(PROMPT.encode(), add_bos=True, special=True)  # as common_tokenize(.., true, true)
        llm.create_completion(prompt, max_tokens=tokens, temperature=0.0)
        st = llm.draft_stats.last
        return steps, st.drafted, st.accepted


def full_budget(steps: Steps, tokens: int) -> Steps:
    """The steps begun while a full draft fitted the budget (``tokens`` generated at most)."""
    out, n = [], 0
    for accepted, drafted in steps:
        if tokens - n - 1 >= DRAFT_MAX:
            out.append((accepted, drafted))
        n += accepted + 1
    return out


def cpu_flags() -> str:
    """The SIMD flags of this CPU that ggml-cpu builds for (from /proc/cpuinfo; '' elsewhere)."""
    try:
        line = next(l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags"))
    except (OSError, StopIteration):
        return ""
    have = set(line.split(":", 1)[1].split())
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile")
    return ", ".join(f for f in wanted if f in have) + ("" if "amx_tile" in have else "; no AMX")


def _sums(steps: Steps) -> str:
    return f"{sum(a for a, _ in steps)} / {sum(d for _, d in steps)}"


def run(tokens: int, timeout: float, write: bool) -> str:
    from llama_metaws_dev import tools_build
    from llama_metaws_dev.testing.families import make_family_model

    tools = tools_build.find_tools()
    if tools is None:
        print("building llama.cpp's tools (llama-metaws build --tools) ...", flush=True)
        subprocess.run([sys.executable, "-m", "llama_metaws", "build", "--tools"], check=True)
        tools = tools_build.find_tools()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-heads-") as tmp:
        for arch in ARCHS:
            for rates in RATES:
                model = make_family_model(arch, Path(tmp) / f"{arch}.gguf", seed=SEED, agreement=rates)
                ref, ref_drafted, ref_accepted = llama_cpp_steps(tools["llama-speculative-simple"], model,
                                                                 tokens, timeout)
                ours, drafted, accepted = plugin_steps(model, tokens)
                head0, _, _ = plugin_steps(model, tokens, chained=False)
                a, b, c = full_budget(ref, tokens), full_budget(ours, tokens), full_budget(head0, tokens)
                rows.append((arch, rates, a, b, c, (ref_accepted, ref_drafted), (accepted, drafted)))
                print(f"{arch} {rates}: llama.cpp {_sums(a)} over {len(a)} steps, plugin {_sums(b)} over {len(b)}"
                      f" ({'same steps' if a == b else 'DIFFERENT steps'}), head 0 only {_sums(c)}", flush=True)
    table = [
        "## Multi-head MTP: drafted and accepted counts against llama-speculative-simple",
        "",
        f"`bench/bench_heads.py --tokens {tokens}`: probe models of the chained-head families (the "
        f"agreement design, seed {SEED}, one rate per NextN head: head k's draft is the target's next "
        f"token at its rate), greedy, draft_max {DRAFT_MAX}, one thread. `llama.cpp` is "
        "`llama-speculative-simple --spec-type draft-mtp --spec-draft-n-max 3` from the same patched "
        "tree, its steps from its debug log; `plugin` is `Llama(draft=\"mtp\", draft_max=3)` over the same "
        "prompt tokens; `head 0 only` is the plugin with its chaining turned off (every depth under head "
        "0, as before). Accepted / drafted over the steps begun with a full draft's budget left "
        "(llama.cpp drafts a full n_max whatever `-n` leaves); `same steps`: the two sequences of "
        "(accepted, drafted) per step are equal. The last column is each one's own total (llama.cpp's "
        f"printed n_accept / n_drafted, past `-n` included). CPU flags: {cpu_flags() or 'unknown'}.",
        "",
        "| family | head rates | steps | llama.cpp | plugin | same steps | head 0 only | totals: llama.cpp, plugin |",
        "|---|---|---:|---:|---:|:---:|---:|---|",
    ]
    for arch, rates, a, b, c, ref_total, total in rows:
        table.append(f"| {arch} | {rates} | {len(a)} | {_sums(a)} | {_sums(b)} | {'yes' if a == b else 'no'} | "
                     f"{_sums(c)} | {ref_total[0]} / {ref_total[1]}, {total[0]} / {total[1]} |")
    return _doc.publish("bench_heads", "\n".join(table), write)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per run (48)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per llama.cpp run (300)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    a = ap.parse_args()
    run(a.tokens, a.timeout, write=not a.no_write)


if __name__ == "__main__":
    main()
