"""llama-server (built from the same patched tree) on the step's model: one configuration, one process.

The server is started with the step's sizes and devices, waited for (``GET /health``), sent
warm-up and measured ``POST /completion`` requests of the same prompt tokens, and stopped by its
PID. Its memory is sampled from outside (NVML's per-process figure for its PID, its RSS); ggml's
compute bytes are the ``compute buffer size`` lines llama.cpp logs when each context reserves
its buffers (llama-server never resizes them), per buffer type, the last reservation of each
context.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from llama_metaws.tools.vram.probe import device_keys
from llama_metaws.tools.vram.sources import NvmlSource, SamplerError, read_rss

MiB = 2**20
_COMPUTE = re.compile(r"(\S+) compute buffer size = +([0-9.]+) MiB")
_NEW_CONTEXT = "constructing llama_context"


@dataclasses.dataclass(frozen=True)
class ServerConfiguration:
    """A llama-server row: drafting with MTP or not, under the step's split mode."""

    name: str
    draft: bool
    split_mode: str = "tensor"


def compute_from_log(text: str, devices: Sequence[str]) -> Dict[str, int]:
    """ggml's compute bytes per device key from llama.cpp's log: each context's last
    ``compute buffer size`` lines (a context that reserves again replaces its figures), summed
    over the contexts; a ``Meta(...)`` buffer type holds its size on every one of its devices
    (keys as the vram probe names them: a device listed twice is numbered)."""
    contexts: List[Dict[str, float]] = []
    current: Optional[Dict[str, float]] = None
    for line in text.splitlines():
        if _NEW_CONTEXT in line:
            current = {}
            contexts.append(current)
            continue
        m = _COMPUTE.search(line)
        if m and current is not None:
            current[m.group(1)] = float(m.group(2))
    keys = device_keys(list(devices)) if devices else []
    out: Dict[str, int] = {}
    for ctx in contexts:
        for buft, mib in ctx.items():
            size = int(round(mib * MiB))
            targets = keys if buft.startswith("Meta(") and keys else [buft]
            for k in targets:
                out[k] = out.get(k, 0) + size
    return out


class _Watch:
    """The server process's memory every ``interval`` seconds: NVML (its share and each GPU's
    used memory) and its RSS; peaks per key."""

    def __init__(self, pid: int, nvidia: bool, interval: float = 0.2):
        self.pid, self.interval = pid, interval
        self.nvml = NvmlSource(pid=pid) if nvidia else None
        self.peak: Dict[str, int] = {}
        self.labels: Dict[str, str] = dict(self.nvml.labels) if self.nvml else {}
        self.error: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        values: Dict[str, int] = {}
        with contextlib.suppress(OSError, SamplerError):
            values["rss"] = read_rss(f"/proc/{self.pid}/status")
        if self.nvml is not None:
            values.update(self.nvml.read())
        for k, v in values.items():
            if v > self.peak.get(k, -1):
                self.peak[k] = v

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sample()
            except SamplerError as e:
                self.error = str(e)
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> "_Watch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.nvml is not None:
            self.nvml.close()


def server_command(server: os.PathLike, cfg: ServerConfiguration, *, model: os.PathLike, port: int,
                   devices: Sequence[str], n_ctx: int, n_batch: int, n_ubatch: int, n_parallel: int,
                   draft_max: int, synth_len: Optional[float], threads: Optional[int] = None) -> List[str]:
    """llama-server's arguments for this row. GPU devices are named with ``--device`` and split
    as the row says; llama-server refuses CPU devices there, so a CPU run gives none (the
    CPU alone, no split)."""
    cmd = [os.fspath(server), "-m", os.fspath(model), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(n_parallel), "-c", str(n_ctx), "-b", str(n_batch), "-ub", str(n_ubatch),
           "-fa", "on", "--fit", "off", "--no-warmup", "-lv", "4"]  # 4: llama.cpp's compute buffer lines
    if on_devices(devices):
        cmd += ["--device", ",".join(devices), "-sm", cfg.split_mode, "-ngl", "999"]
    else:
        cmd += ["-ngl", "0"]
    if threads:
        cmd += ["-t", str(threads), "-tb", str(threads)]
    if cfg.draft:
        cmd += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(draft_max)]
        if synth_len is not None:
            cmd += ["--spec-synth-len", f"{synth_len:g}"]
    return cmd


def on_devices(devices: Sequence[str]) -> bool:
    """Whether llama-server can take these devices (``--device``): GPUs only."""
    return bool(devices) and not any(d.upper().startswith("CPU") for d in devices)


