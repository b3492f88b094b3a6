"""Memory over time per device: a sampler, the seed's configurations, their table and plot.

``llama-metaws vram`` runs each configuration (split mode x workspace mode) in its own
subprocess, samples memory per device over model load and the requests, and prints the seed's
table: configuration, result, tokens/s, draft acceptance, peak per device. On the CPU test bed
(the default: the tiny agreement MTP model, ``CPU,CPU``, ``-np 2``)::

    llama-metaws vram [--json] [--plot vram.png] [--config "alias (tensor)" ...]

On an NVIDIA machine, with the patched build made for CUDA and the extras installed::

    CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90" llama-metaws build
    pip install -e '.[nvidia,plot]'
    llama-metaws vram --model Qwen3.5-27B-Q4_K_M.gguf --device CUDA0,CUDA1 -np 2 -c 16384 -ub 512 \\
        -n 128 --nvidia --plot vram.png

The same five configurations then run on the GPUs; with ``--nvidia`` the table gains, per GPU,
the peak of NVML's ``used`` (the whole device, as nvidia-smi shows it: the difference between
two rows is what a configuration costs, every configuration running alone in its own process)
and, where the driver reports it, this process's own share; the ggml columns (``CUDA0``,
``CUDA1``, ``CPU``) stay exact compute bytes. NVML numbers its GPUs in PCI bus order
(``nvml:0`` is nvidia-smi's GPU 0); that is CUDA's order under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
without a reordering ``CUDA_VISIBLE_DEVICES``.

What is measured, and how exact it is (keys of ``peak`` and of each timeline sample):

- ``"<device>"`` (``"CPU0"``, ``"CPU1"``, ``"CUDA0"``, ``"CPU"``, ...): **compute bytes,
  exact**: ggml's own accounting of the live compute buffers of the watched contexts
  (:func:`llama_metaws.buffers.compute_buffers` per context; with a workspace,
  :meth:`llama_metaws.workspace.Workspace.stats`, where a buffer shared by target and draft is
  listed, and counted, once). A meta buffer (``split_mode="tensor"``) allocates its size on
  every device of the meta device, so it is reported in full under each simple device; when a
  device name appears twice (``CPU,CPU``) the simple devices are numbered in the order given
  (``CPU0``, ``CPU1``). A compute buffer of a plain backend keeps ggml's device name: under
  tensor split on ``CPU,CPU`` the host backend's buffer is ``"CPU"``, apart from ``CPU0`` and
  ``CPU1``. Not included: the meta backend's reduction scratch buffers (allocated by the meta
  backend itself, outside the scheduler's accounting), and whatever a backend allocates
  privately (cuBLAS workspaces, CUDA's context): NVML's figures include those.
- ``"weights"``: ``llama_model_size`` of the watched model: exact bytes of the model's tensors
  (MTP layers included), all devices together; buffer padding and the per-device split are
  not in it.
- ``"kv"``: ``llama_state_get_size`` summed over the watched contexts. **Approximate**: it is
  the size llama.cpp would serialize (the KV and recurrent cells in use, plus the output
  buffer), which follows the cache's contents, not the KV allocation (fixed at context
  creation).
- ``"rss"``: the process's ``VmRSS`` (``/proc/self/status``): host memory actually resident,
  model pages touched through mmap included.
- ``"nvml:<i>"``: NVML's ``used`` for GPU i (device-wide, every process);
  ``"nvml:<i>:self"``: this process's usage from ``nvmlDeviceGetComputeRunningProcesses``
  where the driver gives it (absent, with a note, where it does not: some drivers, and a
  PID namespace in containers).

Thread safety. ggml's compute buffers are not safe to read while another thread decodes: a
decode may free and replace them (the workspace grows and shrinks them between phases). So
the ggml figures are read in the decoding thread itself, right after every ``llama_decode``
on a watched context (target and draft alike: :class:`Sampler` wraps ``llama_cpp``'s
``llama_decode`` while it watches something), and once when a context is watched. Those are
the only moments the figures can change (a compute buffer changes inside ``llama_decode``,
at context creation and at free), so the peaks are exact, however short a phase. The
background thread reads RSS and NVML every ``interval`` and records the latest ggml figures
with them. Call :meth:`Sampler.watch` before decoding starts (or from the decoding thread),
and unwatch before closing (closing a watched ``Llama`` unwatches it first by itself).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from . import repro

__all__ = [
    "Configuration",
    "DEFAULT_CONFIGURATIONS",
    "DEFAULT_INTERVAL",
    "MissingExtraError",
    "Report",
    "Sampler",
    "SamplerError",
    "add_arguments",
    "as_expected",
    "format_table",
    "main",
    "plot",
    "read_rss",
    "run_configurations",
    "run_from_args",
]

DEFAULT_INTERVAL = 0.2
DEFAULT_PROMPT = "the quick brown fox jumps over the lazy dog. " * 5
DEFAULT_DEVICES = ("CPU", "CPU")
MiB = 2**20

Sample = Tuple[float, Dict[str, int]]


class SamplerError(RuntimeError):
    """A memory source failed while sampling (a device that disappeared, ...).

    ``report`` holds what was sampled until then (a :class:`Report`, or None).
    """

    def __init__(self, message: str, report: "Optional[Report]" = None):
        super().__init__(message)
        self.report = report


class MissingExtraError(ImportError):
    """An optional dependency (an extra of llama-metaws) is not installed."""


# --------------------------------------------------------------------------------------------
# sources


def read_rss(path: str = "/proc/self/status") -> int:
    """This process's resident set size in bytes (``VmRSS``)."""
    with open(path, "rb") as f:
        for line in f:
            if line.startswith(b"VmRSS:"):
                parts = line.split()
                unit = parts[2].lower() if len(parts) > 2 else b"kb"
                scale = {b"kb": 1024, b"mb": MiB, b"gb": 2**30, b"b": 1}.get(unit, 1024)
                return int(parts[1]) * scale
    raise SamplerError(f"no VmRSS line in {path}")


