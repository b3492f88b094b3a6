"""Models and contexts through the binding's low-level API, on the devices the caller names.

This is the layer the CLI, the demo and the tests share: ``load_model`` fills
``llama_model_params`` (devices, split mode, tensor split, MTP layers) and returns the
binding's own ``_internals.LlamaModel``; ``new_context`` does the same for a context.
"""

from __future__ import annotations

import ctypes
import os
from typing import Optional, Sequence, Tuple, Union

from ..native.binding import _internals, llama_cpp, set_verbose
from .devices import DeviceList
from .limits import output_limits
from .rpc import local_devices
from ..native.params import set_fields

SPLIT_MODES = {
    "none": llama_cpp.LLAMA_SPLIT_MODE_NONE,
    "layer": llama_cpp.LLAMA_SPLIT_MODE_LAYER,
    "row": llama_cpp.LLAMA_SPLIT_MODE_ROW,
    "tensor": llama_cpp.LLAMA_SPLIT_MODE_TENSOR,
}


def split_mode_value(mode: Union[str, int]) -> int:
    """``"none" | "layer" | "row" | "tensor"`` or the binding's integer constants."""
    if isinstance(mode, str):
        try:
            return SPLIT_MODES[mode.lower()]
        except KeyError:
            raise ValueError(
                f"split_mode {mode!r} is not one of {', '.join(SPLIT_MODES)}"
            ) from None
    if mode not in SPLIT_MODES.values():
        raise ValueError(f"split_mode {mode!r} is not one of {sorted(SPLIT_MODES.values())}")
    return int(mode)


#: llama.cpp's model fields a Llama takes by name as keyword arguments (llama-server's -lm, -lzm,
#: --check-tensors, --repack / -nr, --no-host); left out: the binding's or llama.cpp's default
MODEL_FIELD_KWARGS = ("load_mode", "lazy_mode", "check_tensors", "use_extra_bufts", "no_host")


def model_field_kwargs(kwargs: dict) -> dict:
    """Pop :data:`MODEL_FIELD_KWARGS` out of ``kwargs``: the ``llama_model_params`` fields given."""
    return {name: kwargs.pop(name) for name in MODEL_FIELD_KWARGS if kwargs.get(name, None) is not None}


def gpu_layers(value: Union[None, int, str]) -> Union[None, int, str]:
    """``n_gpu_layers`` as llama-server takes it: a count (the binding's -1: all), ``"all"`` or
    ``"auto"`` (fitted to the free device memory, see :mod:`.fit`); None: not given."""
    if value is None or value in ("auto", "all"):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"n_gpu_layers must be a count of layers (-1: all), 'all' or 'auto', got {value!r}")
    return value


