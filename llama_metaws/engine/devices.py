"""ggml's devices, by the names llama.cpp prints ("CPU", "CUDA0", ...)."""

from __future__ import annotations

import ctypes
import dataclasses
from typing import List, Optional, Sequence

from ..native.shim import ffi, lib

_TYPE_NAMES = {
    lib.GGML_BACKEND_DEVICE_TYPE_CPU: "cpu",
    lib.GGML_BACKEND_DEVICE_TYPE_GPU: "gpu",
    lib.GGML_BACKEND_DEVICE_TYPE_IGPU: "igpu",
    lib.GGML_BACKEND_DEVICE_TYPE_ACCEL: "accel",
}


@dataclasses.dataclass(frozen=True)
class Device:
    index: int
    name: str
    description: str
    type: str  # "cpu" | "gpu" | "igpu" | "accel"
    memory_free: int
    memory_total: int
    handle: int  # the ggml_backend_dev_t, as an address


def _str(p) -> str:
    return ffi.string(p).decode("utf-8", "replace") if p != ffi.NULL else ""


def list_devices() -> List[Device]:
    """Every device ggml's registry knows, in registry order."""
    out = []
    free = ffi.new("size_t *")
    total = ffi.new("size_t *")
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        lib.ggml_backend_dev_memory(dev, free, total)
        out.append(Device(
            index=i,
            name=_str(lib.ggml_backend_dev_name(dev)),
            description=_str(lib.ggml_backend_dev_description(dev)),
            type=_TYPE_NAMES.get(lib.ggml_backend_dev_type(dev), "unknown"),
            memory_free=free[0],
            memory_total=total[0],
            handle=int(ffi.cast("uintptr_t", dev)),
        ))
    return out


def find_device(name: str) -> Device:
    """The device called ``name`` (case-insensitive); ValueError lists the ones there are."""
    devices = list_devices()
    for d in devices:
        if d.name.lower() == name.lower():
            return d
    there = ", ".join(d.name for d in devices) or "none"
    raise ValueError(f"unknown device {name!r}; the devices here are: {there}")


class DeviceList:
    """A NULL-terminated ``ggml_backend_dev_t`` array for ``llama_model_params.devices``.

    The same device may appear twice (two CPU devices make a CPU test bed). Keep this object
    alive as long as the params that point at it.
    """

    def __init__(self, names: Sequence[str], *, allow_empty: bool = False):
        if not names and not allow_empty:  # empty, where allowed: the CPU alone
            raise ValueError("devices: give at least one device name")
        self.devices = [find_device(n) for n in names]
        self._array = (ctypes.c_void_p * (len(self.devices) + 1))(
            *[d.handle for d in self.devices], None
        )

    @property
    def pointer(self) -> ctypes.c_void_p:
        return ctypes.cast(self._array, ctypes.c_void_p)

    def __len__(self) -> int:
        return len(self.devices)


def check_tensor_split(device_list: Optional[DeviceList], kwargs: dict) -> None:
    """A tensor split's arguments, checked before anything is loaded: a ValueError that names the
    option to change. Turns flash attention on in ``kwargs`` (llama.cpp refuses a tensor-split
    context without it).

    ``offload_kqv=False`` (llama.cpp's ``-nkvo``) keeps the KV cache in host memory, where each
    device of the split works on its own KV heads in place (patches 0014-0016): only devices that compute
    on host memory can, i.e. CPU devices; anything else would abort in the meta backend.
    """
    devices = device_list.devices if device_list else [d for d in list_devices() if d.type != "cpu"]
    if len(devices) < 2:
        raise ValueError(
            "split_mode='tensor' splits every tensor over several devices: give at least two, "
            "e.g. devices=['CPU', 'CPU'] for a CPU test bed")
    if kwargs.get("flash_attn") is False:
        raise ValueError("split_mode='tensor' needs flash attention: leave flash_attn at its "
                         "default or set it to True")
    kwargs["flash_attn"] = True
    not_host = [d.name for d in devices if d.type != "cpu"]
    if not kwargs.get("offload_kqv", True) and not_host:
        raise ValueError(
            "offload_kqv=False (-nkvo) under split_mode='tensor' keeps the KV cache in host memory, "
            f"which only CPU devices compute on in place, and {', '.join(not_host)} is not one: "
            "set offload_kqv=True (KV on the devices) or split_mode='layer'")