def _import_pynvml():
    try:
        return importlib.import_module("pynvml")
    except ImportError as e:
        raise MissingExtraError(
            "reading NVIDIA memory needs pynvml, which is not installed: install the nvidia "
            "extra (pip install 'llama-metaws[nvidia]')") from e


def _text(value) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class NvmlSource:
    """Used memory per NVIDIA GPU, and this process's share where the driver gives it.

    Every read checks the device count and asks each GPU: a device that goes away (fewer
    devices counted, or an NVML error from its handle) raises :class:`SamplerError` naming it.
    """

    def __init__(self, pid: Optional[int] = None):
        nv = self.nv = _import_pynvml()
        self.error = getattr(nv, "NVMLError", Exception)
        self.not_supported = getattr(nv, "NVMLError_NotSupported", ())
        self.pid = os.getpid() if pid is None else pid
        try:
            nv.nvmlInit()
            self.count = int(nv.nvmlDeviceGetCount())
            self.handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(self.count)]
        except self.error as e:
            raise SamplerError(f"NVML could not list the GPUs: {e}") from e
        self.labels = {}
        for i, h in enumerate(self.handles):
            name = ""
            with contextlib.suppress(Exception):
                name = _text(nv.nvmlDeviceGetName(h))
            self.labels[f"nvml:{i}"] = f"GPU{i} ({name})" if name else f"GPU{i}"
            self.labels[f"nvml:{i}:self"] = f"GPU{i} this process"
        self.process_supported = [True] * self.count
        self.seen_self = [False] * self.count

    def _label(self, i: int) -> str:
        return self.labels[f"nvml:{i}"]

    def read(self) -> Dict[str, int]:
        nv = self.nv
        try:
            n = int(nv.nvmlDeviceGetCount())
        except self.error as e:
            raise SamplerError(f"NVML could not count the GPUs any more: {e}") from e
        if n < self.count:
            gone = ", ".join(self._label(i) for i in range(n, self.count))
            raise SamplerError(f"NVIDIA device disappeared during the run: {gone} "
                               f"(NVML counts {n} GPU(s), {self.count} at the start)")
        out: Dict[str, int] = {}
        for i, h in enumerate(self.handles):
            try:
                out[f"nvml:{i}"] = int(nv.nvmlDeviceGetMemoryInfo(h).used)
            except self.error as e:
                raise SamplerError(f"NVIDIA device {self._label(i)} disappeared or failed during "
                                   f"the run: NVML's memory query answered {e!s}") from e
            if not self.process_supported[i]:
                continue
            try:
                procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
            except self.not_supported:
                self.process_supported[i] = False
                continue
            except self.error as e:
                raise SamplerError(f"NVIDIA device {self._label(i)} disappeared or failed during "
                                   f"the run: NVML's process query answered {e!s}") from e
            mine = [getattr(p, "usedGpuMemory", None) for p in procs if int(p.pid) == self.pid]
            mine = [int(v) for v in mine if v is not None]
            if mine:
                out[f"nvml:{i}:self"] = sum(mine)
                self.seen_self[i] = True
        return out

    def notes(self) -> List[str]:
        out = []
        for i in range(self.count):
            if not self.process_supported[i]:
                out.append(f"{self._label(i)}: the driver does not report per-process usage")
            elif not self.seen_self[i]:
                out.append(f"{self._label(i)}: this process (pid {self.pid}) never appeared in "
                           "NVML's process list (it did not use the GPU, or runs in a PID "
                           "namespace): no per-process figure")
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nv.nvmlShutdown()


