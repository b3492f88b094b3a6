"""Draft models in files of their own, for ``Llama(draft_model=PATH)`` and ``serve -md PATH``.

:func:`split_mtp_model` cuts a model with NextN blocks (any builder's: the qwen35 agreement
model, a family's) into the two files ``convert_hf_to_gguf.py`` writes for such a model: the
target (``--no-mtp``: ``block_count`` the trunk's, no ``nextn_predict_layers``, no NextN tensor)
and the MTP head (``--mtp``, published as ``mtp-<name>.gguf``: every metadata key, the
embeddings, the output norm and head, the NextN blocks at their own indices, no trunk block).
The pair drafts exactly as the whole model drafts with its own head, so an agreement model's
designed acceptance holds for it.

Each file is loaded through llama.cpp in a child process before it is returned (``check``):
the target as a model of its own, the head as its draft (:func:`.families.check_draft_model`),
and llama.cpp's refusal is a :class:`~.families.FamilyModelError` in its own words.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Tuple, Union

import numpy as np

from .families.check import check_draft_model, check_model

__all__ = ["split_mtp_model"]

PathLike = Union[str, "os.PathLike[str]"]


def _block(name: str):
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def split_mtp_model(path: PathLike, target_path: PathLike, head_path: PathLike, *,
                    check: bool = True) -> Tuple[Path, Path]:
    """Write ``path``'s trunk to ``target_path`` and its MTP head to ``head_path`` (the module
    docstring); returns both paths. ValueError for a model without NextN blocks."""
    import gguf

    reader = gguf.GGUFReader(os.fspath(path))
    arch = reader.fields["general.architecture"].contents()
    n_blocks = int(reader.fields[f"{arch}.block_count"].contents())
    nextn = reader.fields.get(f"{arch}.nextn_predict_layers")
    n_nextn = int(nextn.contents()) if nextn is not None else 0
    if n_nextn < 1:
        raise ValueError(f"{path}: a {arch!r} model without NextN blocks has no MTP head to split off")
    n_trunk = n_blocks - n_nextn
    _write(reader, arch, Path(target_path), lambda b: b is None or b < n_trunk, n_trunk, n_blocks)
    _write(reader, arch, Path(head_path), lambda b: b is None or b >= n_trunk, None, n_blocks)
    if check:
        check_model(target_path, draft=False)
        check_draft_model(target_path, head_path)
    return Path(target_path), Path(head_path)


def _write(reader, arch: str, path: Path, keep, n_trunk, n_blocks: int) -> None:
    """The reader's keys and the tensors ``keep`` takes (by block, None: not a block's); with
    ``n_trunk`` the trunk's file: its block count, per-block arrays cut to it, no NextN key."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    try:
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue  # the writer's own
            vtype = field.types[0]
            value = field.contents()
            if n_trunk is not None:
                if key == f"{arch}.nextn_predict_layers":
                    continue
                if key == f"{arch}.block_count":
                    value = n_trunk
                elif vtype == gguf.GGUFValueType.ARRAY and key.startswith(arch + ".") and len(value) == n_blocks:
                    value = value[:n_trunk]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, vtype, sub_type=sub)
        for t in reader.tensors:
            if keep(_block(t.name)):
                writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
