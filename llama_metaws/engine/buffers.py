"""A context's compute buffers, from the scheduler through patch 0001's C calls."""

from __future__ import annotations

import dataclasses
from typing import List

from ..native.shim import address, check_error, ffi, lib


@dataclasses.dataclass(frozen=True)
class ComputeBuffer:
    index: int        # the scheduler's backend index
    buffer_type: str  # e.g. "CPU", "CUDA0"
    device: str       # the backend's device, e.g. "CPU", "CUDA0"
    size: int         # bytes allocated now
    buft: int         # the buffer type handle (ggml_backend_buffer_type_t), as an address


def context_address(ctx) -> int:
    """Accept a binding ``llama_context_p``, an ``_internals.LlamaContext``, a ``Llama`` or an int."""
    inner = getattr(ctx, "_ctx", None)  # llama_cpp.Llama
    if inner is not None:
        ctx = inner
    ctx = getattr(ctx, "ctx", ctx)  # _internals.LlamaContext
    addr = address(ctx)
    if not addr:
        raise ValueError("compute_buffers: the context is NULL (closed?)")
    return addr


def compute_buffers(ctx) -> List[ComputeBuffer]:
    """One entry per backend of the context's scheduler, in scheduler order."""
    c = ffi.cast("struct llama_context *", context_address(ctx))
    n = ffi.new("int *")
    check_error(lib.lmws_n_compute_buffers(c, n))
    out = []
    info = ffi.new("struct lmws_compute_buffer *")
    for i in range(n[0]):
        check_error(lib.lmws_get_compute_buffer(c, i, info))
        buft = ffi.string(lib.ggml_backend_buft_name(info.buft)).decode() if info.buft != ffi.NULL else ""
        dev = ffi.string(lib.ggml_backend_dev_name(info.device)).decode() if info.device != ffi.NULL else ""
        out.append(ComputeBuffer(index=i, buffer_type=buft, device=dev, size=int(info.size),
                                 buft=int(ffi.cast("uintptr_t", info.buft))))
    return out