def _device_keys(names: Sequence[str]) -> List[str]:
    """Keys for the simple devices of a meta device: a name given twice is numbered."""
    counts: Dict[str, int] = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    seen: Dict[str, int] = {}
    out = []
    for n in names:
        if counts[n] > 1:
            out.append(f"{n}{seen.get(n, 0)}")
            seen[n] = seen.get(n, 0) + 1
        else:
            out.append(n)
    return out


class _Group:
    """Contexts read together: a target, its draft, their workspace, their model."""

    def __init__(self, contexts, workspace=None, devices: Optional[Sequence[str]] = None,
                 model=None, llm=None):
        from ._native import address
        from .buffers import context_address

        self.contexts = [c for c in contexts if c is not None]
        if not self.contexts:
            raise ValueError("watch: no open context to watch")
        self.workspace = workspace
        self.meta_keys = _device_keys(list(devices)) if devices else []
        self.addresses = {context_address(c) for c in self.contexts}
        self.address = address
        self.llm = llm
        self.weights = None
        if model is not None:
            import llama_cpp

            self.weights = int(llama_cpp.llama_model_size(model))
        self.values: Dict[str, int] = {}
        self.meta_unknown = False

    @classmethod
    def from_llama(cls, llm, devices=None) -> "_Group":
        if getattr(llm, "_ctx", None) is None:
            raise ValueError("watch: this Llama is closed")
        if devices is None:
            dl = getattr(llm, "_device_list", None)
            devices = [d.name for d in dl.devices] if dl is not None else None
        model = getattr(getattr(llm, "_model", None), "model", None)
        return cls([llm._ctx, getattr(llm, "_draft_ctx", None)], getattr(llm, "_workspace", None),
                   devices, model, llm)

    def _add(self, out: Dict[str, int], device: str, size: int) -> None:
        if device.startswith("Meta("):
            if not self.meta_keys:
                self.meta_unknown = True
                out["Meta"] = out.get("Meta", 0) + size
                return
            for k in self.meta_keys:  # a meta buffer holds its size on every simple device
                out[k] = out.get(k, 0) + size
        else:
            out[device] = out.get(device, 0) + size

    def read(self) -> Dict[str, int]:
        import llama_cpp

        from .buffers import compute_buffers

        out: Dict[str, int] = {}
        if self.workspace is not None:
            for e in self.workspace.stats():  # a shared entry is listed once
                self._add(out, e.device or e.buffer_type, e.allocated)
        else:
            for ctx in self.contexts:
                for b in compute_buffers(ctx):  # ggml reports a repeated buffer as 0
                    self._add(out, b.device or b.buffer_type, b.size)
        out["kv"] = sum(int(llama_cpp.llama_state_get_size(getattr(c, "ctx", c))) for c in self.contexts)
        if self.weights is not None:
            out["weights"] = self.weights
        return out

    def owns(self, ctx) -> bool:
        try:
            return self.address(ctx) in self.addresses
        except Exception:
            return False