def _request(port: int, path: str, body: Optional[dict], timeout: float) -> tuple:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        if body is None:
            conn.request("GET", path)
        else:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _wait_healthy(proc: subprocess.Popen, port: int, deadline: float) -> None:
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with status {proc.returncode} while loading")
        try:
            status, _ = _request(port, "/health", None, timeout=2)
            if status == 200:
                return
        except OSError as e:  # refused (or 503) while it loads; unreachable is no wait's matter
            if e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL):
                raise RuntimeError(f"127.0.0.1 is unreachable ({e}): no loopback interface up") from e
        if time.monotonic() > deadline:
            raise TimeoutError("llama-server did not answer /health before the deadline")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 10 s, by its PID; reaped."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _die_with_parent() -> None:
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def run_server_configuration(cfg: ServerConfiguration, *, server: os.PathLike, model: os.PathLike,
                             devices: Sequence[str], tokens: Sequence[int], n_predict: int, requests: int,
                             warmup: int, n_ctx: int, n_batch: int, n_ubatch: int, n_parallel: int, draft_max: int,
                             synth_len: Optional[float], nvidia: bool, timeout: float, log: Path,
                             threads: Optional[int] = None, seed: int = 1) -> dict:
    """One llama-server row, as a record of the step's table (the keys of the vram harness's:
    ``name``, ``result``, ``message``, ``tokens_per_s``, ``prompt_tokens_per_s``,
    ``draft_acceptance``, ``peak``, ``labels``, ``notes``, ``seconds``; and ``compute``, from
    the log). ``tokens_per_s`` is the measured requests' ``predicted_n - 1`` tokens over their
    ``predicted_ms`` (llama-server's ``predicted_per_second``: the first token comes with the
    prompt), acceptance their ``draft_n_accepted`` over ``draft_n``."""
    from ..testing import free_port

    t0 = time.monotonic()
    deadline = t0 + timeout
    port = free_port()
    cmd = server_command(server, cfg, model=model, port=port, devices=devices, n_ctx=n_ctx, n_batch=n_batch,
                         n_ubatch=n_ubatch, n_parallel=n_parallel, draft_max=draft_max, synth_len=synth_len,
                         threads=threads)
    split = on_devices(devices)
    record = {"name": cfg.name, "kind": "llama-server", "result": "ok", "message": "", "expected": "ok",
              "tokens_per_s": None, "prompt_tokens_per_s": None, "draft_acceptance": None, "peak": {},
              "compute": {}, "labels": {}, "notes": [], "config": dataclasses.asdict(cfg), "command": cmd,
              "prompt_tokens": len(tokens)}
    if not split:
        record["notes"].append("llama-server takes no CPU device in --device: it ran on the CPU alone, unsplit")
    timings: List[dict] = []
    with open(log, "w") as log_f:
        try:
            proc = subprocess.Popen(cmd, stdout=log_f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=_die_with_parent)
        except OSError as e:
            record.update(result="error", message=f"llama-server did not start: {e}")
            proc = None
        watch: Optional[_Watch] = None
        if proc is not None:
            try:
                watch = _Watch(proc.pid, nvidia)
                with watch:
                    _wait_healthy(proc, port, deadline)
                    body = {"prompt": [int(t) for t in tokens], "n_predict": n_predict, "temperature": 0.0,
                            "ignore_eos": True, "cache_prompt": False, "stream": False}
                    for i in range(warmup + requests):
                        body["seed"] = seed + i  # as ours: a seed per request
                        left = max(1.0, deadline - time.monotonic())
                        status, raw = _request(port, "/completion", body, timeout=left)
                        if status != 200:
                            raise RuntimeError(f"POST /completion answered {status}: {raw[:300]!r}")
                        if i >= warmup:
                            timings.append(json.loads(raw)["timings"])
            except Exception as e:  # a failed row is reported, the step goes on
                record.update(result="error", message=f"{type(e).__name__}: {e}")
            finally:
                _stop(proc)
            if watch is not None:  # what was sampled until then, a failed row's too
                record["peak"], record["labels"] = watch.peak, watch.labels
                if watch.error:
                    record["notes"].append(f"sampling stopped: {watch.error}")
    text = Path(log).read_text(errors="replace")
    record["compute"] = compute_from_log(text, devices if split else [])
    if record["result"] != "ok":
        tail = [ln for ln in text.strip().splitlines() if ln.strip()][-3:]
        record["message"] += ("; log: " + " | ".join(tail)) if tail else ""
    steps = sum(max(0, int(t.get("predicted_n", 0)) - 1) for t in timings)
    ms = sum(float(t.get("predicted_ms", 0.0)) for t in timings)
    if steps and ms:
        record["tokens_per_s"] = steps / (ms / 1e3)
    p_n = sum(int(t.get("prompt_n", 0)) for t in timings)
    p_ms = sum(float(t.get("prompt_ms", 0.0)) for t in timings)
    if p_n and p_ms:
        record["prompt_tokens_per_s"] = p_n / (p_ms / 1e3)
    drafted = sum(int(t.get("draft_n", 0)) for t in timings)
    if drafted:
        record["draft_acceptance"] = sum(int(t.get("draft_n_accepted", 0)) for t in timings) / drafted
    if record["result"] == "ok":
        record["message"] = (f"{len(tokens)} prompt tokens, {n_predict} generated, {requests} request(s) "
                             f"after {warmup} warm-up")
    record["seconds"] = round(time.monotonic() - t0, 3)
    return record
