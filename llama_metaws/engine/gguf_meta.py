"""A GGUF file's metadata keys, read without its tensors or its big arrays.

``gguf.GGUFReader`` builds numpy views for every part of every field: for a tokenizer of
151,936 tokens that is a few hundred MB of Python objects, more than the model the file holds
at small shapes. :func:`read_keys` walks the header once, keeps the scalar and string values
asked for, and steps over everything else (arrays by their element sizes), stopping once every
key asked for is found.
"""

from __future__ import annotations

import struct
from typing import BinaryIO, Dict, Iterable

__all__ = ["read_keys", "tensor_shapes", "check_complete", "nextn_layers", "architecture"]

# GGUF value types -> struct format of one scalar (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _u32(f: BinaryIO) -> int:
    return struct.unpack("<I", _exact(f, 4))[0]


def _u64(f: BinaryIO) -> int:
    return struct.unpack("<Q", _exact(f, 8))[0]


def _exact(f: BinaryIO, n: int) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise ValueError("the file ends inside its GGUF header (truncated?)")
    return b


def _string(f: BinaryIO) -> str:
    return _exact(f, _u64(f)).decode("utf-8", errors="replace")


def _skip_array(f: BinaryIO) -> None:
    kind, count = _u32(f), _u64(f)
    if kind in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[kind]) * count, 1)
    elif kind == _STRING:
        for _ in range(count):
            f.seek(_u64(f), 1)
    elif kind == _ARRAY:
        for _ in range(count):
            _skip_array(f)
    else:
        raise ValueError(f"unknown GGUF array element type {kind}")


def _open_header(f: BinaryIO):
    """Past the magic and the counts: (tensor count, key count)."""
    if f.read(4) != b"GGUF":
        raise ValueError("not a GGUF file (no GGUF magic)")
    version = _u32(f)
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported (2 or later)")
    return _u64(f), _u64(f)


def _value(f: BinaryIO, key: str, kind: int):
    """A scalar or string value; None (stepped over) for an array."""
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack(fmt, _exact(f, struct.calcsize(fmt)))[0]
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        _skip_array(f)
        return None
    raise ValueError(f"unknown GGUF value type {kind} for {key!r}")


def check_complete(path: str) -> None:
    """Raise ``ValueError`` unless the file holds every byte its tensor table points at."""
    import gguf  # the block sizes of ggml's types

    with open(path, "rb") as f:
        n_tensors, n_kv = _open_header(f)
        alignment = 32
        for _ in range(n_kv):
            key = _string(f)
            value = _value(f, key, _u32(f))
            if key == "general.alignment":
                alignment = int(value)
        end = 0
        for _ in range(n_tensors):
            _string(f)
            dims = [_u64(f) for _ in range(_u32(f))]
            kind, offset = _u32(f), _u64(f)
            try:
                block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
            except (KeyError, ValueError):
                raise ValueError(f"unknown ggml tensor type {kind}") from None
            n = 1
            for d in dims:
                n *= d
            end = max(end, offset + n // block * size)
        start = -(-f.tell() // alignment) * alignment
        f.seek(0, 2)
        if f.tell() < start + end:
            raise ValueError(f"its tensors need {start + end} bytes, the file has {f.tell()}")


def read_keys(path: str, keys: Iterable[str]) -> Dict[str, object]:
    """The values of ``keys`` (scalars and strings) found in the GGUF file at ``path``.

    Keys the file lacks are left out. Raises ``ValueError`` for a file that is not GGUF or is
    cut short, ``OSError`` for one that cannot be opened.
    """
    wanted = set(keys)
    found: Dict[str, object] = {}
    with open(path, "rb") as f:
        _, n_kv = _open_header(f)
        for _ in range(n_kv):
            if not wanted - found.keys():
                break
            key = _string(f)
            value = _value(f, key, _u32(f))
            if key in wanted and value is not None:
                found[key] = value
    return found


def tensor_shapes(path: str) -> Dict[str, tuple]:
    """Every tensor's name and dimensions (ggml's ``ne``, the row length first), from the
    file's tensor table; the data is not read. ``ValueError`` as :func:`read_keys`."""
    with open(path, "rb") as f:
        n_tensors, n_kv = _open_header(f)
        for _ in range(n_kv):
            key = _string(f)
            _value(f, key, _u32(f))
        out: Dict[str, tuple] = {}
        for _ in range(n_tensors):
            name = _string(f)
            out[name] = tuple(_u64(f) for _ in range(_u32(f)))
            f.seek(12, 1)  # the type (u32) and the data offset (u64)
    return out


def nextn_layers(path: str) -> tuple:
    """(architecture, nextn_predict_layers) from the file's metadata, without loading it."""
    try:
        arch = read_keys(path, ["general.architecture"]).get("general.architecture")
        if arch is None:
            raise ValueError(f"{path} has no general.architecture: not a llama.cpp model")
        n = read_keys(path, [f"{arch}.nextn_predict_layers"]).get(f"{arch}.nextn_predict_layers", 0)
        check_complete(path)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        if "general.architecture" in str(e):
            raise
        raise ValueError(f"{path} is not a readable GGUF model (truncated?): {e}") from None
    return arch, int(n)


def architecture(path: str):
    """``general.architecture`` of the file, or None where it has none or cannot be read (the
    loader then says why)."""
    try:
        return read_keys(path, ["general.architecture"]).get("general.architecture")
    except (OSError, ValueError, UnicodeDecodeError):
        return None