class _DecodeHook:
    """Wraps ``llama_cpp``'s ``llama_decode`` (both names the binding uses) while listened to."""

    def __init__(self):
        self.lock = threading.Lock()
        self.listeners: List[Callable] = []
        self.saved: List[tuple] = []

    def add(self, fn: Callable) -> None:
        with self.lock:
            if fn in self.listeners:
                return
            if not self.listeners:
                self._install()
            self.listeners.append(fn)

    def remove(self, fn: Callable) -> None:
        with self.lock:
            if fn not in self.listeners:
                return
            self.listeners.remove(fn)
            if not self.listeners:
                self._uninstall()

    def _install(self) -> None:
        import llama_cpp
        import llama_cpp.llama_cpp as low

        hook = self
        for module in (low, llama_cpp):
            orig = module.llama_decode

            def llama_decode(ctx, batch, _orig=orig):
                rc = _orig(ctx, batch)
                for fn in list(hook.listeners):
                    fn(ctx)
                return rc

            llama_decode.__wrapped__ = orig
            module.llama_decode = llama_decode
            self.saved.append((module, orig, llama_decode))

    def _uninstall(self) -> None:
        for module, orig, wrapper in reversed(self.saved):
            if module.llama_decode is wrapper:  # else someone wrapped over us: leave theirs
                module.llama_decode = orig
        self.saved = []


_DECODE_HOOK = _DecodeHook()


# --------------------------------------------------------------------------------------------
# the sampler


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
    ggml figures are read in the decoding thread after each ``llama_decode`` (see the module
    docstring). :meth:`mark` starts a named phase (``"prompt"``, ``"decode"``, ...), which
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
        self._groups: List[_Group] = []
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
            _DECODE_HOOK.remove(self._after_decode)
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
            group = _Group.from_llama(llm, devices)
        else:
            model = getattr(model, "model", model)
            group = _Group(list(contexts or []), workspace, devices, model)
        values = group.read()
        with self._lock:
            group.values = values
            self._groups.append(group)
            self._update_ggml()
        _DECODE_HOOK.add(self._after_decode)
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
            _DECODE_HOOK.remove(self._after_decode)

    @contextlib.contextmanager
    def watching(self, llm=None, **kw):
        handle = self.watch(llm, **kw)
        try:
            yield handle
        finally:
            self.unwatch(handle)

    def _wrap_close(self, llm, group: _Group) -> None:
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

    def sample_count(self) -> int:
        with self._lock:
            return len(self._timeline)

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


# --------------------------------------------------------------------------------------------
# configurations


@dataclasses.dataclass(frozen=True)
class Configuration:
    """One row of the table: how the model is split and how the contexts share compute."""

    name: str
    split_mode: str = "tensor"      # "none" | "layer" | "row" | "tensor"
    workspace_mode: str = "alias"   # "off" (no workspace) | "alias" | "private-meta" | "unsafe-shared"
    expected: str = "ok"            # "ok" | "assert"

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
    import llama_cpp

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
    # the binding keeps n_batch rows of logits when it drafts, written at absolute positions:
    # n_batch must cover the whole request (compute buffers follow n_ubatch, not n_batch)
    n_batch = req.get("n_batch") or min(n_ctx, max(n_ubatch, len(tokens) + n_predict + draft_max + 1))
    kw = dict(draft="mtp", draft_max=draft_max, devices=list(req["devices"]), split_mode=cfg.split_mode,
              n_seq_max=int(req["n_seq_max"]), n_ctx=n_ctx, n_batch=int(n_batch), n_ubatch=n_ubatch,
              phase_aware_workspace=cfg.workspace_mode != "off",
              workspace_mode=cfg.workspace_mode if cfg.workspace_mode != "off" else "alias",
              allow_unsafe_workspace=cfg.workspace_mode == "unsafe-shared", verbose=False)
    if req.get("threads"):
        kw["n_threads"] = kw["n_threads_batch"] = int(req["threads"])
    emit("start", config=cfg.to_dict(), prompt_tokens=len(tokens), n_batch=int(n_batch))

    sampler = Sampler(req["interval"], nvidia=bool(req.get("nvidia")),
                      on_sample=lambda t, v: emit("sample", t=t, values=v),
                      on_phase=lambda p: emit("phase", **p))
    sampler.start()
    emit("labels", labels=sampler.report(raise_error=False).labels)  # kept if the process dies
    from .buffers import compute_buffers
    from .llama import Llama

    sampler.mark("load")
    llm = Llama(req["model"], **kw)
    try:
        sampler.watch(llm)
        emit("snapshot", at="load", target=[dataclasses.asdict(b) for b in compute_buffers(llm._ctx)],
             draft=[dataclasses.asdict(b) for b in compute_buffers(llm._draft_ctx)],
             workspace=[dataclasses.asdict(e) for e in llm.workspace_stats()])
        sampler.end_phase()
        timings = []
        for _ in range(int(req["requests"])):
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
            timings.append(llm.timings())
            emit("request", timings=timings[-1])
        acceptance = llm.draft_stats.total.acceptance if llm.draft_stats.total.drafted else None
    finally:
        llm.close()  # unwatches first: the compute figures drop to 0
    try:
        report = sampler.stop()
        error = None
    except SamplerError as e:
        report, error = e.report, str(e)
    dec_tokens = sum(t["decode_tokens"] for t in timings)
    dec_time = sum(t["decode_tokens"] / t["decode_tokens_per_s"] for t in timings if t["decode_tokens_per_s"])
    pre_tokens = sum(t["prompt_tokens"] for t in timings)
    pre_time = sum(t["prompt_tokens"] / t["prompt_tokens_per_s"] for t in timings if t["prompt_tokens_per_s"])
    emit("result", tokens_per_s=dec_tokens / dec_time if dec_time else None,
         prompt_tokens_per_s=pre_tokens / pre_time if pre_time else None,
         draft_acceptance=acceptance, peak=report.peak, labels=report.labels, notes=report.notes,
         timer_samples=report.timer_samples, sampler_error=error)


