"""The side-by-side step's table (text for the run's log, Markdown for bench/BENCHMARKS.md) and the
ratios read next to the seed's figures (docs/gpu-kit.md says how to read them)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

MiB = 2**20

#: What the seed (the upstream fork's PR, docs/gpu-kit.md) measured with Qwen3.8-27B on an RTX
#: 3060 + RTX 4070 under its llama-server (-c 16384 -ub 512 -np 2, draft-mtp, the phase-aware
#: workspace): tokens/s per configuration, and the alias's saving against private meta buffers per
#: GPU; upstream llama.cpp PR 27489 reports 1,042 MiB less at its peak on one RTX 4090.
SEED_TOKENS_PER_S = {"alias (tensor)": 48.2, "private-meta (tensor)": 47.5, "alias (layer)": 44.1}
SEED_ALIAS_SAVING_MIB = 130
UPSTREAM_27489_MIB = 1042


def _keys(records: Sequence[dict]) -> Tuple[List[str], List[str]]:
    """(ggml compute keys, NVML keys) in first-seen order."""
    comp: List[str] = []
    nv: List[str] = []
    for r in records:
        for k in r.get("compute") or {}:
            if k not in comp:
                comp.append(k)
        for k in r.get("peak") or {}:
            if k.startswith("nvml:") and k not in nv:
                nv.append(k)
    return comp, nv


def _mib(v: Optional[int]) -> str:
    return "-" if v is None else f"{v / MiB:,.1f}"


def _by_name(records: Sequence[dict]) -> Dict[str, dict]:
    return {r["name"]: r for r in records if r.get("result") == "ok"}


def _ratio(a: Optional[dict], b: Optional[dict]) -> Optional[float]:
    if a and b and a.get("tokens_per_s") and b.get("tokens_per_s"):
        return a["tokens_per_s"] / b["tokens_per_s"]
    return None


def _seed_ratio(a: str, b: str) -> float:
    return SEED_TOKENS_PER_S[a] / SEED_TOKENS_PER_S[b]


def rows(doc: dict) -> Tuple[List[str], List[List[str]]]:
    """The table's head and cells: configuration, who runs it, result, tokens/s, acceptance,
    ggml compute per device key and NVML peak per GPU (MiB), peak RSS (MiB), seconds."""
    records = doc.get("records") or []
    comp, nv = _keys(records)
    head = ["configuration", "result", "tokens/s", "acceptance"]
    head += [f"compute {k}" for k in comp] + [f"peak {k}" for k in nv] + ["peak RSS", "s"]
    cells = []
    for r in records:
        tps, acc = r.get("tokens_per_s"), r.get("draft_acceptance")
        row = [r["name"], r["result"], f"{tps:.1f}" if tps else "-", f"{acc:.1%}" if acc is not None else "-"]
        row += [_mib((r.get("compute") or {}).get(k)) for k in comp]
        row += [_mib((r.get("peak") or {}).get(k)) for k in nv]
        row += [_mib((r.get("peak") or {}).get("rss")), f"{r.get('seconds') or 0:.0f}"]
        cells.append(row)
    return head, cells


def findings(doc: dict) -> List[str]:
    """The ratios, each next to the seed's where it has one."""
    by = _by_name(doc.get("records") or [])
    out = []
    alias, private = by.get("alias (tensor)"), by.get("private-meta (tensor)")
    if alias and private:
        saved = [f"{k} {(private['compute'][k] - alias['compute'][k]) / MiB:,.1f} MiB"
                 for k in alias.get("compute", {}) if k in private.get("compute", {})]
        nv = [f"{k} {(private['peak'][k] - alias['peak'][k]) / MiB:,.0f} MiB"
              for k in alias.get("peak", {}) if k.startswith("nvml:") and k in private.get("peak", {})]
        out.append("The alias against private meta buffers saves, per device, ggml compute: "
                   + (", ".join(saved) or "-") + ("; NVML peak: " + ", ".join(nv) if nv else "")
                   + f" (the seed: {SEED_ALIAS_SAVING_MIB} MiB per GPU, docs/gpu-kit.md says how the two differ; "
                   f"upstream 27489: {UPSTREAM_27489_MIB:,} MiB on one RTX 4090).")
    pairs = (
        ("alias (tensor)", "private-meta (tensor)", "tokens/s, alias / private meta buffers",
         _seed_ratio("alias (tensor)", "private-meta (tensor)")),
        ("alias (layer)", "alias (tensor)", "tokens/s, layer split / tensor split (alias)",
         _seed_ratio("alias (layer)", "alias (tensor)")),
        ("alias (tensor)", "no drafting (tensor)", "ours, draft-mtp (alias) / no drafting", None),
        ("llama-server draft-mtp (tensor)", "llama-server no drafting (tensor)",
         "llama-server, draft-mtp / no drafting", None),
        ("alias (tensor)", "llama-server draft-mtp (tensor)", "draft-mtp, ours (alias) / llama-server", None),
        ("no drafting (tensor)", "llama-server no drafting (tensor)", "no drafting, ours / llama-server", None),
    )
    for a, b, what, seed in pairs:
        r = _ratio(by.get(a), by.get(b))
        if r is not None:
            out.append(f"{what}: {r:.3f}" + (f" (the seed: {seed:.3f})" if seed else ""))
    server = by.get("llama-server draft-mtp (tensor)")
    if alias and server and server.get("compute") and alias.get("compute"):
        ours, theirs = sum(alias["compute"].values()), sum(server["compute"].values())
        same = [k for k in alias["compute"] if k in server["compute"]]
        per = "; per device, llama-server's less ours: " + ", ".join(
            f"{k} {(server['compute'][k] - alias['compute'][k]) / MiB:,.1f} MiB" for k in same) if same else ""
        out.append(f"ggml compute held with draft-mtp, all devices: ours (alias) {ours / MiB:,.1f} MiB, "
                   f"llama-server {theirs / MiB:,.1f} MiB (its target's and draft's last reservations, each "
                   f"private){per}.")
    return out