def flash_attn_type(value: Union[bool, str, None]) -> int:
    """``flash_attn`` as llama.cpp's ``flash_attn_type``: True, False (the binding's default) or
    ``"auto"``: on where the devices support it, as llama.cpp decides when it makes the context."""
    types = {True: llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED, False: llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
             None: llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED, "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO}
    if value not in types or (value is not True and value is not False and not isinstance(value, (str, type(None)))):
        raise ValueError(f"flash_attn must be True, False or 'auto', got {value!r}")
    return types[value]


class LoadedModel(_internals.LlamaModel):
    """The binding's model wrapper, keeping the device array its params point at alive."""

    device_list: Optional[DeviceList] = None
    tensor_split_array = None


def load_model(
    path: Union[str, os.PathLike],
    *,
    devices: Optional[Sequence[str]] = None,
    split_mode: Union[str, int] = "layer",
    tensor_split: Optional[Sequence[float]] = None,
    load_mtp: bool = False,
    use_mmap: bool = True,
    verbose: bool = False,
) -> LoadedModel:
    set_verbose(verbose)
    params = llama_cpp.llama_model_default_params()
    fields = dict(load_mtp=load_mtp, split_mode=split_mode_value(split_mode),
                  # the 0.3.36 binding has no use_mmap field: mmap is a load mode
                  load_mode=llama_cpp.LLAMA_LOAD_MODE_MMAP if use_mmap else llama_cpp.LLAMA_LOAD_MODE_NONE)
    device_list = None
    if devices:
        device_list = DeviceList(devices)
        fields.update(devices=device_list.pointer, n_gpu_layers=999)  # every layer on the named devices
    elif (local := local_devices()) is not None:  # RPC servers were added in this process: not on them
        device_list = DeviceList(local, allow_empty=True)
        fields.update(devices=device_list.pointer)
    ts_array = None
    if tensor_split:
        ts_array = (ctypes.c_float * llama_cpp.LLAMA_MAX_DEVICES)(*tensor_split)
        fields["tensor_split"] = ts_array
    set_fields(params, fields)
    model = LoadedModel(path_model=os.fspath(path), params=params, verbose=verbose)
    model.device_list = device_list
    model.tensor_split_array = ts_array
    return model


def context_fields(*, n_seq_max: int, draft_max: int, n_batch: int, logits_all: bool = False,
                   n_outputs_max: Optional[int] = None) -> Tuple[dict, dict]:
    """Our ``llama_context_params`` fields for a target context and for its MTP draft context.

    The one derivation that :class:`~llama_metaws.Llama`, the planner and (through ``Llama``)
    the vram harness share, so that what is planned is what is loaded. ``draft_max``: the
    longest draft (0: no drafting). The target holds ``n_seq_max`` sequences, rollback snapshots
    for a rejected draft (``n_rs_seq = draft_max``: a recurrent target rolls back rejected
    drafts), and llama-server's output rows (:func:`~llama_metaws.engine.limits.output_limits`);
    the draft context is an MTP context without rollback snapshots and one output row per
    sequence. The draft's fields are applied to a copy of the target's params
    (:func:`draft_context_params`): it takes the target's KV types, flash attention, offload,
    threads and sizes, as llama.cpp's draft-mtp does. ``n_outputs_max`` overrides both contexts'
    rows (the planner's ``--n-outputs-max``; 0: every row of a batch, llama.cpp's default).
    """
    limits = output_limits(n_seq_max, draft_max, n_batch, logits_all=logits_all)
    target = dict(n_seq_max=n_seq_max, n_rs_seq=draft_max, **limits.target.fields())
    draft = dict(ctx_type=llama_cpp.LLAMA_CONTEXT_TYPE_MTP, n_rs_seq=0, **limits.draft.fields())
    if n_outputs_max is not None:
        for fields in (target, draft):
            fields.update(n_outputs_max=n_outputs_max, n_outputs_max_per_seq=min(
                fields["n_outputs_max_per_seq"], n_outputs_max) if n_outputs_max else 0)
    return target, draft


def draft_context_params(target_params, draft_fields: dict):
    """A copy of the target's ``llama_context_params`` with the draft's fields
    (:func:`context_fields`) set on it."""
    cp = type(target_params).from_buffer_copy(target_params)
    set_fields(cp, draft_fields)
    return cp


def new_context(
    model: _internals.LlamaModel,
    *,
    n_ctx: int = 256,
    n_batch: int = 64,
    n_ubatch: Optional[int] = None,
    n_seq_max: int = 1,
    mtp: bool = False,
    n_rs_seq: int = 0,
    offload_kqv: bool = True,
    verbose: bool = False,
) -> _internals.LlamaContext:
    params = llama_cpp.llama_context_default_params()
    fields = dict(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch or n_batch, n_seq_max=n_seq_max,
                  n_rs_seq=n_rs_seq, offload_kqv=offload_kqv)
    if mtp:
        fields["ctx_type"] = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
    set_fields(params, fields)
    return _internals.LlamaContext(model=model, params=params, verbose=verbose)


def greedy_tokens(ctx: _internals.LlamaContext, prompt: Sequence[int], n: int) -> list:
    """Decode ``prompt`` from an empty memory, then take the argmax ``n`` times, one token per decode."""
    import numpy as np

    ctx.kv_cache_clear()

    n_vocab = llama_cpp.llama_vocab_n_tokens(ctx.model.vocab)
    batch = _internals.LlamaBatch(n_tokens=max(len(prompt), 1), embd=0, n_seq_max=1)
    try:
        batch.set_batch(list(prompt), n_past=0, logits_all=False)
        _decode(ctx, batch)
        out = []
        pos = len(prompt)
        for _ in range(n):
            logits = np.ctypeslib.as_array(
                llama_cpp.llama_get_logits_ith(ctx.ctx, -1), shape=(n_vocab,)
            )
            tok = int(np.argmax(logits))
            out.append(tok)
            batch.set_batch([tok], n_past=pos, logits_all=True)
            _decode(ctx, batch)
            pos += 1
        return out
    finally:
        batch.close()


def _decode(ctx: _internals.LlamaContext, batch: _internals.LlamaBatch) -> None:
    rc = llama_cpp.llama_decode(ctx.ctx, batch.batch)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")