def _child_main(events_path: str) -> int:
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

_ASSERT = re.compile(r"(?:(\S+):(\d+): )?(GGML_ASSERT\(.*?\) failed)")


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
                      timeout: float = 600) -> dict:
    """One configuration in a subprocess: its record (see :func:`run_configurations`)."""
    with tempfile.TemporaryDirectory(prefix="llama-metaws-vram-") as tmp:
        events_path = os.path.join(tmp, "events.jsonl")
        req = dict(config=config.to_dict(), model=os.fspath(model), devices=list(devices),
                   prompt=prompt if isinstance(prompt, str) else [int(t) for t in prompt],
                   n_predict=n_predict, interval=interval, n_seq_max=n_seq_max, n_ctx=n_ctx,
                   n_ubatch=n_ubatch, n_batch=n_batch, draft_max=draft_max, requests=requests,
                   nvidia=nvidia, threads=threads)
        cmd = [sys.executable, "-m", "llama_metaws.vram", "--child", events_path]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, input=json.dumps(req), capture_output=True, text=True, timeout=timeout,
                                  env=repro.child_env())
            rc, stderr = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as e:
            err = e.stderr or ""
            rc, stderr = None, err.decode("utf-8", "replace") if isinstance(err, bytes) else err
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
    m = _ASSERT.search(stderr or "")
    if rc is None:
        record.update(result="error", message=f"timed out after {timeout:g} s")
    elif result is not None and result.get("sampler_error"):
        record.update(result="error", message=result["sampler_error"])
    elif m:
        where = f"{os.path.basename(m.group(1))}:{m.group(2)}: " if m.group(1) else ""
        record.update(result="assert", message=where + m.group(3))
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
    the requests), ``draft_acceptance``, ``peak`` (key -> bytes, see the module docstring),
    ``timeline`` (``[t, {key: bytes}]`` samples), ``phases`` (``{name, start, end}``), and
    ``expected``, ``prompt_tokens_per_s``, ``labels``, ``notes``, ``config``, ``snapshot``
    (compute buffers and workspace entries right after load), ``seconds``.
    """
    chosen = [c if isinstance(c, Configuration) else find_configuration(c)
              for c in (configs if configs else DEFAULT_CONFIGURATIONS)]
    progress = progress or (lambda line: None)
    with tempfile.TemporaryDirectory(prefix="llama-metaws-vram-model-") as tmp:
        if model is None:
            from .testing import make_tiny_mtp_model

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


# --------------------------------------------------------------------------------------------
# the table and the plot


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
    """The seed's table: configuration, result, tokens/s, draft acceptance, peak per device."""
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


