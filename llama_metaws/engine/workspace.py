"""The phase-aware workspace: a target context and its MTP draft share compute buffers.

``Workspace(target, draft)`` opts both contexts in and attaches the draft (borrower) to the
target (owner) through patch 0005's ``llama_attach_shared_workspace``; from then on they share
one resizable compute buffer per buffer type, prompt-sized while a prompt is processed and
decode-sized while decoding. ``stats()`` reports each shared entry from ggml's own accounting.

Modes (they differ only for meta buffers, i.e. under ``split_mode="tensor"``):

- ``"alias"`` (default): share; a meta buffer is shared through a borrower alias
  (``ggml_backend_meta_buffer_alias``): the draft computes in a second meta buffer over the
  same per-device memory, with tensor maps of its own;
- ``"private-meta"``: share, but meta buffers stay private to each context (no crash, no
  saving under tensor split);
- ``"unsafe-shared"``: share meta buffers without an alias. The draft's graph clears the
  target's tensor maps and the target's next decode aborts the process with
  ``GGML_ASSERT(tensor)``: it exists only to reproduce that, and refuses to run unless
  ``allow_unsafe=True``;
- ``"off"``: both contexts keep private buffers (nothing is attached).

A pair that is not eligible falls back to private buffers with a ``WorkspaceWarning``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import List

from ..native.shim import check_error, ffi, lib
from .buffers import compute_buffers, context_address

MODES = ("alias", "private-meta", "unsafe-shared", "off")
_META_SHARING = {"alias": "LLAMA_WORKSPACE_META_ALIAS", "private-meta": "LLAMA_WORKSPACE_META_PRIVATE",
                 "unsafe-shared": "LLAMA_WORKSPACE_META_UNSAFE"}


class WorkspaceWarning(UserWarning):
    """The contexts could not share a workspace and keep private buffers."""


@dataclasses.dataclass(frozen=True)
class WorkspaceEntry:
    """One compute buffer type as the workspace sees it (bytes from ggml's accounting)."""

    buffer_type: str
    device: str
    shared: bool          # a shared entry (False: private to one context)
    alias: bool           # the borrower computes through a meta-buffer alias
    owner_need: int       # the target's published requirement
    borrower_need: int    # the draft's published requirement
    allocated: int        # bytes allocated now (for a shared entry: once, for both)
    generation: int       # replacements of this buffer's memory
    n_grow: int
    n_shrink: int


@dataclasses.dataclass(frozen=True)
class WorkspaceInfo:
    """Per-context state of the pairing (``llama_get_workspace_info``)."""

    enabled: bool
    paired: bool
    owner: bool
    generation: int
    shrink_epoch: int
    n_phase_tokens: int
    n_rebuilds: int
    n_handoff_syncs: int


def _context_ptr(ctx, what: str):
    if getattr(ctx, "ctx", None) is None:
        raise ValueError(f"workspace: the {what} context is closed or not a llama context")
    return ffi.cast("struct llama_context *", context_address(ctx))


def context_info(ctx) -> WorkspaceInfo:
    info = ffi.new("struct llama_workspace_info *")
    check_error(lib.lmws_workspace_info(_context_ptr(ctx, "given"), info))
    return WorkspaceInfo(
        enabled=bool(info.enabled), paired=bool(info.paired), owner=bool(info.owner),
        generation=int(info.generation), shrink_epoch=int(info.shrink_epoch),
        n_phase_tokens=int(info.n_phase_tokens), n_rebuilds=int(info.n_rebuilds),
        n_handoff_syncs=int(info.n_handoff_syncs),
    )


def _entries(ctx, role: str) -> List[tuple]:
    """(buft address, WorkspaceEntry) for each distinct buffer type of one context."""
    c = _context_ptr(ctx, role)
    st = ffi.new("struct llama_compute_buffer_state *")
    out, seen = [], set()
    for b in compute_buffers(ctx):
        if b.buft in seen:
            continue  # a buffer type used by two backends has one buffer
        seen.add(b.buft)
        check_error(lib.lmws_compute_buffer_state(c, b.index, st))
        if not st.resizable:  # not in the workspace: its need is what it holds
            need = int(st.allocated)
            owner_need, borrower_need = (need, 0) if role == "target" else (0, need)
        else:  # ggml reports each role's published requirement
            owner_need, borrower_need = int(st.owner_need), int(st.borrower_need)
        out.append((b.buft, WorkspaceEntry(
            buffer_type=b.buffer_type, device=b.device, shared=bool(st.shared), alias=bool(st.alias),
            owner_need=owner_need, borrower_need=borrower_need, allocated=int(st.allocated),
            generation=int(st.generation), n_grow=int(st.n_grow), n_shrink=int(st.n_shrink),
        )))
    return out


class Workspace:
    """Attach an MTP draft context (borrower) to its target context (owner).

    ``target`` and ``draft`` are the binding's ``_internals.LlamaContext`` objects (the draft
    made with ``ctx_type = LLAMA_CONTEXT_TYPE_MTP``). ``n_decode_tokens`` is the largest batch
    treated as decoding (for MTP: ``n_seq_max * (draft_max + 1)``); larger batches get the
    prompt-sized reservation. The workspace keeps references to both contexts; ``close()`` (or
    leaving a ``with`` block) detaches them. Either context may also be closed first.
    """

    def __init__(self, target, draft, *, mode: str = "alias", n_decode_tokens: int = 0,
                 allow_unsafe: bool = False):
        if mode not in MODES:
            raise ValueError(f"workspace mode {mode!r} is not one of {', '.join(MODES)}")
        if mode == "unsafe-shared" and not allow_unsafe:
            raise ValueError(
                "workspace mode 'unsafe-shared' aborts the process under tensor split "
                "(GGML_ASSERT(tensor)); it exists to reproduce that crash: pass allow_unsafe=True "
                "to run it, or use mode='alias'")
        if n_decode_tokens < 0:
            raise ValueError("n_decode_tokens must be >= 0")
        self.target = target
        self.draft = draft
        self.mode = mode
        self.shared = False
        t, d = _context_ptr(target, "target"), _context_ptr(draft, "draft")
        if mode == "off":
            return
        check_error(lib.lmws_workspace_enable(t, True, n_decode_tokens))
        check_error(lib.lmws_workspace_enable(d, True, n_decode_tokens))
        check_error(lib.lmws_workspace_set_meta_sharing(t, getattr(lib, _META_SHARING[mode])))
        status = check_error(lib.lmws_workspace_attach(d, t))
        if status == lib.LMWS_NOT_ELIGIBLE:
            warnings.warn(
                "the draft and target contexts cannot share a workspace (llama.cpp's log says "
                "why); both keep private compute buffers", WorkspaceWarning, stacklevel=2)
        else:
            self.shared = True

    def stats(self) -> List[WorkspaceEntry]:
        """Each distinct compute buffer type of the pair, a shared entry listed once (a draft of
        another model split over the same devices has a meta buffer type of its own, named as the
        target's, whose shared entry is the target's)."""
        out: List[WorkspaceEntry] = []
        shared_keys = set()
        for key, entry in _entries(self.target, "target"):
            out.append(entry)
            if entry.shared:
                shared_keys.update((key, entry.buffer_type))
        for key, entry in _entries(self.draft, "draft"):
            if not entry.shared or (key not in shared_keys and entry.buffer_type not in shared_keys):
                out.append(entry)
        return out

    def allocated(self) -> int:
        """Compute bytes held by the pair now."""
        return sum(e.allocated for e in self.stats())

    def info(self) -> tuple:
        """(target's, draft's) ``WorkspaceInfo``."""
        return context_info(self.target), context_info(self.draft)

    def detach(self) -> None:
        """Both contexts go back to private buffers (reserved again at their next decode)."""
        if self.shared and getattr(self.target, "ctx", None) is not None:
            check_error(lib.lmws_workspace_detach(_context_ptr(self.target, "target")))
        elif self.shared and getattr(self.draft, "ctx", None) is not None:
            check_error(lib.lmws_workspace_detach(_context_ptr(self.draft, "draft")))
        self.shared = False

    close = detach

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def inject_alloc_failure(n: int, *, count: int = 1, min_size: int = 0) -> None:
    """Testing: make backend buffer allocations fail as if the device were out of memory.

    From the n-th following allocation on, the next ``count`` allocations of at least
    ``min_size`` bytes fail (``count=-1``: every one of them, until ``inject_alloc_failure(0)``);
    ``n=0`` disarms. Process-wide (patch 0004). ``NotImplementedError`` when the build has no
    injector (ggml built with ``-DGGML_ALLOC_FAULT_INJECTION=OFF``; llama-metaws builds turn it on).
    """
    for name, value in (("n", n), ("count", count), ("min_size", min_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if n < 0:
        raise ValueError("n must be >= 0")
    if count < 1 and count != -1:
        raise ValueError("count must be >= 1, or -1 for every allocation until disarmed")
    if min_size < 0:
        raise ValueError("min_size must be >= 0")
    if n > 2**31 - 1 or count > 2**31 - 1:
        raise ValueError("n and count must fit in a C int")
    check_error(lib.lmws_inject_alloc_failure(n, count, min_size))


def private_bytes(ctx) -> int:
    """Compute bytes one context holds on its own (its distinct buffer types)."""
    return sum(e.allocated for _, e in _entries(ctx, "context"))


__all__ = ["Workspace", "WorkspaceEntry", "WorkspaceInfo", "WorkspaceWarning", "MODES",
           "context_info", "inject_alloc_failure", "private_bytes"]
