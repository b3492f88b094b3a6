"""Memory sources: the process's RSS and NVIDIA GPUs through pynvml (the ``nvidia`` extra)."""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Dict, List, Optional, Tuple

MiB = 2**20

Sample = Tuple[float, Dict[str, int]]


class SamplerError(RuntimeError):
    """A memory source failed while sampling (a device that disappeared, ...).

    ``report`` holds what was sampled until then (a :class:`Report`, or None).
    """

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report


class MissingExtraError(ImportError):
    """An optional dependency (an extra of llama-metaws) is not installed."""


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


def import_pynvml():
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
        nv = self.nv = import_pynvml()
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
