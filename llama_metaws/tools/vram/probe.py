"""ggml's own accounting of watched contexts, read in the decoding thread right after each decode.

``ContextGroup`` reads a target, its draft and their workspace (a shared entry once, a meta buffer
on each of its devices); ``DECODE_HOOK`` wraps the binding's ``llama_decode`` while anything listens.
See docs/vram.md for why the figures are read there.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Sequence


def device_keys(names: Sequence[str]) -> List[str]:
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


class ContextGroup:
    """Contexts read together: a target, its draft, their workspace, their model."""

    def __init__(self, contexts, workspace=None, devices: Optional[Sequence[str]] = None,
                 model=None, llm=None):
        from ...native.shim import address
        from ...engine.buffers import context_address

        self.contexts = [c for c in contexts if c is not None]
        if not self.contexts:
            raise ValueError("watch: no open context to watch")
        self.workspace = workspace
        self.meta_keys = device_keys(list(devices)) if devices else []
        self.addresses = {context_address(c) for c in self.contexts}
        self.address = address
        self.llm = llm
        self.weights = None
        if model is not None:
            from ...native.binding import llama_cpp

            self.weights = int(llama_cpp.llama_model_size(model))
        self.values: Dict[str, int] = {}
        self.meta_unknown = False

    @classmethod
    def from_llama(cls, llm, devices=None) -> "ContextGroup":
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
        from ...native.binding import llama_cpp
        from ...engine.buffers import compute_buffers

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
        from ...native.binding import llama_cpp, llama_cpp_lib as low

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


DECODE_HOOK = _DecodeHook()