# --------------------------------------------------------------------------------------------
# the command


def _config_arg(text: str) -> Configuration:
    try:
        return find_configuration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``llama-metaws vram``'s flags (llama.cpp's names where it has them)."""
    p.add_argument("-m", "--model", help="GGUF model with NextN (MTP) layers (default: the tiny agreement "
                   "model, written into a temporary directory)")
    p.add_argument("-dev", "--device", default=",".join(DEFAULT_DEVICES),
                   help="comma-separated devices, as llama.cpp prints them (default CPU,CPU)")
    p.add_argument("-np", "--parallel", type=int, default=2, help="sequences, n_seq_max (default 2)")
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="context size (default 512)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=64, help="physical batch size (default 64)")
    p.add_argument("-b", "--batch-size", type=int, default=None,
                   help="logical batch size (default: enough for the prompt and the generated tokens)")
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help="prompt text")
    p.add_argument("-n", "--n-predict", type=int, default=32, help="tokens per request (default 32)")
    p.add_argument("--requests", type=int, default=2, help="requests per configuration (default 2)")
    p.add_argument("--draft-max", type=int, default=3)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL,
                   help="seconds between samples of the background thread (default 0.2)")
    p.add_argument("--config", action="append", type=_config_arg, metavar="NAME",
                   help="run only this configuration (repeatable; a slug such as alias-tensor works too): "
                   + ", ".join(repr(c.name) for c in DEFAULT_CONFIGURATIONS))
    p.add_argument("--json", action="store_true", help="print the records as JSON instead of the table")
    p.add_argument("--plot", metavar="FILE.png", help="plot memory over time per device (the plot extra)")
    p.add_argument("--nvidia", action="store_true", help="sample NVIDIA GPUs with pynvml as well (the nvidia extra)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per configuration (default 600)")
    return p


def run_from_args(args: argparse.Namespace) -> int:
    """Run the chosen configurations; 0 when each behaved as expected, 1 otherwise, 2 on bad input."""
    devices = [d.strip() for d in args.device.split(",") if d.strip()]
    for name, value, low in (("-np", args.parallel, 1), ("-c", args.ctx_size, 1), ("-ub", args.ubatch_size, 1),
                             ("-n", args.n_predict, 1), ("--requests", args.requests, 1)):
        if value < low:
            print(f"llama-metaws vram: {name} must be >= {low}", file=sys.stderr)
            return 2
    if not args.interval > 0:
        print("llama-metaws vram: --interval must be > 0", file=sys.stderr)
        return 2
    if args.model and not os.path.isfile(args.model):
        print(f"llama-metaws vram: no model file {args.model}", file=sys.stderr)
        return 2
    if args.nvidia:
        try:
            _import_pynvml()
        except MissingExtraError as e:
            print(f"llama-metaws vram: {e}", file=sys.stderr)
            return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("llama-metaws vram: --plot needs matplotlib: install the plot extra "
                  "(pip install 'llama-metaws[plot]')", file=sys.stderr)
            return 2
    records = run_configurations(
        args.config, model=args.model, devices=devices, prompt=args.prompt, n_predict=args.n_predict,
        interval=args.interval, n_seq_max=args.parallel, n_ctx=args.ctx_size, n_ubatch=args.ubatch_size,
        n_batch=args.batch_size, draft_max=args.draft_max, requests=args.requests, nvidia=args.nvidia,
        threads=args.threads, timeout=args.timeout)
    if args.json:
        print(json.dumps(records, indent=1))
    else:
        print(format_table(records))
    if args.plot:
        print(f"plot: {plot(records, args.plot)}", file=sys.stderr)
    return 0 if all(as_expected(r) for r in records) else 1


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        if len(argv) != 2:
            print("usage: python -m llama_metaws.vram --child EVENTS_FILE  (a request as JSON on stdin)",
                  file=sys.stderr)
            return 2
        return _child_main(argv[1])
    p = argparse.ArgumentParser(
        prog="llama-metaws vram",
        description="Run each configuration (no workspace, unsafe-shared, private-meta, alias under "
        "tensor split; alias under layer split) in its own process, sample memory per device, and "
        "print configuration, result, tokens/s, draft acceptance and peak per device.")
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
