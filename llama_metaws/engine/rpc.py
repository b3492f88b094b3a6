"""ggml's RPC backend: devices on other hosts (``Llama(rpc_servers=...)``, llama.cpp's ``--rpc``)
and ggml's RPC server from our build (``llama-metaws rpc-server``).

A server is ``host:port``; its devices join ggml's registry as ``RPC0``, ``RPC1``, ... (in the
order this process first reached the servers; each device's description is its endpoint), so
``devices=[...]`` may name them next to local ones. Without ``devices`` a ``Llama`` uses the
servers' devices first, then the local GPUs, as llama.cpp orders them.

Failures are Python exceptions, never an abort (patches 0017 and 0019): a server that cannot be reached is
a ``ValueError`` at load; one that goes away mid-request makes the next :func:`check` (after every
evaluation) raise :class:`RPCServerError` naming it. The protocol has no authentication: bind a
server to loopback or a trusted private network only.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

from ..native.shim import check_error, ffi, lib
from .devices import find_device, list_devices
from ..errors import LlamaMetawsError

__all__ = ["RPCServerError", "RPCServers", "parse_servers", "connect", "serve", "DEFAULT_PORT"]

DEFAULT_PORT = 50052  # ggml's rpc-server's
DEFAULT_HOST = "127.0.0.1"
_MAX_DEVICES = 16


class RPCServerError(LlamaMetawsError):
    """An RPC server crashed, went away, refused a request or answered garbage while a model used it."""


def _split_endpoint(text: str) -> tuple:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rpc_servers: {text!r} is not host:port (e.g. 127.0.0.1:{DEFAULT_PORT})")
    return host, int(port)


def parse_servers(value: Union[None, str, Sequence[str]]) -> List[str]:
    """``"h1:p1,h2:p2"`` (llama.cpp's ``--rpc``, the binding's old ``rpc_servers`` string) or a
    list of ``"host:port"``; each checked, duplicates refused."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    if not all(isinstance(s, str) for s in items):
        raise ValueError(f"rpc_servers: give 'host:port' strings, got {value!r}")
    out = []
    for s in (s.strip() for s in items):
        if not s:
            continue
        host, port = _split_endpoint(s)
        ep = f"{host}:{port}"
        if ep in out:
            raise ValueError(f"rpc_servers: {ep} is listed twice")
        out.append(ep)
    if not out and value:
        raise ValueError(f"rpc_servers: no server in {value!r}")
    return out


_lock = threading.Lock()
_devices_of: Dict[str, List[str]] = {}  # endpoint -> its device names, registered once


def _why_unreachable(endpoint: str) -> str:
    host, port = _split_endpoint(endpoint)
    try:
        with socket.create_connection((host, port), timeout=5):
            pass
    except OSError as e:
        return f"cannot connect ({e})"
    return ("it accepts connections but did not answer as a ggml RPC server (another program, "
            "another version of the RPC protocol, or a server with no devices)")


def _connect_one(endpoint: str) -> List[str]:
    with _lock:
        if endpoint in _devices_of:
            return _devices_of[endpoint]
        out = ffi.new("ggml_backend_dev_t[]", _MAX_DEVICES)
        n = ffi.new("int *")
        status = lib.lmws_rpc_add_server(endpoint.encode(), out, _MAX_DEVICES, n)
        if status == lib.LMWS_EFAILED:
            raise ValueError(f"rpc_servers: cannot use the RPC server {endpoint}: "
                             f"{_why_unreachable(endpoint)}. Start it with `llama-metaws rpc-server "
                             f"--host HOST --port PORT` (or llama.cpp's rpc-server) and check the address")
        check_error(status)
        names = []
        for i in range(n[0]):
            check_error(lib.lmws_rpc_register_device(out[i]))
            names.append(ffi.string(lib.ggml_backend_dev_name(out[i])).decode())
        _devices_of[endpoint] = names
        return names


