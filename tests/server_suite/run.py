"""llama.cpp's own server suite against ``llama-metaws serve`` (``make server-suite``).

1. The suite (``tools/server/tests``: unit/, utils.py, conftest.py) and the chat templates it
   reads (``models/templates``) come from the pinned llama-cpp-python sdist, fetched and
   sha256-checked as the native build fetches it, unpacked under build/server-suite/ (never
   copied into the repository).
2. Tiny stand-ins for its downloaded models are written with the gguf package (STANDINS).
3. pytest runs the suite's files with LLAMA_SERVER_BIN_PATH at our shim (``llama-server`` beside
   this file: llama-server's flags mapped onto serve) and our plugin (lmws_suite_plugin.py).
4. The count: tests passed, of those in scope, less those that assert a real model's text
   (expected_failures.txt lists every test that cannot pass, with its reason). The run fails
   when a test not listed fails.

``python tests/server_suite/run.py [-k EXPR] [FILES...]`` runs a part (unit/test_x.py, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from expected import CATEGORIES, NOT_COUNTED, load_expected, match  # noqa: E402

WORK = ROOT / "build" / "server-suite"
SUITE_DIRS = ("tools/server/tests/", "models/templates/")
SUITE_CWD = "tools/server/tests"

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)

# the stand-ins (the shim's STANDIN_BY_REPO names them): a characters vocabulary with byte
# tokens (any UTF-8 text tokenizes; ChatML's markers are text, as in the real llama2.c
# vocabularies, see llama_metaws.demo.vocab) and the words of the suite's own texts as one token each (so its prompts take about as many tokens as the real vocabularies
# give them: "Hello " * 248 fits 256), a 4096-token training context (the presets ask for up to
# 2048)
STANDINS = {
    # ggml-org/test-model-stories260K: llama.cpp falls back to ChatML for a model without a
    # template, so the stand-in carries ChatML's template (its markers tokenized as text)
    "tinyllama.gguf": dict(kind="plain", vocab="chars-bytes"),
    # ggml-org/test-model-stories260K-infill: the FIM tokens /infill needs
    "tinyllama-infill.gguf": dict(kind="plain", vocab="chars-fim"),
    # ggml-org/stories15M_MOE, the speculative tests' target: an MTP head (random) drafts for it;
    # like the story models, it does not end a text by itself (nor draft an end: test_synth_*)
    "tiny-mtp.gguf": dict(kind="mtp", vocab="chars-bytes", quiet_ends=True),
}
CONTEXT_LENGTH = 4096


def unpack_suite(dest: Path) -> Path:
    from llama_metaws.native.build import fetch_sdist
    from llama_metaws.paths import VENDOR_PREFIX, cache_root

    sdist = fetch_sdist(cache_root() / "downloads", lambda line: print(line, file=sys.stderr))
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            rel = m.name[len(VENDOR_PREFIX):] if m.name.startswith(VENDOR_PREFIX) else None
            if rel and any(rel.startswith(d) for d in SUITE_DIRS) and (m.isfile() or m.isdir()):
                m.name = rel
                members.append(m)
        try:
            tar.extractall(dest, members=members, filter="data")
        except TypeError:  # Python < 3.11.4
            tar.extractall(dest, members=members)
    return dest


def suite_words(unit: Path) -> list:
    """The words (two letters or more) in the string literals of the suite's test files."""
    import ast
    import io
    import re
    import tokenize

    words = set()
    for f in sorted(unit.glob("test_*.py")):
        for tok in tokenize.generate_tokens(io.StringIO(f.read_text()).readline):
            if tok.type != tokenize.STRING:
                continue
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):
                continue  # an f-string
            if isinstance(value, str):
                words.update(w for w in re.findall(r"[A-Za-z]+", value) if len(w) > 1)
    return sorted(words)


def write_standins(models: Path, words=()) -> None:
    from llama_metaws_dev.testing import make_tiny_model, make_tiny_mtp_model
    from llama_metaws.demo.vocab import MIN_FULL_VOCAB, word_pieces

    models.mkdir(parents=True, exist_ok=True)
    n_vocab = MIN_FULL_VOCAB + len(word_pieces(words))
    for name, spec in STANDINS.items():
        kw = dict(vocab=spec["vocab"], context_length=CONTEXT_LENGTH, chat_template=CHATML,
                  n_vocab=n_vocab, vocab_words=words)
        if spec["kind"] == "mtp":
            make_tiny_mtp_model(models / name, quiet_ends=spec.get("quiet_ends", False), **kw)
        else:
            make_tiny_model(models / name, **kw)


def suite_files(src: Path, entries) -> tuple:
    """The suite's test files to run, and those an entry leaves out whole."""
    run, left_out = [], []
    for f in sorted((src / SUITE_CWD / "unit").glob("test_*.py")):
        rel = f"unit/{f.name}"
        e = match(entries, rel)
        (left_out if e is not None and e.is_file else run).append(rel)
    return run, left_out


