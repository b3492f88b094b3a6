"""The sampler: memory per device over time, with phases (prompt, decode) and exact ggml peaks."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

from .probe import DECODE_HOOK, ContextGroup
from .sources import NvmlSource, Sample, SamplerError, read_rss

DEFAULT_INTERVAL = 0.2


@dataclasses.dataclass
class Report:
    """What a :class:`Sampler` saw: peaks, the timeline, the phases."""

    peak: Dict[str, int]
    timeline: List[Sample]
    phases: List[dict]
    labels: Dict[str, str]
    notes: List[str]
    timer_samples: int
    error: Optional[str] = None

    def to_dict(self) -> dict:
        return {"peak": dict(self.peak), "timeline": [[t, dict(v)] for t, v in self.timeline],
                "phases": [dict(p) for p in self.phases], "labels": dict(self.labels),
                "notes": list(self.notes), "timer_samples": self.timer_samples, "error": self.error}


class Sampler:
    """Memory per device over time: a background thread every ``interval`` seconds, plus ggml.

    ``nvidia=True`` reads every NVIDIA GPU through pynvml (the ``nvidia`` extra); ``rss``
    reads ``VmRSS``. :meth:`watch` adds a ``Llama`` (or contexts, a workspace, a model) whose
    ggml figures are read in the decoding thread after each ``llama_decode`` (see
    docs/vram.md). :meth:`mark` starts a named phase (``"prompt"``, ``"decode"``, ...), which
    ends at the next mark, at :meth:`end_phase` or at :meth:`stop`; :meth:`phase` is the same
    as a context manager. ``on_sample(t, values)`` and ``on_phase(phase)`` are called for
    every sample and phase change as they happen (under the sampler's lock).

    The timeline holds one ``(t, {key: bytes})`` sample per tick of the thread and one per
    change of the ggml figures; ``t`` is seconds since :meth:`start`. Every sample holds
    every key seen so far (a ggml key whose contexts were unwatched reads 0).
    """

    def __init__(self, interval: float = DEFAULT_INTERVAL, *, nvidia: bool = False, rss: bool = True,
                 on_sample: Optional[Callable[[float, Dict[str, int]], None]] = None,
                 on_phase: Optional[Callable[[dict], None]] = None):
        if not interval > 0:
            raise ValueError(f"interval must be > 0 seconds, got {interval!r}")
        self.interval = float(interval)
        self.nvidia = nvidia
        self.rss = rss and os.path.exists("/proc/self/status")
        self.on_sample = on_sample
        self.on_phase = on_phase
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._nvml: Optional[NvmlSource] = None
        self._t0: Optional[float] = None
        self._timeline: List[Sample] = []
        self._peak: Dict[str, int] = {}
        self._phases: List[dict] = []
        self._open: Optional[dict] = None
        self._groups: List[ContextGroup] = []
        self._ggml: Dict[str, int] = {}
        self._current: Dict[str, int] = {}
        self._labels: Dict[str, str] = {}
        self._notes: List[str] = []
        self._error: Optional[SamplerError] = None
        self._timer_samples = 0
        self._stopped = False
        self._meta_note = False
        if rss and not self.rss:
            self._notes.append("no /proc/self/status here: RSS is not sampled")

    # lifecycle ------------------------------------------------------------------------------

    def start(self) -> "Sampler":
        if self._t0 is not None:
            raise RuntimeError("this Sampler was started already")
        if self.nvidia:
            self._nvml = NvmlSource()  # MissingExtraError / SamplerError here, before any thread
            self._labels.update(self._nvml.labels)
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="llama-metaws-vram", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Report:
        """Stop sampling; return the report, or raise :class:`SamplerError` if a source failed."""
        if not self._stopped:
            self._stopped = True
            self._stop.set()
            if self._thread is not None:
                limit = max(5.0, 10 * self.interval)
                self._thread.join(limit)
                if self._thread.is_alive():  # a source call that never returns (a hung driver)
                    self._fail(SamplerError(f"the sampling thread did not stop within {limit:g} s: "
                                            "a memory source (NVML?) is not answering"))
            DECODE_HOOK.remove(self._after_decode)
            self.end_phase()
            if self._nvml is not None:
                self._notes.extend(self._nvml.notes())
                self._nvml.close()
        report = self.report(raise_error=False)
        if self._error is not None:
            raise SamplerError(str(self._error), report)
        return report

    def __enter__(self) -> "Sampler":
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.stop()
        else:
            with contextlib.suppress(SamplerError):
                self.stop()

    @property
    def error(self) -> Optional[SamplerError]:
        """The failure that stopped sampling, if any (also raised by :meth:`stop`)."""
        return self._error

    def now(self) -> float:
        return time.perf_counter() - (self._t0 if self._t0 is not None else time.perf_counter())

    # phases ---------------------------------------------------------------------------------

    def mark(self, name: str) -> None:
        """End the open phase and start ``name`` now."""
        with self._lock:
            t = self.now()
            self._close_phase(t)
            self._open = {"name": str(name), "start": t, "end": None}
            self._phases.append(self._open)
            if self.on_phase:
                self.on_phase(dict(self._open))

    def end_phase(self) -> None:
        with self._lock:
            self._close_phase(self.now())

    def _close_phase(self, t: float) -> None:
        if self._open is not None:
            self._open["end"] = t
            if self.on_phase:
                self.on_phase(dict(self._open))
            self._open = None

    @contextlib.contextmanager
    def phase(self, name: str):
        self.mark(name)
        try:
            yield self
        finally:
            with self._lock:
                if self._phases and self._phases[-1] is self._open and self._open["name"] == name:
                    self._close_phase(self.now())

    # ggml -----------------------------------------------------------------------------------

    def watch(self, llm=None, *, contexts=None, workspace=None, devices: Optional[Sequence[str]] = None,
              model=None):
        """Read the ggml figures of a ``Llama`` (or of ``contexts``) from now on; returns a handle.

        ``devices``: the devices the model was loaded on, in order (for a ``Llama`` made with
        ``devices=...``, taken from it): a meta buffer is reported under each. ``model``: a
        ``llama_model_p`` (or the binding's ``LlamaModel``) for ``"weights"``. Read once here,
        in the calling thread: call it before decoding starts, or from the decoding thread.
        """
        if llm is not None:
            group = ContextGroup.from_llama(llm, devices)
        else:
            model = getattr(model, "model", model)
            group = ContextGroup(list(contexts or []), workspace, devices, model)
        values = group.read()
        with self._lock:
            group.values = values
            self._groups.append(group)
            self._update_ggml()
        DECODE_HOOK.add(self._after_decode)
        if llm is not None:
            self._wrap_close(llm, group)
        return group

    def unwatch(self, handle) -> None:
        """Stop reading a watched ``Llama`` (or the handle :meth:`watch` returned)."""
        with self._lock:
            group = next((g for g in self._groups if g is handle or (g.llm is not None and g.llm is handle)), None)
            if group is None:
                return
            self._groups.remove(group)
            self._update_ggml()
            empty = not self._groups
        if group.llm is not None:
            group.llm.__dict__.pop("close", None)
        if empty:
            DECODE_HOOK.remove(self._after_decode)

    def _wrap_close(self, llm, group: ContextGroup) -> None:
        original = llm.close
        sampler = self

        def close(*a, **kw):
            sampler.unwatch(group)  # never read a context that is being freed
            return original(*a, **kw)

        llm.close = close

    def _after_decode(self, ctx) -> None:
        if self._stopped:
            return
        with self._lock:
            groups = [g for g in self._groups if g.owns(ctx)]
        if not groups:
            return  # another context (maybe in another thread): nothing watched changed
        try:
            values = [g.read() for g in groups]
            with self._lock:
                for g, v in zip(groups, values):
                    g.values = v
                self._update_ggml()
        except Exception as e:  # never into the decode: recorded, raised by stop()
            self._fail(SamplerError(f"reading ggml's buffers after a decode failed: {type(e).__name__}: {e}"))

    def _update_ggml(self) -> None:
        """Sum the groups; append a sample if anything changed (lock held)."""
        total = {k: 0 for k in self._ggml}  # a key seen once stays, at 0 when nothing holds it
        for g in self._groups:
            for k, v in g.values.items():
                total[k] = total.get(k, 0) + v
            if g.meta_unknown and not self._meta_note:
                self._meta_note = True
                self._notes.append("the devices of a meta buffer are unknown (give watch(devices=...)): "
                                   "reported under 'Meta'")
        if total != self._ggml or not self._timeline:
            self._ggml = total
            self._current.update(total)
            self._append()

    # the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        next_t = time.perf_counter()
        while not self._stop.is_set():
            try:
                fresh = {}
                if self.rss:
                    fresh["rss"] = read_rss()
                if self._nvml is not None:
                    fresh.update(self._nvml.read())
            except SamplerError as e:
                self._fail(e)
                return
            except Exception as e:
                self._fail(SamplerError(f"sampling failed: {type(e).__name__}: {e}"))
                return
            with self._lock:  # a read finished while stop() waits is kept too
                self._current.update(fresh)
                self._timer_samples += 1
                self._append()
            next_t += self.interval
            now = time.perf_counter()
            if next_t <= now:  # fell behind (a busy machine): skip the missed ticks, no burst
                next_t += ((now - next_t) // self.interval + 1) * self.interval
            self._stop.wait(next_t - now)

    def _append(self) -> None:
        t = self.now()
        values = dict(self._current)
        self._timeline.append((t, values))
        for k, v in values.items():
            if v > self._peak.get(k, -1):
                self._peak[k] = v
        if self.on_sample:
            self.on_sample(t, values)

    def _fail(self, error: SamplerError) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
                self._notes.append(f"sampling stopped at t={self.now():.3f}s: {error}")

    # results --------------------------------------------------------------------------------

    def report(self, raise_error: bool = True) -> Report:
        """Peaks, timeline and phases so far; raises :class:`SamplerError` if a source failed."""
        with self._lock:
            phases = [dict(p) for p in self._phases]
            if phases and phases[-1]["end"] is None:
                phases[-1]["end"] = self.now()
            report = Report(peak=dict(self._peak), timeline=list(self._timeline), phases=phases,
                            labels=dict(self._labels), notes=list(self._notes),
                            timer_samples=self._timer_samples,
                            error=str(self._error) if self._error else None)
        if raise_error and self._error is not None:
            raise SamplerError(str(self._error), report)
        return report