class RPCServers:
    """The RPC servers one ``Llama`` uses: their device names, and :meth:`check`."""

    def __init__(self, endpoints: Sequence[str]):
        self.endpoints = list(endpoints)
        self.device_names = [name for ep in self.endpoints for name in _connect_one(ep)]

    def __bool__(self) -> bool:
        return bool(self.endpoints)

    def default_devices(self) -> List[str]:
        """llama.cpp's default order: the servers' devices, then the local GPUs."""
        rpc = {name for names in _devices_of.values() for name in names}
        return self.device_names + [d.name for d in list_devices() if d.type == "gpu" and d.name not in rpc]

    def check(self, ctx=None) -> None:
        """Raise :class:`RPCServerError` when a server was lost; ``ctx`` (a ``llama_context``) is
        synchronized first, so that every command sent for it has been answered or dropped."""
        if not self.endpoints:
            return
        if ctx is not None:
            from ..native.binding import llama_cpp

            llama_cpp.llama_synchronize(ctx)
        ok = ffi.new("bool *")
        for ep in self.endpoints:
            check_error(lib.lmws_rpc_server_ok(ep.encode(), ok))
            if not ok[0]:
                raise RPCServerError(
                    f"the RPC server {ep} crashed, went away, refused a request or answered "
                    "garbage (its log says which): the request cannot go on and this model's state "
                    "is lost. Close this Llama, restart the server and load the model again")


def local_devices() -> Optional[List[str]]:
    """The default devices without any RPC server's, once a server was added in this process.

    Adding a server registers its devices with ggml for the life of the process, and llama.cpp's
    default device list puts them first: every later model loaded without ``devices`` or
    ``rpc_servers`` would go to the servers, even once they are gone. With a server added, this
    is the list such a model gets instead (the local GPUs; empty: the CPU alone); None while none
    was added (llama.cpp's own default is right).
    """
    rpc = {name for names in _devices_of.values() for name in names}
    if not rpc:
        return None
    return [d.name for d in list_devices() if d.type == "gpu" and d.name not in rpc]


def connect(rpc_servers: Union[None, str, Sequence[str]]) -> RPCServers:
    """Reach the servers (a ``ValueError`` for a bad or unreachable one) and register their devices."""
    return RPCServers(parse_servers(rpc_servers))


# --------------------------------------------------------------------------------------------
# the server


def _server_devices(names: Optional[Sequence[str]]) -> list:
    """ggml's rpc-server's choice: the devices named, else the accelerators, else the CPU."""
    if names:
        return [find_device(n) for n in names]
    devs = list_devices()
    return [d for d in devs if d.type not in ("cpu", "accel")] or [d for d in devs if d.type == "cpu"][:1]


def _cache_dir() -> str:
    """llama.cpp's: $LLAMA_CACHE, else $XDG_CACHE_HOME or ~/.cache, then llama.cpp/rpc."""
    base = os.environ.get("LLAMA_CACHE")
    root = Path(base) if base else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama.cpp"
    path = root / "rpc"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def serve(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, threads: Optional[int] = None,
          devices: Optional[Sequence[str]] = None, cache: bool = False) -> int:
    """Run ggml's RPC server (``ggml_backend_rpc_start_server``) in this process until it is
    killed; returns (1) only when it could not start, e.g. the address is taken."""
    if not 0 < port < 65536:
        raise ValueError(f"--port {port}: not a port")
    if host != DEFAULT_HOST:
        print(f"WARNING: the RPC server binds {host}, not 127.0.0.1: ggml's RPC protocol has no "
              "authentication and no encryption; anyone who reaches this port can run graphs and "
              "read or write this host's device memory. Bind a trusted private network only.",
              file=sys.stderr, flush=True)
    devs = _server_devices(devices)
    n_threads = threads if threads is not None else max(1, (os.cpu_count() or 2) // 2)
    if n_threads < 1:
        raise ValueError(f"-t {n_threads}: at least one thread")
    array = ffi.new("ggml_backend_dev_t[]", [ffi.cast("ggml_backend_dev_t", d.handle) for d in devs])
    cache_dir = ffi.new("char[]", _cache_dir().encode()) if cache else ffi.NULL
    print(f"llama-metaws rpc-server: {host}:{port}, devices {','.join(d.name for d in devs)}, "
          f"{n_threads} threads", file=sys.stderr, flush=True)
    # the C loop never returns to Python: let SIGINT and SIGTERM end the process at once
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    status = lib.lmws_rpc_start_server(f"{host}:{port}".encode(), cache_dir, n_threads, array, len(devs))
    sys.stdout.flush()
    print(f"llama-metaws rpc-server: {ffi.string(lib.lmws_last_error()).decode()} (status {status})",
          file=sys.stderr, flush=True)
    return 1
