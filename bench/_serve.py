"""Servers for the benchmarks: started pinned to cores, bounded in time, stopped by their PID.

:class:`Server` runs one server process (``llama-server`` or ``llama-metaws serve``) with its
output in a log file, waits for ``GET /health`` to answer 200, and stops it by its PID (SIGTERM,
then SIGKILL), reaping it with ``wait4`` for its peak RSS. Only the process it started is ever
signalled. :func:`complete` sends one OpenAI-style completion (streamed or not) and reads the
reply, the server's ``timings`` and the time to the first token as the client sees it.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence


def llama_tools() -> Dict[str, Path]:
    """llama.cpp's tools from the same patched tree (``llama-metaws build --tools``), built first
    when the cache has none for the current inputs: ``{target: path}``."""
    import sys

    from llama_metaws_dev import tools_build

    tools = tools_build.find_tools()
    if tools is None:
        print("building llama.cpp's tools (llama-metaws build --tools) ...", flush=True)
        subprocess.run([sys.executable, "-m", "llama_metaws", "build", "--tools"], check=True)
        tools = tools_build.find_tools()
    return tools


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pinned_cores(threads: int) -> List[int]:
    """The last ``threads`` cores this process may use (all of them when there are no more)."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[-threads:] if threads < len(cores) else cores


def _vm_field(pid: int, field: str) -> int:
    """A ``/proc/PID/status`` size field (VmHWM: peak RSS, VmRSS: RSS now) in bytes; 0 when gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def peak_rss_now(pid: int) -> int:
    """A live process's peak RSS so far (VmHWM), in bytes; 0 when it is gone."""
    return _vm_field(pid, "VmHWM")


class ServerError(RuntimeError):
    """A server did not start, or died; the message carries the tail of its log."""


class Server:
    """One server process: ``with Server(name, cmd, port, cores, log) as s: ...``."""

    def __init__(self, name: str, cmd: Sequence[str], port: int, cores: Optional[Sequence[int]],
                 log_path: Path, env: Optional[Dict[str, str]] = None, start_timeout: float = 300.0):
        self.name, self.cmd, self.port = name, list(cmd), port
        self.cores = list(cores) if cores else None
        self.log_path = Path(log_path)
        self.env = env
        self.start_timeout = start_timeout
        self.proc: Optional[subprocess.Popen] = None
        self.peak_rss = 0       # bytes: VmHWM, then wait4's ru_maxrss, whichever is larger
        self.returncode: Optional[int] = None

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else 0

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def _tail(self, n: int = 3000) -> str:
        return self.log_text()[-n:]

    def start(self) -> "Server":
        pin = (lambda: os.sched_setaffinity(0, self.cores)) if self.cores else None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # a session of its own: a ^C to the bench is not delivered to it; it is stopped by PID
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=pin, start_new_session=True, env=self.env)
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.name} exited {self.proc.returncode} while starting "
                                  f"({' '.join(self.cmd)}):\n{self._tail()}")
            try:
                status, _ = request(self.port, "GET", "/health", timeout=5)
                if status == 200:
                    return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"{self.name} did not answer /health within {self.start_timeout:.0f} s:\n{self._tail()}")
            time.sleep(0.25)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss(self) -> int:
        return _vm_field(self.pid, "VmRSS") if self.alive() else 0

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to this server's PID, SIGKILL after ``grace`` seconds; reap it (peak RSS)."""
        if self.proc is None or self.returncode is not None:
            return
        pid = self.proc.pid
        self.peak_rss = max(self.peak_rss, _vm_field(pid, "VmHWM"))
        if self.proc.poll() is None:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while True:
            try:
                got, status, ru = os.wait4(pid, os.WNOHANG)
            except ChildProcessError:  # reaped already (poll() above)
                self.returncode = self.proc.returncode
                return
            if got:
                self.returncode = os.waitstatus_to_exitcode(status)
                self.proc.returncode = self.returncode
                self.peak_rss = max(self.peak_rss, ru.ru_maxrss * 1024)
                return
            if time.monotonic() > deadline:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                deadline = time.monotonic() + 30.0
            time.sleep(0.05)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def request(port: int, method: str, path: str, body: Optional[dict] = None, timeout: float = 600.0):
    """(status, parsed JSON or text) of one plain HTTP request to 127.0.0.1:port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        res = conn.getresponse()
        raw = res.read().decode(errors="replace")
        try:
            return res.status, json.loads(raw)
        except ValueError:
            return res.status, raw
    finally:
        conn.close()


def complete(port: int, prompt: str, max_tokens: int, extra: Optional[dict] = None,
             stream: bool = True, timeout: float = 600.0) -> dict:
    """One greedy ``POST /v1/completions``: ``{text, timings, ttft_s, seconds, t0, t1}``.

    Streamed, ``ttft_s`` is the time from sending to the first chunk with text (the client's
    time to first token, queueing included); the server's ``timings`` come on the last chunks.
    ``t0``/``t1`` are ``time.monotonic()`` at sending and at the end.
    """
    body = dict(prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=stream, **(extra or {}))
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        res = conn.getresponse()
        if res.status != 200:
            raise RuntimeError(f"POST /v1/completions on port {port}: {res.status} {res.read()[:2000]!r}")
        if not stream:
            doc = json.loads(res.read())
            t1 = time.monotonic()
            return dict(text=doc["choices"][0]["text"], timings=doc.get("timings") or {}, ttft_s=None,
                        seconds=t1 - t0, t0=t0, t1=t1, usage=doc.get("usage") or {})
        parts: List[str] = []
        timings: dict = {}
        usage: dict = {}
        ttft = None
        while True:
            line = res.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(f"POST /v1/completions on port {port}: error event {ev['error']!r}")
            for ch in ev.get("choices") or []:
                text = ch.get("text") or ""
                if text:
                    if ttft is None:
                        ttft = time.monotonic() - t0
                    parts.append(text)
            if ev.get("timings"):
                timings = ev["timings"]
            if ev.get("usage"):
                usage = ev["usage"]
        t1 = time.monotonic()
        return dict(text="".join(parts), timings=timings, ttft_s=ttft, seconds=t1 - t0, t0=t0, t1=t1, usage=usage)
    finally:
        conn.close()
