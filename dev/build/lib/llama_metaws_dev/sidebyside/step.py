"""The side-by-side step: the model written, then each configuration in its own process, in order,
within the step's deadline, the record file rewritten after each one.

Configurations, most wanted first (a run that runs out of time loses the last ones, never the
earlier ones): ours with MTP drafting under tensor split with the alias, then with private meta
buffers, ours without drafting, llama-server with draft-mtp and without drafting, ours with MTP
drafting under layer split. Every drafting configuration runs at the same synthetic acceptance
(``--spec-synth-len``, llama-server's own flag, which our engine mirrors).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Union

from llama_metaws.tools.vram.harness import Configuration, run_configuration
from .server import ServerConfiguration, on_devices, run_server_configuration
from .shapes import SHAPES, Costs, Shape, choose_layers, estimated_bytes, write_model

Progress = Callable[[str], None]
Row = Union[Configuration, ServerConfiguration]

FORMAT = 1
#: The rows, in the order they run (see the module's docstring).
ROWS: Sequence[Row] = (
    Configuration("alias (tensor)", "tensor", "alias"),
    Configuration("private-meta (tensor)", "tensor", "private-meta"),
    Configuration("no drafting (tensor)", "tensor", "off", draft=False),
    ServerConfiguration("llama-server draft-mtp (tensor)", draft=True),
    ServerConfiguration("llama-server no drafting (tensor)", draft=False),
    Configuration("alias (layer)", "layer", "alias"),
)
#: Below this many seconds left, a row is not started (it could not load the model).
MIN_ROW_S = 10.0


@dataclasses.dataclass
class Settings:
    """The step's arguments (``python -m llama_metaws_dev.sidebyside --help``)."""

    work: Path
    out: Path
    devices: List[str]
    shape: Shape
    n_layer: Optional[int] = None      # None: as many as the budget allows
    dtype: str = "q8_0"
    acceptance: float = 0.75           # the seed's draft acceptance
    draft_max: int = 3
    n_predict: int = 128
    requests: int = 2
    warmup: int = 1
    prompt_tokens: int = 64
    n_ctx: int = 16384                 # the seed's -c 16384 -ub 512 -np 2
    n_ubatch: int = 512
    n_parallel: int = 2
    budget_s: float = 240.0
    nvidia: bool = False
    server: Optional[Path] = None      # llama-server; None: the tools build's, if any
    threads: Optional[int] = None      # None: half the cores (the binding's default), on both servers
    rows: Optional[List[str]] = None   # names (None: all of ROWS)
    seed: int = 1

    @property
    def synth_len(self) -> float:
        """The mean acceptance length (the target's token included) whose geometric rates accept
        ``acceptance`` of ``draft_max``-token drafts: ``1 + acceptance x draft_max``."""
        return 1.0 + self.acceptance * self.draft_max

    @property
    def n_batch(self) -> int:
        """A logical batch that holds a request (compute follows ``n_ubatch``), for both servers."""
        return min(self.n_ctx, max(self.n_ubatch, self.prompt_tokens + self.n_predict + self.draft_max + 1))


def _stderr(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)


def _free_device_bytes(devices: Sequence[str], nvidia: bool) -> Optional[int]:
    """Memory free where the weights go: NVML's free bytes over every GPU (the devices may name
    one GPU twice, or virtual ones), else the host's MemAvailable for CPU devices."""
    if nvidia and on_devices(devices):
        from llama_metaws.tools.vram.sources import import_pynvml

        nv = import_pynvml()
        try:
            nv.nvmlInit()
        except Exception:  # no figure: the layer count then follows the time alone
            return None
        try:
            return sum(int(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(i)).free)
                       for i in range(int(nv.nvmlDeviceGetCount())))
        except Exception:
            return None
        finally:
            nv.nvmlShutdown()
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _prompt(settings: Settings) -> List[int]:
    """The prompt: tokens along the model's successor cycle (any valid ids would do at a
    synthetic acceptance; these are the ones the model continues as designed)."""
    from llama_metaws.demo.realshape import mtp_model_plan

    cycle = mtp_model_plan(settings.acceptance, n_vocab=settings.shape.n_vocab,
                           n_embd=settings.shape.n_embd)["cycle"]
    return [int(cycle[i % len(cycle)]) for i in range(settings.prompt_tokens)]