def format_text(doc: dict) -> str:
    """The table and the findings as plain text (the run's log, report.py)."""
    head, cells = rows(doc)
    widths = [max(len(x) for x in col) for col in zip(head, *cells)] if cells else [len(h) for h in head]
    line = lambda cs: "  ".join(c.ljust(w) for c, w in zip(cs, widths)).rstrip()  # noqa: E731
    out = [_headline(doc), line(head), line(["-" * w for w in widths])] + [line(c) for c in cells]
    out += [f"- {f}" for f in findings(doc)]
    return "\n".join(out)


def format_markdown(doc: dict) -> str:
    """The table and the findings as bench/BENCHMARKS.md takes them (bench/publish_gpu_kit.py)."""
    head, cells = rows(doc)
    right = {i for i, h in enumerate(head) if i >= 2}
    out = [_headline(doc), "", "| " + " | ".join(head) + " |",
           "|" + "|".join("---:" if i in right else "---" for i in range(len(head))) + "|"]
    out += ["| " + " | ".join(c) + " |" for c in cells]
    notes = sorted({n for r in doc.get("records") or [] for n in r.get("notes") or []})
    failed = [f"- {r['name']}: {r['result']}: {r.get('message', '')}" for r in doc.get("records") or []
              if r.get("result") != "ok"]
    out += [""] + [f"- {f}" for f in findings(doc)] + failed + [f"- note: {n}" for n in notes]
    return "\n".join(out)


def _headline(doc: dict) -> str:
    s, m = doc.get("shape") or {}, doc.get("model") or {}
    if doc.get("error"):
        return f"Real-shape step: {doc['error']}"
    return (f"Real-shape step: make_mtp_model's qwen35, {s.get('name')} shape (vocabulary {s.get('n_vocab'):,}, "
            f"width {s.get('n_embd')}, FFN {s.get('n_ff')}), {doc.get('n_layer')} layers + 1 NextN, "
            f"{doc.get('dtype')} ({(m.get('bytes') or 0) / 2**30:.2f} GiB, written in {m.get('seconds', '-')} s); "
            f"devices {','.join(doc.get('devices') or [])}; -c {doc['settings']['n_ctx']} "
            f"-ub {doc['settings']['n_ubatch']} -np {doc['settings']['n_parallel']} --draft-max "
            f"{doc['settings']['draft_max']}; --spec-synth-len {doc.get('synth_len'):g} "
            f"({doc.get('acceptance', 0):.0%} acceptance); {doc['settings']['warmup']} warm-up + "
            f"{doc['settings']['requests']} measured requests of {doc['settings']['prompt_tokens']} prompt tokens and "
            f"{doc['settings']['n_predict']} generated; step {doc.get('seconds', 0):.0f} s of "
            f"{doc.get('budget_s', 0):.0f}" + (f"; cut: {', '.join(doc['cut'])}" if doc.get("cut") else "") + ".")
