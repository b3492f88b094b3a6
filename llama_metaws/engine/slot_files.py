"""A slot saved to a file and restored from it: llama-server's ``/slots/{id}?action=save|restore``.

llama-server saves the target context's sequence and the tokens it holds
(``llama_state_seq_save_file``). A slot here holds more than that, and all of it is saved, so a
restored slot's next request reuses its prefix exactly as the slot it came from would have:

- the target's sequence (``llama_state_seq_get_data``: its attention KV and, for a recurrent or
  hybrid target, its recurrent state);
- the MTP draft context's sequence, and the target's hidden row of the last position held (the
  next token fed to the draft context pairs with it);
- the target's rows kept at chosen positions (:attr:`Slot.rows`, for a cut there);
- the slot's context checkpoints (:mod:`.checkpoints`: a recurrent target's state at earlier
  positions, each with its tokens and row).

The file: ``MAGIC``, a little-endian u32 version and u64 header length, a JSON header (the
model's identity, the blobs' names, sizes and shapes), then the blobs in the header's order. A
file from another model (its description, vocabulary or width differ), another version, a
truncated or altered file, or one saved with drafting into a slot without it (or the reverse) is
refused with a ``ValueError`` and the slot is left empty (as llama-server clears a slot whose
restore failed); so is one holding more tokens than the
slot's context. Everything here runs on the engine's thread while the slot is idle.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
from typing import Dict, List, Optional, Tuple

import numpy as np

from ..native.binding import llama_cpp
from .checkpoints import Checkpoint

__all__ = ["MAGIC", "VERSION", "save", "restore", "erase"]

MAGIC = b"LMWSSLOT"
VERSION = 1
_HEAD = struct.Struct("<IQ")  # version, header length
_MAX_HEADER = 1 << 24


def _vocab_sha256(engine) -> str:
    """A digest of the vocabulary's token texts, computed once per engine."""
    got = getattr(engine, "_vocab_sha256", None)
    if got is None:
        h = hashlib.sha256()
        for t in range(engine.n_vocab):
            h.update(llama_cpp.llama_vocab_get_text(engine.vocab, t) or b"")
            h.update(b"\0")
        got = engine._vocab_sha256 = h.hexdigest()
    return got


def _identity(engine) -> dict:
    """What a file must match: the model's description, size, vocabulary (a digest of its texts),
    width, and whether the slot drafts. (Two models alike in all of these but their weights are not
    told apart.)"""
    model = llama_cpp.llama_get_model(engine.target.ctx)
    buf = ctypes.create_string_buffer(256)
    llama_cpp.llama_model_desc(model, buf, len(buf))
    return {"desc": buf.value.decode("utf-8", "replace"), "n_vocab": engine.n_vocab, "n_embd": engine.n_embd,
            "n_params": int(llama_cpp.llama_model_n_params(model)), "vocab_sha256": _vocab_sha256(engine),
            "drafting": engine.draft is not None}


def _seq_state(ctx, seq_id: int) -> bytes:
    size = int(llama_cpp.llama_state_seq_get_size(ctx, seq_id))
    buf = (ctypes.c_uint8 * max(size, 1))()
    got = int(llama_cpp.llama_state_seq_get_data(ctx, buf, size, seq_id))
    if got != size:
        raise RuntimeError(f"llama_state_seq_get_data wrote {got} of {size} bytes")
    return bytes(buf)[:size]


def _set_seq_state(ctx, blob: bytes, seq_id: int) -> bool:
    if not blob:
        return False
    buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
    return int(llama_cpp.llama_state_seq_set_data(ctx, buf, len(blob), seq_id)) == len(blob)


class _Writer:
    def __init__(self) -> None:
        self.entries: List[dict] = []
        self.blobs: List[bytes] = []

    def add(self, name: str, data, **meta) -> None:
        raw = data if isinstance(data, bytes) else np.ascontiguousarray(data).tobytes()
        self.entries.append(dict(meta, name=name, size=len(raw)))
        self.blobs.append(raw)

    def array(self, name: str, a: np.ndarray, **meta) -> None:
        self.add(name, a, dtype=str(a.dtype), shape=list(a.shape), **meta)


def save(engine, slot, path: str) -> Tuple[int, int]:
    """Write ``slot`` (idle) to ``path``: (tokens saved, bytes written)."""
    n = slot.n
    w = _Writer()
    w.array("tokens", np.asarray(slot.tokens[:n], dtype=np.intc))
    w.add("target", _seq_state(engine.target.ctx, slot.seq_id))
    if engine.draft is not None:
        w.add("draft", _seq_state(engine.draft.ctx, slot.seq_id))
    if slot.pending is not None:
        w.array("pending", np.asarray(slot.pending, dtype=np.float32))
    rows = dict(slot.rows)
    rows.update(slot.recent)
    for pos in sorted(p for p in rows if p < n):
        w.array("row", np.asarray(rows[pos], dtype=np.float32), pos=int(pos))
    for cp in slot.checkpoints.items:
        w.array("cp_tokens", np.asarray(cp.tokens, dtype=np.intc), n_tokens=int(cp.n_tokens))
        w.add("cp_state", cp.state)
        if cp.row is not None:
            w.array("cp_row", np.asarray(cp.row, dtype=np.float32))
    header = json.dumps({"model": _identity(engine), "n_tokens": int(n), "blobs": w.entries}).encode()
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(MAGIC + _HEAD.pack(VERSION, len(header)) + header)
        for blob in w.blobs:
            f.write(blob)
        size = f.tell()
    os.replace(tmp, path)  # a reader never sees half a file
    return n, size