def _find_server(settings: Settings) -> Optional[Path]:
    if settings.server is not None:
        return settings.server
    from ..tools_build import find_tools

    found = find_tools()
    return found["llama-server"] if found else None


def _write(doc: dict, out: Path) -> None:
    """The document with its table as text (``table``: what the kit's report.py prints), atomically."""
    from .report import format_text

    doc["table"] = format_text(dict(doc, table=None))
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, out)


def _ours_record(r: dict) -> dict:
    r = {k: v for k, v in r.items() if k not in ("timeline", "phases")}
    r["kind"] = "ours"
    r["compute"] = {k: v for k, v in r.get("peak", {}).items()
                    if not k.startswith("nvml:") and k not in ("rss", "kv", "weights")}
    return r


def _skipped(row: Row, result: str, why: str) -> dict:
    """A row that did not run (``result``: ``"cut"`` by the deadline, ``"missing"`` llama-server)."""
    kind = "llama-server" if isinstance(row, ServerConfiguration) else "ours"
    return {"name": row.name, "kind": kind, "result": result, "message": why, "expected": "ok",
            "tokens_per_s": None, "draft_acceptance": None, "peak": {}, "compute": {}, "labels": {},
            "notes": [], "config": dataclasses.asdict(row), "seconds": 0.0}


def _layer_count(settings: Settings, n_rows: int, doc: dict) -> int:
    """The layers given, else as many as the budget, the device memory and the disk allow
    (``doc["choice"]`` says which and why; 0: none fits the memory)."""
    if settings.n_layer:
        doc["choice"] = {"n_layer": settings.n_layer, "given": True,
                         "bytes": estimated_bytes(settings.shape, settings.n_layer, settings.dtype)}
        return settings.n_layer
    models = Path(settings.work) / "models"
    models.mkdir(parents=True, exist_ok=True)
    doc["choice"] = choose_layers(
        settings.shape, settings.budget_s, n_configs=n_rows,
        tokens=(settings.warmup + settings.requests) * settings.n_predict, dtype=settings.dtype,
        free_bytes=_free_device_bytes(settings.devices, settings.nvidia), free_disk=shutil.disk_usage(models).free,
        costs=Costs())
    return doc["choice"]["n_layer"]


def _run_row(row: Row, settings: Settings, *, model: Path, tokens: List[int], server: Optional[Path], threads: int,
             timeout: float) -> dict:
    """One row in its own process: the vram harness's child for ours, llama-server for theirs."""
    common = dict(n_predict=settings.n_predict, n_ctx=settings.n_ctx, n_ubatch=settings.n_ubatch,
                  n_batch=settings.n_batch, draft_max=settings.draft_max, requests=settings.requests,
                  warmup=settings.warmup, nvidia=settings.nvidia, threads=threads, timeout=timeout)
    if isinstance(row, ServerConfiguration):
        logs = settings.out.parent / "sidebyside-logs"
        logs.mkdir(parents=True, exist_ok=True)
        return run_server_configuration(row, server=server, model=model, devices=settings.devices, tokens=tokens,
                                        n_parallel=settings.n_parallel, seed=settings.seed,
                                        synth_len=settings.synth_len if row.draft else None,
                                        log=logs / f"{row.name.split(' (')[0].replace(' ', '-')}.log", **common)
    return _ours_record(run_configuration(row, model=str(model), devices=settings.devices, prompt=tokens,
                                          n_seq_max=settings.n_parallel, flash_attn=True, seed=settings.seed,
                                          synth_len=settings.synth_len, **common))


