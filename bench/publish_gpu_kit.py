"""Write the GPU run kit's results into bench/BENCHMARKS.md (its "On a GPU" section).

    .venv/bin/python bench/publish_gpu_kit.py OUT_DIR [--no-write]

OUT_DIR is what ``run.sh`` left in ``$OUT`` (``summary.json``, ``vram.json``, ``realshape.json``):
the steps and their seconds, the machine, the CUDA subset's results, the seed's table from
``llama-metaws vram --nvidia`` (alias against private-meta per device) and the real-shape step's
table (ours and llama-server side by side; docs/gpu-kit.md says how to read it next to the seed's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _doc import publish

from llama_metaws_dev.sidebyside.report import format_markdown

MiB = 2**20


def _bytes(v):
    if v is None:
        return "-"
    return f"{v:,} B" if v < 16 * MiB else f"{v / MiB:,.1f} MiB"


def section(out: Path) -> str:
    s = json.loads((out / "summary.json").read_text())
    records = s.get("vram")
    if not isinstance(records, list) and (out / "vram.json").is_file():
        records = json.loads((out / "vram.json").read_text())
    m = s.get("machine", {})
    lines = ["## On a GPU: the seed's table on real hardware (the GPU run kit, `run.sh`)", ""]
    lines.append(f"Run of {s.get('date')} on {', '.join(m.get('gpus') or ['no GPU listed'])}, "
                 f"{m.get('cores')} cores, CPython {m.get('python')}; kit {s.get('kit', {}).get('git')} "
                 f"made {s.get('kit', {}).get('made')}. Tensor split over `{s.get('devices')}`"
                 + (f" (virtual devices: GGML_CUDA_DEVICES={s['virtual_devices']})" if s.get("virtual_devices") else "")
                 + f". CMake: `{s.get('cmake_args')}`.")
    lines += ["", "| step | status | seconds |", "|---|---|---:|"]
    lines += [f"| {st['name']} | {st['status']} | {st['seconds']:.1f} |" for st in s.get("steps", [])]
    t = s.get("tests")
    if t:
        what = "CUDA subset" if s.get("backend") == "cuda" else f"Tests ({s.get('backend')})"
        lines += ["", f"{what}: {t['tests']} tests, {t['failures']} failed, {t['errors']} errors, "
                      f"{t['skipped']} skipped, {t['seconds']} s."]
        lines += [f"- {f['kind']}: `{f['test']}`: {f['message']}" for f in t.get("failed", [])]
    if isinstance(records, list) and records:
        keys = []
        for r in records:
            for k in r.get("peak") or {}:
                if k not in keys and k not in ("weights", "kv"):
                    keys.append(k)
        lines += ["", "| configuration | result | tokens/s | draft acceptance | " +
                  " | ".join(f"peak {k}" for k in keys) + " |",
                  "|---|---|---:|---:|" + "---:|" * len(keys)]
        for r in records:
            acc, tps = r.get("draft_acceptance"), r.get("tokens_per_s")
            lines.append(f"| {r['name']} | {r['result']} | {f'{tps:.1f}' if tps else '-'} | "
                         f"{f'{acc:.1%}' if acc is not None else '-'} | "
                         + " | ".join(_bytes((r.get("peak") or {}).get(k)) for k in keys) + " |")
        by = {r["name"]: r for r in records}
        a, p = by.get("alias (tensor)"), by.get("private-meta (tensor)")
        if a and p and a["result"] == p["result"] == "ok":
            saved = [f"{k} {_bytes(p['peak'][k] - a['peak'][k])}" for k in keys
                     if k in a["peak"] and k in p["peak"] and k != "rss"]
            lines += ["", "Alias against private-meta, peak per device saved: " + ", ".join(saved) + "."]
    real = s.get("realshape")
    if not isinstance(real, dict) and (out / "realshape.json").is_file():
        real = json.loads((out / "realshape.json").read_text())
    if isinstance(real, dict):
        lines += ["", "### The real-shape step: ours and llama-server side by side (docs/gpu-kit.md)", "",
                  format_markdown(real)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the folder run.sh wrote ($OUT)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    a = ap.parse_args()
    summary = json.loads((a.out / "summary.json").read_text())
    m = summary.get("machine", {})
    where = f"{m.get('platform', '?')}, CPython {m.get('python', '?')} (the kit's machine)"
    publish("gpu_kit", section(a.out), write=not a.no_write, where=where)


if __name__ == "__main__":
    main()
