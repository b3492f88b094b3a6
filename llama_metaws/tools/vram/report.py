"""The workspace comparison's table and the plot of memory over time, from the harness's records."""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple, Union

from .harness import as_expected
from .sources import MiB, MissingExtraError


def _fmt_bytes(b: Optional[int]) -> str:
    if b is None:
        return "-"
    if b < 16 * MiB:
        return f"{b:,} B"
    return f"{b / MiB:,.1f} MiB"


_NON_DEVICE = ("weights", "kv", "rss")


def _keys(records: Sequence[dict]) -> Tuple[List[str], List[str]]:
    """(ggml compute device keys, nvml keys), in first-seen order."""
    dev, nv = [], []
    for r in records:
        for k in r.get("peak", {}):
            if k.startswith("nvml:"):
                if k not in nv:
                    nv.append(k)
            elif k not in _NON_DEVICE and k not in dev:
                dev.append(k)
    return dev, nv


def _label(key: str, records: Sequence[dict]) -> str:
    for r in records:
        if key in r.get("labels", {}):
            return r["labels"][key]
    return key


def format_table(records: Sequence[dict]) -> str:
    """The workspace comparison's table: configuration, result, tokens/s, draft acceptance, peak per device."""
    dev, nv = _keys(records)
    head = ["configuration", "result", "tokens/s", "draft acceptance"]
    head += [f"peak compute {k}" for k in dev]
    head += [f"peak used {_label(k, records)}" for k in nv]
    head += ["peak RSS"]
    rows = []
    for r in records:
        row = [r["name"], r["result"] if as_expected(r) else f"{r['result']} (UNEXPECTED)",
               f"{r['tokens_per_s']:.1f}" if r.get("tokens_per_s") else "-",
               f"{r['draft_acceptance']:.1%}" if r.get("draft_acceptance") is not None else "-"]
        row += [_fmt_bytes(r["peak"].get(k)) for k in dev + nv]
        row += [_fmt_bytes(r["peak"].get("rss"))]
        rows.append(row)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    for r in records:
        if r["result"] != "ok":
            out.append(f"{r['name']}: {r['message']}"
                       + (" (peaks: until the abort)" if r["result"] == "assert" else ""))
    out.append("compute: exact ggml accounting of the contexts' compute buffers (a meta buffer "
               "counted on each of its devices, a shared buffer once); RSS: VmRSS of the process"
               + ("; used: NVML, whole device" if nv else ""))
    return "\n".join(out)


def plot(records: Sequence[dict], path: Union[str, os.PathLike], *, keys: Optional[Sequence[str]] = None) -> str:
    """Memory over time per device, one line per configuration, prompt/decode phases shaded."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise MissingExtraError("plotting needs matplotlib, which is not installed: install the plot "
                                "extra (pip install 'llama-metaws[plot]')") from e
    if keys is None:
        dev, nv = _keys(records)
        keys = dev + nv + (["rss"] if any("rss" in r.get("peak", {}) for r in records) else [])
    if not keys:
        raise ValueError("plot: the records hold no samples")
    fig, axes = plt.subplots(len(keys), 1, figsize=(10, 2.8 * len(keys)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, key in zip(axes[:, 0], keys):
        for i, r in enumerate(records):
            c = colors[i % len(colors)]
            pts = [(t, v[key]) for t, v in r["timeline"] if key in v]
            if pts:
                label = r["name"] + (f" ({r['result']})" if r["result"] != "ok" else "")
                ax.step([p[0] for p in pts], [p[1] / MiB for p in pts], where="post", color=c, label=label)
            for ph in r.get("phases", []):
                if ph["name"] in ("prompt", "decode") and ph.get("end") is not None:
                    ax.axvspan(ph["start"], ph["end"], color=c, lw=0,
                               alpha=0.18 if ph["name"] == "prompt" else 0.06)
        title = f"compute on {key}" if key not in _NON_DEVICE and not key.startswith("nvml:") else _label(key, records)
        ax.set_title(title if key != "rss" else "process RSS")
        ax.set_ylabel("MiB")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the configuration's process started sampling")
    handles, seen = [], set()
    for ax in axes[:, 0]:  # a configuration may have no line on the first device (layer split)
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in seen:
                seen.add(label)
                handles.append(h)
    handles += [Patch(color="grey", alpha=0.35, label="prompt phase"), Patch(color="grey", alpha=0.12, label="decode phase")]
    axes[0, 0].legend(handles=handles, fontsize="small", loc="best")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110)
    plt.close(fig)
    return os.fspath(path)
