"""Setting fields of the binding's ctypes structs by the names they declare, and nothing else.

ctypes accepts any attribute on a ``Structure``: ``params.use_mmap = False`` on a
``llama_model_params`` that has no such field is stored on the Python object and llama.cpp
never sees it. :func:`set_fields` refuses such a name (``AttributeError`` naming the struct and
what it does declare) and reads every value back, so a typo or a binding that renamed a field
fails at once instead of being silently ignored.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, Dict, Iterable


def declared_fields(struct: ctypes.Structure) -> Iterable[str]:
    names = []
    for cls in type(struct).__mro__:
        names.extend(name for name, *_ in getattr(cls, "_fields_", ()))
    return names


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, ctypes.c_void_p):
        want = want.value
    if isinstance(got, ctypes.c_void_p):
        got = got.value
    if isinstance(want, bool) or isinstance(got, bool):
        return bool(got) == bool(want)
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        return got == want
    if want is None:
        return not got
    return True  # pointers and arrays: ctypes converts them; their identity is not comparable


def set_fields(struct: ctypes.Structure, fields: Dict[str, Any]) -> None:
    """``struct.<name> = value`` for each item, only for names ``struct``'s type declares."""
    declared = set(declared_fields(struct))
    for name, value in fields.items():
        if name not in declared:
            raise AttributeError(
                f"{type(struct).__name__} has no field {name!r} (it declares: "
                f"{', '.join(sorted(declared))})")
        setattr(struct, name, value)
        if not _same(getattr(struct, name), value):
            raise ValueError(f"{type(struct).__name__}.{name} = {value!r} did not take "
                             f"(it reads back {getattr(struct, name)!r})")


def check_fields(struct: ctypes.Structure, fields: Dict[str, Any], what: str) -> None:
    """Every item of ``fields`` is what ``struct`` holds now; RuntimeError names each that is not."""
    wrong = []
    for name, value in fields.items():
        got = getattr(struct, name)
        if isinstance(value, ctypes.c_void_p):
            ok = (got or 0) == (value.value or 0)
        else:
            ok = _same(got, value)
        if not ok:
            wrong.append(f"{what}.{name} = {value!r} (it has {got!r})")
    if wrong:
        raise RuntimeError(f"llama.cpp did not get {', '.join(wrong)}: "
                           "the binding built its params in a way llama-metaws does not know")


def keeping(struct: ctypes.Structure, names: Iterable[str]) -> ctypes.Structure:
    """A copy of ``struct`` whose fields ``names`` keep the values they hold: a later write to one
    of them is dropped. For params the binding fills after we set our fields on them (it writes
    its own ``flash_attn_type`` and ``load_mode`` from its keyword arguments): ours stay. The copy
    is an instance of a subclass of the struct's type, which ctypes passes wherever the struct goes."""
    out = _keeping_type(type(struct)).from_buffer_copy(struct)
    out.__dict__["_kept"] = frozenset(names)
    return out


@functools.lru_cache(maxsize=None)
def _keeping_type(base: type) -> type:
    def __setattr__(self, name, value):
        if name in self.__dict__.get("_kept", ()):
            return
        base.__setattr__(self, name, value)

    return type(base.__name__, (base,), {"__setattr__": __setattr__})
