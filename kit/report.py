"""The GPU run kit's report: summary.json from what run.sh left, and a short table.

Standard library only: it runs even when the install step failed. It reads the kit's
MANIFEST.json, the steps' times (steps.tsv: name, exit status, seconds), pytest's junit.xml,
``llama-metaws vram --json``'s records and the real-shape step's ``realshape.json``, and writes
``summary.json`` into the output folder.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET

MiB = 2**20


def _steps(path):
    out = []
    if os.path.isfile(path):
        for line in open(path):
            parts = line.rstrip("\n").split("\t")
            if len(parts) == 3:
                out.append({"name": parts[0], "rc": int(parts[1]), "seconds": float(parts[2]),
                            "status": "ok" if parts[1] == "0" else "failed"})
    return out


def _tests(path):
    if not os.path.isfile(path):
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["seconds"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    failed = []
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            el = case.find(tag)
            if el is not None:
                msg = (el.get("message") or el.text or "").strip().splitlines()
                failed.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": tag,
                               "message": msg[0][:300] if msg else ""})
    counts["failed"] = failed
    return counts


def _vram(path):
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return None
    try:
        records = json.load(open(path))
    except ValueError as e:
        return {"error": f"vram.json is not JSON: {e}"}
    rows = []
    for r in records:
        rows.append({k: r.get(k) for k in ("name", "result", "expected", "message", "tokens_per_s",
                                           "prompt_tokens_per_s", "draft_acceptance", "peak", "labels",
                                           "notes", "seconds")})
    return rows


def _realshape(path):
    """The real-shape step's document (its rows, the table as text), or None when it did not run."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return None
    try:
        return json.load(open(path))
    except ValueError as e:
        return {"error": f"realshape.json is not JSON: {e}"}


def _table(rows):
    keys = []
    for r in rows:
        for k in (r.get("peak") or {}):
            if k not in keys and k not in ("weights", "kv"):
                keys.append(k)
    head = ["configuration", "result", "tokens/s", "acceptance"] + [f"peak {k} (MiB)" for k in keys]
    lines = []
    for r in rows:
        acc = r.get("draft_acceptance")
        tps = r.get("tokens_per_s")
        cells = [r["name"], r["result"], f"{tps:.1f}" if tps else "-", f"{acc:.1%}" if acc is not None else "-"]
        cells += [f"{(r.get('peak') or {}).get(k, 0) / MiB:.3f}" if k in (r.get("peak") or {}) else "-" for k in keys]
        lines.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head, *lines)] if lines else [len(h) for h in head]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in lines])


def _gpus():
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        return [line.strip() for line in res.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.TimeoutExpired):
        return []


def main(argv=None):
    p = argparse.ArgumentParser(prog="report.py")
    for a in ("--kit", "--work", "--out", "--backend", "--devices", "--steps"):
        p.add_argument(a, required=True)
    p.add_argument("--budget", type=float)
    args = p.parse_args(argv)
    manifest = {}
    mpath = os.path.join(args.kit, "MANIFEST.json")
    if os.path.isfile(mpath):
        manifest = json.load(open(mpath))
    cmake_args = ""
    if os.path.isfile(os.path.join(args.work, "cmake_args")):
        cmake_args = open(os.path.join(args.work, "cmake_args")).read().strip()
    steps = _steps(args.steps)
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kit": {k: manifest.get(k) for k in ("made", "git", "llama_metaws", "format")},
        "backend": args.backend,
        "devices": args.devices,
        "virtual_devices": os.environ.get("GGML_CUDA_DEVICES"),
        "cmake_args": cmake_args,
        "machine": {"platform": platform.platform(), "cores": os.cpu_count(), "python": sys.version.split()[0],
                    "gpus": _gpus()},
        "budget_s": args.budget,
        "steps": steps,
        "total_s": round(sum(s["seconds"] for s in steps), 1),
        "ok": all(s["rc"] == 0 for s in steps),
        "tests": _tests(os.path.join(args.out, "junit.xml")),
        "vram": _vram(os.path.join(args.out, "vram.json")),
        "realshape": _realshape(os.path.join(args.out, "realshape.json")),
    }
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    print("steps: " + ", ".join(f"{s['name']} {s['status']} {s['seconds']:.1f} s" for s in steps))
    t = summary["tests"]
    if t:
        print(f"tests: {t['tests']} run, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped "
              f"in {t['seconds']} s")
        for f_ in t["failed"]:
            print(f"  {f_['kind']}: {f_['test']}: {f_['message']}")
    v = summary["vram"]
    if isinstance(v, list) and v:
        print(_table(v))
    elif isinstance(v, dict):
        print(v["error"])
    r = summary["realshape"]
    if r:
        print(r.get("table") or r.get("error") or "")
    print(f"summary: {os.path.join(args.out, 'summary.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
