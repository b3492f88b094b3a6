"""The workspace comparison's configurations, each run in its own process: the child's run and the parent's record."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from ..children import find_assert, run_child
from .sampler import DEFAULT_INTERVAL, Sampler
from .sources import Sample, SamplerError

DEFAULT_PROMPT = "the quick brown fox jumps over the lazy dog. " * 5
DEFAULT_DEVICES = ("CPU", "CPU")


@dataclasses.dataclass(frozen=True)
class Configuration:
    """One row of the table: how the model is split and how the contexts share compute."""

    name: str
    split_mode: str = "tensor"      # "none" | "layer" | "row" | "tensor"
    workspace_mode: str = "alias"   # "off" (no workspace) | "alias" | "private-meta" | "unsafe-shared"
    expected: str = "ok"            # "ok" | "assert"
    draft: bool = True              # MTP drafting (False: the target alone, no workspace)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


DEFAULT_CONFIGURATIONS: Tuple[Configuration, ...] = (
    Configuration("no workspace (tensor)", "tensor", "off"),
    Configuration("unsafe-shared (tensor)", "tensor", "unsafe-shared", expected="assert"),
    Configuration("private-meta (tensor)", "tensor", "private-meta"),
    Configuration("alias (tensor)", "tensor", "alias"),
    Configuration("alias (layer)", "layer", "alias"),
)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def find_configuration(name: str) -> Configuration:
    """A default configuration by name (``"alias (tensor)"``) or slug (``"alias-tensor"``)."""
    for c in DEFAULT_CONFIGURATIONS:
        if name == c.name or _slug(name) == _slug(c.name):
            return c
    raise ValueError(f"unknown configuration {name!r}; choose from: "
                     + ", ".join(repr(c.name) for c in DEFAULT_CONFIGURATIONS))


def as_expected(record: dict) -> bool:
    return record.get("result") == record.get("expected", "ok")


# --------------------------------------------------------------------------------------------
# the child: one configuration in this process


class _Events:
    """JSON lines into a file, flushed one by one: what an aborted child leaves is kept."""

    def __init__(self, path: str):
        self.f = open(path, "a", buffering=1, encoding="utf-8")
        self.lock = threading.Lock()

    def __call__(self, kind: str, **payload) -> None:
        line = json.dumps(dict(payload, type=kind))
        with self.lock:
            self.f.write(line + "\n")
            self.f.flush()

    def close(self) -> None:
        self.f.close()


def _prompt_tokens(model: str, prompt) -> List[int]:
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    from ...native.binding import llama_cpp

    vocab = llama_cpp.Llama(model, vocab_only=True, verbose=False)
    try:
        return list(vocab.tokenize(prompt.encode("utf-8"), add_bos=True, special=False))
    finally:
        vocab.close()


def _run_child(req: dict, emit: _Events) -> None:
    import llama_metaws  # noqa: F401  (the patched build, before llama_cpp)

    cfg = Configuration(**req["config"])
    tokens = _prompt_tokens(req["model"], req["prompt"])
    n_predict, draft_max = int(req["n_predict"]), int(req["draft_max"])
    n_ctx, n_ubatch = int(req["n_ctx"]), int(req["n_ubatch"])
    warmup = int(req.get("warmup") or 0)  # requests run first and left out of the figures
    # by default one logical batch holds the whole request (compute buffers follow n_ubatch,
    # not n_batch)
    n_batch = req.get("n_batch") or min(n_ctx, max(n_ubatch, len(tokens) + n_predict + draft_max + 1))
    shared = cfg.draft and cfg.workspace_mode != "off"
    kw = dict(draft="mtp" if cfg.draft else None, draft_max=draft_max, devices=list(req["devices"]),
              split_mode=cfg.split_mode, n_seq_max=int(req["n_seq_max"]), n_ctx=n_ctx, n_batch=int(n_batch),
              n_ubatch=n_ubatch, phase_aware_workspace=shared,
              workspace_mode=cfg.workspace_mode if shared else "alias",
              allow_unsafe_workspace=cfg.workspace_mode == "unsafe-shared", verbose=False)
    if req.get("threads"):
        kw["n_threads"] = kw["n_threads_batch"] = int(req["threads"])
    if cfg.draft and req.get("synth_len") is not None:  # llama-server's --spec-synth-len
        kw["draft_synth_len"] = float(req["synth_len"])
    for key in ("flash_attn", "seed"):
        if req.get(key) is not None:
            kw[key] = req[key]
    emit("start", config=cfg.to_dict(), prompt_tokens=len(tokens), n_batch=int(n_batch))

    sampler = Sampler(req["interval"], nvidia=bool(req.get("nvidia")),
                      on_sample=lambda t, v: emit("sample", t=t, values=v),
                      on_phase=lambda p: emit("phase", **p))
    sampler.start()
    emit("labels", labels=sampler.report(raise_error=False).labels)  # kept if the process dies
    from ...engine.buffers import compute_buffers
    from ...api.llama import Llama

    sampler.mark("load")
    llm = Llama(req["model"], **kw)
    try:
        sampler.watch(llm)
        emit("snapshot", at="load", target=[dataclasses.asdict(b) for b in compute_buffers(llm._ctx)],
             draft=[dataclasses.asdict(b) for b in compute_buffers(llm._draft_ctx)] if llm._draft_ctx else [],
             workspace=[dataclasses.asdict(e) for e in llm.workspace_stats()])
        sampler.end_phase()
        timings = []
        for i in range(warmup + int(req["requests"])):
            if req.get("seed") is not None:  # a seed per request: synthetic acceptance draws anew
                llm.set_seed(int(req["seed"]) + i)
            sampler.mark("prompt")
            gen = llm.generate(tokens, temp=0.0)
            try:
                for i, _tok in enumerate(gen):
                    if i == 0:
                        sampler.mark("decode")
                    if i + 1 >= n_predict:
                        break
            finally:
                gen.close()
            sampler.end_phase()
            t = llm.timings()
            if i >= warmup:
                timings.append(t)
            emit("request", timings=t, warmup=i < warmup)
        drafted = sum(t.get("draft_n") or 0 for t in timings)
        acceptance = sum(t.get("draft_n_accepted") or 0 for t in timings) / drafted if drafted else None
    finally:
        llm.close()  # unwatches first: the compute figures drop to 0
    try:
        report = sampler.stop()
        error = None
    except SamplerError as e:
        report, error = e.report, str(e)
    dec_tokens = sum(t["decode_tokens"] for t in timings)
    dec_time = sum(t["predicted_ms"] / 1e3 for t in timings if t["decode_tokens_per_s"])
    pre_tokens = sum(t["prompt_tokens_per_s"] * t["prompt_ms"] / 1e3 for t in timings)  # the prompt phases'
    pre_time = sum(t["prompt_ms"] / 1e3 for t in timings if t["prompt_tokens_per_s"])
    emit("result", tokens_per_s=dec_tokens / dec_time if dec_time else None,
         prompt_tokens_per_s=pre_tokens / pre_time if pre_time else None,
         draft_acceptance=acceptance, peak=report.peak, labels=report.labels, notes=report.notes,
         timer_samples=report.timer_samples, sampler_error=error)


def child_main(events_path: str) -> int:
    req = json.load(sys.stdin)
    emit = _Events(events_path)
    try:
        _run_child(req, emit)
    except Exception as e:  # a clean failure: reported, not an abort
        emit("error", message=f"{type(e).__name__}: {e}")
        print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        emit.close()
    return 0


# --------------------------------------------------------------------------------------------
# the parent: one subprocess per configuration

def _read_events(path: str) -> List[dict]:
    out = []
    with contextlib.suppress(FileNotFoundError):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line cut by an abort
    return out


def _peak(timeline: Iterable[Sample]) -> Dict[str, int]:
    peak: Dict[str, int] = {}
    for _t, values in timeline:
        for k, v in values.items():
            if v > peak.get(k, -1):
                peak[k] = v
    return peak


def run_configuration(config: Configuration, *, model: str, devices: Sequence[str] = DEFAULT_DEVICES,
                      prompt: Union[str, Sequence[int]] = DEFAULT_PROMPT, n_predict: int = 32,
                      interval: float = DEFAULT_INTERVAL, n_seq_max: int = 2, n_ctx: int = 512,
                      n_ubatch: int = 64, n_batch: Optional[int] = None, draft_max: int = 3,
                      requests: int = 2, nvidia: bool = False, threads: Optional[int] = None,
                      timeout: float = 600, warmup: int = 0, synth_len: Optional[float] = None,
                      flash_attn: Optional[bool] = None, seed: Optional[int] = None) -> dict:
    """One configuration in a subprocess: its record (see :func:`run_configurations`).

    ``warmup``: requests run before the ``requests`` measured (their tokens/s and acceptance
    left out; memory is sampled throughout); ``synth_len``: llama-server's synthetic acceptance
    (``--spec-synth-len``) for a drafting configuration; ``flash_attn``: the ``Llama`` argument
    (None: its default); ``seed``: the first request's seed, each next one's one more (None: the
    ``Llama``'s own)."""
    with tempfile.TemporaryDirectory(prefix="llama-metaws-vram-") as tmp:
        events_path = os.path.join(tmp, "events.jsonl")
        req = dict(config=config.to_dict(), model=os.fspath(model), devices=list(devices),
                   prompt=prompt if isinstance(prompt, str) else [int(t) for t in prompt],
                   n_predict=n_predict, interval=interval, n_seq_max=n_seq_max, n_ctx=n_ctx,
                   n_ubatch=n_ubatch, n_batch=n_batch, draft_max=draft_max, requests=requests,
                   nvidia=nvidia, threads=threads, warmup=warmup, synth_len=synth_len,
                   flash_attn=flash_attn, seed=seed)
        cmd = [sys.executable, "-m", "llama_metaws.tools.vram", "--child", events_path]
        t0 = time.perf_counter()
        child = run_child(cmd, input=json.dumps(req), timeout=timeout)
        rc, stderr = child.returncode, child.stderr
        elapsed = time.perf_counter() - t0
        events = _read_events(events_path)

    timeline = [(e["t"], e["values"]) for e in events if e["type"] == "sample"]
    phases: Dict[tuple, dict] = {}
    for e in events:
        if e["type"] == "phase":
            phases[(e["name"], e["start"])] = {"name": e["name"], "start": e["start"], "end": e["end"]}
    last_t = timeline[-1][0] if timeline else 0.0
    phase_list = [dict(p, end=p["end"] if p["end"] is not None else max(last_t, p["start"]))
                  for p in sorted(phases.values(), key=lambda p: p["start"])]
    result = next((e for e in events if e["type"] == "result"), None)
    error = next((e for e in events if e["type"] == "error"), None)
    snapshot = next((e for e in events if e["type"] == "snapshot"), None)
    start = next((e for e in events if e["type"] == "start"), {})
    labels = next((e["labels"] for e in events if e["type"] == "labels"), {})

    record = {
        "name": config.name, "result": "ok", "message": "", "expected": config.expected,
        "tokens_per_s": None, "prompt_tokens_per_s": None, "draft_acceptance": None,
        "peak": _peak(timeline), "timeline": [[t, v] for t, v in timeline], "phases": phase_list,
        "labels": labels, "notes": [], "config": config.to_dict(), "seconds": round(elapsed, 3),
        "prompt_tokens": start.get("prompt_tokens"),
        "snapshot": {k: v for k, v in (snapshot or {}).items() if k != "type"} or None,
    }
    if result is not None:
        record.update(tokens_per_s=result["tokens_per_s"], prompt_tokens_per_s=result["prompt_tokens_per_s"],
                      draft_acceptance=result["draft_acceptance"], labels=result["labels"], notes=result["notes"])
    if rc == 0 and result is not None and not result.get("sampler_error"):
        record["message"] = f"{record['prompt_tokens']} prompt tokens, {n_predict} generated, {requests} request(s)"
        return record
    died_on = find_assert(stderr)
    if rc is None:
        record.update(result="error", message=f"timed out after {timeout:g} s")
    elif result is not None and result.get("sampler_error"):
        record.update(result="error", message=result["sampler_error"])
    elif died_on:
        record.update(result="assert", message=died_on)
        record["notes"] = record["notes"] + ["the process aborted: the figures are those sampled until then"]
    else:
        tail = [ln for ln in (stderr or "").strip().splitlines() if ln.strip()]
        msg = error["message"] if error else (tail[-1] if tail else f"exit status {rc}")
        record.update(result="error", message=msg)
    return record


def _stderr_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_configurations(configs: Optional[Sequence[Union[str, Configuration]]] = None, *,
                       model: Optional[str] = None, devices: Sequence[str] = DEFAULT_DEVICES,
                       prompt: Union[str, Sequence[int]] = DEFAULT_PROMPT, n_predict: int = 32,
                       interval: float = DEFAULT_INTERVAL, progress: Optional[Callable[[str], None]] = _stderr_progress,
                       **kw) -> List[dict]:
    """Each configuration in its own subprocess (so peaks do not mix); one record each.

    ``configs``: :class:`Configuration` objects or default names (None: all of
    :data:`DEFAULT_CONFIGURATIONS`). ``model``: a GGUF with NextN layers (None: the tiny
    agreement model, written into a temporary directory). Other keywords: ``n_seq_max`` (2),
    ``n_ctx`` (512), ``n_ubatch`` (64), ``n_batch`` (None: enough for the request),
    ``draft_max`` (3), ``requests`` (2), ``nvidia`` (False), ``threads``, ``timeout`` (600 s).

    A record: ``name``, ``result`` (``"ok"``, ``"assert"`` when the process died on a
    ``GGML_ASSERT``, ``"error"`` for any other failure), ``message`` (the assert text, e.g.
    ``"ggml-backend.cpp:350: GGML_ASSERT(tensor) failed"``), ``tokens_per_s`` (decode, over
    the requests), ``draft_acceptance``, ``peak`` (key -> bytes, see docs/vram.md),
    ``timeline`` (``[t, {key: bytes}]`` samples), ``phases`` (``{name, start, end}``), and
    ``expected``, ``prompt_tokens_per_s``, ``labels``, ``notes``, ``config``, ``snapshot``
    (compute buffers and workspace entries right after load), ``seconds``.
    """
    chosen = [c if isinstance(c, Configuration) else find_configuration(c)
              for c in (configs if configs else DEFAULT_CONFIGURATIONS)]
    progress = progress or (lambda line: None)
    with tempfile.TemporaryDirectory(prefix="llama-metaws-vram-model-") as tmp:
        if model is None:
            from ...demo.model import make_tiny_mtp_model

            model = os.fspath(make_tiny_mtp_model(os.path.join(tmp, "tiny-mtp-agreement-0.8.gguf"), agreement=0.8))
            progress(f"model: the tiny agreement MTP model ({model})")
        records = []
        for i, c in enumerate(chosen, 1):
            progress(f"[{i}/{len(chosen)}] {c.name}: running ...")
            r = run_configuration(c, model=model, devices=devices, prompt=prompt, n_predict=n_predict,
                                  interval=interval, **kw)
            mark = "as expected" if as_expected(r) else f"UNEXPECTED (expected {r['expected']})"
            progress(f"[{i}/{len(chosen)}] {c.name}: {r['result']} in {r['seconds']:.1f} s, {mark}"
                     + (f": {r['message']}" if r["result"] != "ok" else ""))
            records.append(r)
    return records