def _read(path: str) -> Tuple[dict, List[Tuple[dict, bytes]], int]:
    with open(path, "rb") as f:
        data = f.read()
    start = len(MAGIC) + _HEAD.size
    if len(data) < start or data[:len(MAGIC)] != MAGIC:
        raise ValueError("not a llama-metaws slot file")
    version, n_header = _HEAD.unpack_from(data, len(MAGIC))
    if version != VERSION:
        raise ValueError(f"a slot file of version {version}; this server reads version {VERSION}")
    if n_header > min(_MAX_HEADER, len(data) - start):
        raise ValueError("the slot file is truncated")
    try:
        header = json.loads(data[start:start + n_header])
        entries = list(header["blobs"])
    except (ValueError, KeyError, TypeError):
        raise ValueError("the slot file's header is damaged") from None
    off, blobs = start + n_header, []
    for e in entries:
        size = e.get("size") if isinstance(e, dict) else None
        if not isinstance(size, int) or size < 0 or off + size > len(data):
            raise ValueError("the slot file is truncated")
        blobs.append((e, data[off:off + size]))
        off += size
    if off != len(data):
        raise ValueError("the slot file has bytes after its last blob")
    return header, blobs, len(data)


def _array(entry: dict, raw: bytes, dtype, shape: Optional[tuple] = None) -> np.ndarray:
    a = np.frombuffer(raw, dtype=dtype)
    if str(a.dtype) != entry.get("dtype") or (shape is not None and tuple(entry.get("shape", ())) != shape):
        raise ValueError(f"the slot file's {entry.get('name')} has the wrong type or shape")
    return a.copy()


def restore(engine, slot, path: str) -> Tuple[int, int]:
    """Put the slot saved in ``path`` into ``slot`` (idle): (tokens restored, bytes read).
    Whatever the slot held is gone; on any failure (as llama-server clears it) it holds nothing."""
    try:
        return _restore(engine, slot, path)
    except BaseException:
        engine.clear_sequence(slot)
        raise


def _restore(engine, slot, path: str) -> Tuple[int, int]:
    header, blobs, size = _read(path)
    mine = _identity(engine)
    theirs = header.get("model") or {}
    if theirs.get("drafting") != mine["drafting"]:
        raise ValueError("the slot was saved " + ("with" if theirs.get("drafting") else "without") +
                         " MTP drafting; this server runs " + ("with" if mine["drafting"] else "without") + " it")
    diff = [k for k in ("desc", "n_vocab", "n_embd", "n_params", "vocab_sha256") if theirs.get(k) != mine[k]]
    if diff:
        raise ValueError(f"the slot was saved from another model ({', '.join(diff)} differ)")
    n = header.get("n_tokens")
    if not isinstance(n, int) or n < 0:
        raise ValueError("the slot file's header is damaged")
    if n > slot.n_ctx:
        raise ValueError(f"the restored prompt ({n} tokens) does not fit in the slot's context ({slot.n_ctx})")
    by_name: Dict[str, List[Tuple[dict, bytes]]] = {}
    for e, raw in blobs:
        by_name.setdefault(e.get("name"), []).append((e, raw))
    found = by_name.get("tokens") or []
    tokens = _array(found[0][0], found[0][1], np.intc, (n,)) if len(found) == 1 else None
    if tokens is None or (n and (tokens.min() < 0 or tokens.max() >= engine.n_vocab)):
        raise ValueError("invalid tokens in the slot file")
    embd = (engine.n_embd,)
    pending = [_array(e, raw, np.float32, embd) for e, raw in by_name.get("pending", [])]
    rows = {int(e.get("pos", -1)): _array(e, raw, np.float32, embd) for e, raw in by_name.get("row", [])}
    if any(not 0 <= p < n for p in rows):
        raise ValueError("the slot file's rows lie outside its tokens")
    checkpoints = _checkpoints(blobs, tokens, embd)

    engine.clear_sequence(slot)
    ok = _set_seq_state(engine.target.ctx, by_name["target"][0][1], slot.seq_id) if "target" in by_name else False
    if ok and engine.draft is not None:
        ok = "draft" in by_name and _set_seq_state(engine.draft.ctx, by_name["draft"][0][1], slot.seq_id)
    if ok and n:
        ok = engine.seq_pos_max(slot.seq_id) == n - 1
    if not ok:
        raise ValueError("No available space in KV cache or invalid slot save file")
    slot.tokens[:n] = tokens
    slot.keep(n, pending[0] if pending else None)
    slot.rows = rows
    slot.checkpoints.items = checkpoints
    return n, size


def _checkpoints(blobs, tokens: np.ndarray, embd: tuple) -> List[Checkpoint]:
    out: List[Checkpoint] = []
    for e, raw in blobs:
        name = e.get("name")
        if name == "cp_tokens":
            k = e.get("n_tokens")
            cp_tokens = _array(e, raw, np.intc, (k,) if isinstance(k, int) else None)
            if not isinstance(k, int) or not 0 < k <= len(tokens) or not np.array_equal(cp_tokens, tokens[:k]):
                raise ValueError("the slot file's checkpoints do not match its tokens")
            out.append(Checkpoint(k, cp_tokens, b"", None))
        elif name == "cp_state" and out and not out[-1].state:
            out[-1].state = raw
        elif name == "cp_row" and out and out[-1].row is None:
            out[-1].row = _array(e, raw, np.float32, embd)
        elif name in ("cp_state", "cp_row"):
            raise ValueError("the slot file's checkpoints are damaged")
    if any(not cp.state for cp in out):
        raise ValueError("the slot file's checkpoints are damaged")
    return out


def erase(engine, slot) -> int:
    """Empty ``slot`` (idle): the tokens it held."""
    n = slot.n
    engine.clear_sequence(slot)
    return n
