"""``POST /slots/{id}?action=save|restore|erase`` with ``--slot-save-path``, as llama-server has it.

``save`` and ``restore`` take ``{"filename": NAME}``: a file name inside the slot-save directory
(llama-server's check: no path separator, no ``..``, no control or reserved character, no leading
or trailing space, no trailing dot, at most 255 bytes). Each action runs once no request runs
(llama-server defers it until the slot is free) and answers llama-server's fields: ``id_slot``,
``filename``, ``n_saved`` / ``n_restored`` (tokens), ``n_written`` / ``n_read`` (bytes) and
``timings.save_ms`` / ``restore_ms``; ``erase``: ``id_slot``, ``n_erased``. The file holds the
whole slot, the MTP draft context and the checkpoints of a hybrid target included
(:mod:`llama_metaws.engine.slot_files`): a restored slot's next request reuses its prefix.
"""

from __future__ import annotations

import os
import time
import unicodedata
from typing import Optional

from .errors import RequestError

ACTIONS = ("save", "restore", "erase")
_RESERVED = set(':*?"<>|/\\')
_LOOKALIKES = {"\uff0e", "\u2215", "\u2216", "\ufffd", "\ufeff"}  # fullwidth dot, slashes, U+FFFD, BOM


def _bad(message: str, param: Optional[str] = None) -> RequestError:
    return RequestError(400, message, param=param, code="invalid_value")


def valid_filename(name) -> bool:
    """llama-server's ``fs_validate_filename`` (without subdirectories), on a Python string."""
    if not isinstance(name, str) or not name or len(name.encode("utf-8", "surrogatepass")) > 255:
        return False
    for c in name:
        o = ord(c)
        if o <= 0x1F or o == 0x7F or 0x80 <= o <= 0x9F or 0xD800 <= o <= 0xDFFF or c in _RESERVED \
                or c in _LOOKALIKES or unicodedata.category(c) == "Cs":
            return False
    return not (name[0] == " " or name[-1] in " .") and ".." not in name and name != "."


def slot_action(llm, save_path: Optional[str], id_slot: str, action: Optional[str], body: dict) -> dict:
    """The action's answer (blocking: run it off the event loop)."""
    if not save_path:
        raise RequestError(501, "This server does not support slots action. Start it with `--slot-save-path`",
                           type="not_supported_error", code="slot_actions_unsupported")
    try:
        slot = int(id_slot)
    except ValueError:
        raise _bad("Invalid slot ID", "id_slot") from None
    if not 0 <= slot < len(llm.slots()):
        raise _bad("Invalid slot ID", "id_slot")
    if action not in ACTIONS:
        raise _bad("Invalid action", "action")
    if action == "erase":
        return {"id_slot": slot, "n_erased": llm.erase_slot(slot)}
    filename = body.get("filename")
    if not valid_filename(filename):
        raise _bad("Invalid filename", "filename")
    path = os.path.join(save_path, filename)
    t0 = time.perf_counter()
    if action == "save":
        try:
            n, size = llm.save_slot(slot, path)
        except OSError as e:
            raise RequestError(500, f"Unable to save slot: {e.strerror or e}", type="server_error",
                               code="slot_save_failed") from None
        return {"id_slot": slot, "filename": filename, "n_saved": n, "n_written": size,
                "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}}
    try:
        n, size = llm.restore_slot(slot, path)
    except FileNotFoundError:
        raise _bad(f"Unable to restore slot: no file {filename!r} in the slot-save directory",
                   "filename") from None
    except (ValueError, OSError) as e:
        raise _bad(f"Unable to restore slot: {e}", "filename") from None
    return {"id_slot": slot, "filename": filename, "n_restored": n, "n_read": size,
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}}
