"""llama.cpp's own fitting of the parameters left at their defaults to the free device memory.

llama-server's ``--fit on`` (its default) calls ``common_fit_params`` (``common/fit.cpp``) before it
loads the model: ``-ngl auto`` becomes the layers (and the tensor split and buffer overrides) that
fit each device with ``--fit-target`` MiB to spare, and ``-c 0`` the model's training context, cut
down towards ``--fit-ctx`` where memory is short. A CPU-only build has no devices to fit: its
``auto`` is every layer (on the CPU) and only the context is checked against the host's memory.
Under ``-sm tensor`` llama.cpp does not fit (it says so and leaves the parameters as they are).

:func:`fit` runs that same code, through the shim (``native/fit.cpp``), on parameters built as
:class:`~llama_metaws.Llama` will build them (with its MTP draft context beside the target, as
llama-server fits ``--spec-type draft-mtp``), and returns what llama.cpp chose.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from typing import Optional, Sequence, Union

from ..native.binding import llama_cpp
from ..native.params import set_fields
from ..native.shim import check_error, ffi, lib

#: llama-server's --fit-target default: MiB left free on each device
FIT_TARGET_MIB = 1024
#: llama-server's --fit-ctx default: the least context the fit may cut -c 0 down to
FIT_MIN_CTX = 4096
#: the least context for an explicit -c 0: the whole training context, never cut (llama-server's)
FULL_CONTEXT = 0xFFFFFFFF
#: llama.cpp's n_gpu_layers default (llama_model_default_params): the one value the fit changes
AUTO_LAYERS = -1

STATUS = {0: "fitted", 1: "could not fit", 2: "error"}

_lock = threading.Lock()  # common_fit_params swaps llama's process-wide log callback


class _BuftOverride(ctypes.Structure):
    """``struct llama_model_tensor_buft_override`` (llama.h), which the binding does not declare."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@dataclasses.dataclass
class Fitted:
    """What the fit left: ``n_gpu_layers`` (-1: every layer, unchanged), ``n_ctx``,
    ``tensor_split`` (None: unchanged), ``overrides`` (the tensor buffer overrides llama.cpp wrote,
    an array to point ``llama_model_params.tensor_buft_overrides`` at and keep alive while the model
    loads; None: none) and ``status`` (0 fitted, 1 could not fit, 2 an error: the parameters as
    they were, or as far as the fit got, which llama-server loads all the same)."""

    n_gpu_layers: int
    n_ctx: int
    tensor_split: Optional[list]
    overrides: Optional[ctypes.Array]
    status: int

    @property
    def verdict(self) -> str:
        return STATUS.get(self.status, f"status {self.status}")


def margins_bytes(target_mib: Union[int, Sequence[int]]) -> list:
    """-fitt: one MiB count for every device, or one per device (the devices after those: the
    default, as llama-server reads the list)."""
    n = llama_cpp.llama_max_devices()
    values = [int(target_mib)] if isinstance(target_mib, (int, float)) else [int(v) for v in target_mib]
    if not values or any(v < 0 for v in values):
        raise ValueError(f"fit target: MiB to leave free per device, each >= 0, got {target_mib!r}")
    if len(values) > n:
        raise ValueError(f"fit target: {len(values)} values, but llama.cpp handles at most {n} devices")
    values += [values[0] if len(values) == 1 else FIT_TARGET_MIB] * (n - len(values))
    return [v << 20 for v in values]


def fit(model_path: str, *, model_fields: dict, context_fields: dict, draft_fields: Optional[dict] = None,
        draft_path: Optional[str] = None, target_mib: Union[int, Sequence[int]] = FIT_TARGET_MIB,
        n_ctx_min: int = FIT_MIN_CTX, verbose: bool = False) -> Fitted:
    """Fit ``n_gpu_layers`` (when it is -1) and ``n_ctx`` (when it is 0) with llama.cpp's
    ``common_fit_params``. ``model_fields`` / ``context_fields``: ``llama_model_params`` /
    ``llama_context_params`` fields over llama.cpp's defaults (by the names the binding's structs
    declare); ``draft_fields``: the MTP draft context's fields over the target's (None: no draft);
    ``draft_path``: the draft's own model file (``-md``; None: the draft runs on the target's
    weights). A ValueError for bad arguments, a LlamaMetawsError when llama.cpp throws."""
    if isinstance(n_ctx_min, bool) or not isinstance(n_ctx_min, int) or not 0 <= n_ctx_min <= FULL_CONTEXT:
        raise ValueError(f"fit: the least context must be an integer >= 0, got {n_ctx_min!r}")
    margins = ffi.new("size_t[]", margins_bytes(target_mib))
    mparams = llama_cpp.llama_model_default_params()
    set_fields(mparams, model_fields)
    cparams = llama_cpp.llama_context_default_params()
    set_fields(cparams, context_fields)
    dparams = None
    if draft_fields is not None:
        dparams = type(cparams).from_buffer_copy(cparams)
        set_fields(dparams, draft_fields)
    n_dev = llama_cpp.llama_max_devices()
    split = (ctypes.c_float * n_dev)()
    overrides = (_BuftOverride * int(llama_cpp.llama_max_tensor_buft_overrides()))()
    status = ffi.new("int *")
    with _lock:
        check_error(lib.lmws_fit_params(
            model_path.encode("utf-8"), _ptr("struct llama_model_params *", mparams),
            _ptr("struct llama_context_params *", cparams), _ptr("float *", split),
            _ptr("struct llama_model_tensor_buft_override *", overrides), margins, n_ctx_min,
            _ptr("struct llama_context_params *", dparams) if dparams is not None else ffi.NULL,
            draft_path.encode("utf-8") if draft_path is not None and dparams is not None else ffi.NULL,
            bool(verbose), status))
    ts_set = ctypes.cast(mparams.tensor_split, ctypes.c_void_p).value == ctypes.addressof(split)
    tbo_set = (mparams.tensor_buft_overrides or 0) == ctypes.addressof(overrides)
    return Fitted(n_gpu_layers=int(mparams.n_gpu_layers), n_ctx=int(cparams.n_ctx),
                  tensor_split=list(split) if ts_set else None, overrides=overrides if tbo_set else None,
                  status=int(status[0]))


def _ptr(ctype: str, obj) -> object:
    return ffi.cast(ctype, ctypes.addressof(obj))