def _said(rec: dict) -> str:
    if rec["result"] in ("cut", "missing"):
        return rec["message"]
    tps, acc = rec.get("tokens_per_s"), rec.get("draft_acceptance")
    return (f"{rec['result']} in {rec.get('seconds', 0):.1f} s" + (f", {tps:.1f} t/s" if tps else "")
            + (f", acceptance {acc:.1%}" if acc is not None else "")
            + (f": {rec['message']}" if rec["result"] != "ok" else ""))


def _fail(doc: dict, settings: Settings, progress: Progress, error: str) -> dict:
    doc["error"] = error
    _write(doc, settings.out)
    progress(f"side by side: {error}")
    return doc


def run_step(settings: Settings, progress: Progress = _stderr) -> dict:
    """Write (or find) the model, run the rows within ``settings.budget_s``; returns the record
    document, also written to ``settings.out`` after every row."""
    t0 = time.monotonic()
    deadline = t0 + settings.budget_s
    rows = [r for r in ROWS if settings.rows is None or r.name in settings.rows]
    threads = settings.threads or max(1, (os.cpu_count() or 2) // 2)  # the same on both servers
    doc = {"format": FORMAT, "shape": dataclasses.asdict(settings.shape), "dtype": settings.dtype,
           "devices": settings.devices, "budget_s": settings.budget_s, "synth_len": settings.synth_len,
           "acceptance": settings.acceptance, "threads": threads, "n_batch": settings.n_batch,
           "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(settings).items()
                        if k not in ("shape", "work", "out")},
           "records": [], "cut": [], "ok": False}
    settings.out.parent.mkdir(parents=True, exist_ok=True)

    n_layer = doc["n_layer"] = _layer_count(settings, len(rows), doc)
    if not n_layer:
        return _fail(doc, settings, progress, "no layer count fits the device memory: "
                     + "; ".join(doc["choice"]["why"]))
    progress(f"side by side: {settings.shape.name} shape (vocab {settings.shape.n_vocab}, width "
             f"{settings.shape.n_embd}, FFN {settings.shape.n_ff}), {n_layer} layers + 1 NextN, {settings.dtype}; "
             f"{len(rows)} rows, budget {settings.budget_s:.0f} s, synthetic acceptance length "
             f"{settings.synth_len:g} ({settings.acceptance:.0%} of {settings.draft_max}-token drafts)")
    t = time.monotonic()
    try:
        model = write_model(settings.work, settings.shape, n_layer, settings.dtype, agreement=settings.acceptance)
    except Exception as e:  # the rows cannot run without it: said in the record
        return _fail(doc, settings, progress, f"writing the model failed: {type(e).__name__}: {e}")
    doc["model"] = {"path": str(model), "bytes": model.stat().st_size, "seconds": round(time.monotonic() - t, 1)}
    progress(f"side by side: model {model.name}: {model.stat().st_size / 2**30:.2f} GiB in "
             f"{doc['model']['seconds']:.1f} s")
    _write(doc, settings.out)

    tokens, server = _prompt(settings), _find_server(settings)
    for i, row in enumerate(rows, 1):
        left = deadline - time.monotonic()
        if left < MIN_ROW_S:
            rec = _skipped(row, "cut", f"cut: {max(0.0, left):.0f} s left of the step's {settings.budget_s:.0f} s")
            doc["cut"].append(row.name)
        elif isinstance(row, ServerConfiguration) and server is None:
            rec = _skipped(row, "missing", "not run: no llama-server (llama-metaws build --tools)")
        else:
            progress(f"[{i}/{len(rows)}] {row.name}: running ({left:.0f} s left) ...")
            rec = _run_row(row, settings, model=model, tokens=tokens, server=server, threads=threads, timeout=left)
        progress(f"[{i}/{len(rows)}] {row.name}: {_said(rec)}")
        doc["records"].append(rec)
        doc["seconds"] = round(time.monotonic() - t0, 1)
        _write(doc, settings.out)
    doc["ok"] = all(r["result"] == "ok" for r in doc["records"])
    doc["seconds"] = round(time.monotonic() - t0, 1)
    _write(doc, settings.out)
    return doc