def count(outcomes: dict, entries) -> dict:
    """Tally the outcomes against the list: what passed, what failed as listed, what did not."""
    tally = Counter()
    by_category = Counter()
    unexpected, listed_passing = [], []
    for nodeid, outcome in sorted(outcomes.items()):
        if outcome == "deselected":
            tally["slow"] += 1
            continue
        if outcome == "skipped":  # by the suite itself (no IPv6 loopback, a known upstream bug, ...)
            tally["skipped"] += 1
            continue
        e = match(entries, nodeid)
        tally["in_scope"] += 1
        if e is not None and e.category in NOT_COUNTED:
            tally["not_counted"] += 1
        if outcome in ("passed", "xpassed"):
            tally["passed"] += 1
            if e is not None and e.pattern == nodeid:  # an exact entry: it can come off the list
                listed_passing.append(nodeid)
        elif e is not None:
            by_category[e.category] += 1
        else:
            unexpected.append(nodeid)
    counted = tally["in_scope"] - tally["not_counted"]
    passed_counted = sum(1 for n, o in outcomes.items() if o in ("passed", "xpassed")
                         and not ((e := match(entries, n)) is not None and e.category in NOT_COUNTED))
    # a listed test that passes counts as passed (and is named, to come off the list)
    return dict(tally=dict(tally), by_category=dict(by_category), unexpected=unexpected,
                listed_passing=listed_passing, counted=counted, passed_counted=passed_counted)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="suite files to run (default: all but those listed whole)")
    ap.add_argument("-k", dest="keyword", help="pytest -k expression")
    ap.add_argument("--test-timeout", type=int, default=180, help="seconds a test may run (default 180)")
    ap.add_argument("--json", type=Path, help="also write the count here")
    ap.add_argument("--tb", default="line", help="pytest's traceback style (default line)")
    args = ap.parse_args(argv)

    entries = load_expected(HERE / "expected_failures.txt")
    src = unpack_suite(WORK / "llama.cpp")
    models = WORK / "models"
    write_standins(models, suite_words(src / SUITE_CWD / "unit"))
    files, left_out = suite_files(src, entries)
    if args.files:
        files = args.files

    from llama_metaws_dev.testing import free_port

    report = WORK / "report.json"
    report.unlink(missing_ok=True)
    tmp = WORK / "tmp"
    tmp.mkdir(exist_ok=True)
    env = dict(
        os.environ,
        LLAMA_SERVER_BIN_PATH=str(HERE / "llama-server"),
        LMWS_SUITE_PYTHON=sys.executable,
        LMWS_SUITE_MODELS=str(models),
        LMWS_SUITE_REPORT=str(report),
        LMWS_SUITE_TEST_TIMEOUT=str(args.test_timeout),
        LLAMA_CACHE=str(tmp),
        PORT=str(free_port()),
        PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    cmd = [sys.executable, "-m", "pytest", "-p", "lmws_suite_plugin", "-p", "no:cacheprovider",
           "-q", "-rfE", f"--tb={args.tb}", "-m", "not slow", *files]
    if args.keyword:
        cmd += ["-k", args.keyword]
    print("server suite:", " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=src / SUITE_CWD, env=env)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    try:
        proc.wait()
    finally:
        if proc.poll() is None:  # stopped from outside: the suite stops its server, then itself
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    wall = time.time() - t0
    if not report.is_file():
        print("server suite: pytest wrote no report", file=sys.stderr)
        return 1
    outcomes = json.loads(report.read_text())
    c = count(outcomes, entries)
    t = c["tally"]
    share = c["passed_counted"] / c["counted"] if c["counted"] else 0.0

    per_file = defaultdict(Counter)
    for nodeid, outcome in outcomes.items():
        if outcome not in ("deselected", "skipped"):
            per_file[nodeid.split("::", 1)[0]]["passed" if outcome in ("passed", "xpassed") else "other"] += 1
    print("\nllama.cpp's server suite against llama-metaws serve, per file (passed / run):")
    for f in sorted(per_file):
        n = per_file[f]
        print(f"  {f:40s} {n['passed']:4d} / {n['passed'] + n['other']}")
    for f in left_out:
        e = match(entries, f)
        print(f"  {f:40s}  not run ({e.category}: {e.reason})")
    print(f"\n{t.get('in_scope', 0)} tests in scope, {t.get('passed', 0)} passed, "
          f"{t.get('skipped', 0)} skipped by the suite; {t.get('not_counted', 0)} assert a real model's text; "
          f"{t.get('slow', 0)} slow tests (real models) deselected, as llama.cpp's tests.sh does.")
    print(f"listed failures by reason: " + (", ".join(f"{k} {v}" for k, v in sorted(c['by_category'].items())) or "none"))
    print(f"server suite: {c['passed_counted']} of {c['counted']} tests that need no real model's text "
          f"pass ({100 * share:.1f}%), in {wall:.0f} s")
    if c["listed_passing"]:
        print(f"listed in expected_failures.txt but passing ({len(c['listed_passing'])}): take them off the list:")
        for n in c["listed_passing"]:
            print("  " + n)
    if c["unexpected"]:
        print(f"FAILED, not listed in expected_failures.txt ({len(c['unexpected'])}):")
        for n in c["unexpected"]:
            print("  " + n)
    if args.json:
        args.json.write_text(json.dumps(dict(c, share=share, wall_s=wall, outcomes=outcomes), indent=1))
    return 1 if c["unexpected"] else 0


if __name__ == "__main__":
    sys.exit(main())
