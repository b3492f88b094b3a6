"""A model's ``<arch>.*`` metadata keys, written the same way by every builder."""

from __future__ import annotations

from typing import Dict


def add_metadata(writer, arch: str, kv: Dict[str, object]) -> None:
    """``<arch>.<key>`` for each of ``kv``: bools, ints as uint32, floats as float32, lists as
    arrays."""
    for key, value in kv.items():
        full = f"{arch}.{key}"
        if isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        elif isinstance(value, float):
            writer.add_float32(full, value)
        elif isinstance(value, list):
            writer.add_array(full, value)
        else:  # pragma: no cover - programming error
            raise TypeError(f"unsupported metadata value for {full}: {value!r}")
