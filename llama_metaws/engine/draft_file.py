"""A draft model in a file of its own: llama-server's ``-md FILE --spec-type draft-mtp``.

llama-server loads the ``-md`` file as a second model, with the target's model parameters (its
devices, split mode and tensor split; ``common_base_params_to_speculative``), and creates an MTP
context on it (``common_speculative_init_result``: ``ctx_type`` MTP, ``n_ctx`` the target's,
``ctx_other`` the target's context). Its draft-mtp driver (``common/speculative.cpp``) then runs
that context as it runs a model's own head. Two kinds of file draft that way:

* **an MTP head split from its model** (``convert_hf_to_gguf.py --mtp``, published as
  ``mtp-<name>.gguf`` beside a target converted with ``--no-mtp``): the target's architecture and
  metadata, ``block_count`` counting the NextN blocks, the NextN blocks at their own indices,
  ``token_embd`` / ``output_norm`` / ``output``, and no trunk block. Every MTP-capable loader
  takes such a file (``mtp_only``: no ``blk.0.attn_norm.weight``, so the trunk's tensors are
  optional). llama.cpp knows a head by the last block's ``nextn.eh_proj``
  (``common_speculative_types_from_gguf``: with ``-md`` and no ``--spec-type`` it infers
  draft-mtp from that), as :func:`read_draft_file` does; a whole MTP model given as ``-md`` is one
  too (its trunk loads, unused).
* **a Gemma 4 assistant** (``gemma4-assistant``; not under tensor split, :func:`check_pair`): a few blocks of its own width
  (``embedding_length``) over the target's hidden size (``embedding_length_out``), without K/V
  projections: its attention reads the target's KV cache (its memory shares the target's last
  sliding-window and full-attention layers through ``ctx_other``) and it embeds tokens with the
  target's ``token_embd``. llama.cpp's driver runs it with shared memory (``is_mem_shared``):
  no catch-up decodes, its blocks in one graph, every draft token at the draft's first position.
  llama.cpp does not infer draft-mtp for it: ``--spec-type draft-mtp`` names it.

:func:`check_pair` says, before anything loads, whether a draft file goes with a target: what
llama.cpp asserts at run time (the hidden width) and what would make its drafts another model's
tokens (the vocabulary) are a ``ValueError`` here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from ..native.archs import check_mtp_graph, check_tensor_split
from .gguf_meta import read_keys, tensor_shapes

__all__ = ["DraftFile", "read_draft_file", "check_pair", "NEXTN_HEAD", "ASSISTANT", "ASSISTANT_ARCH"]

NEXTN_HEAD = "nextn-head"
ASSISTANT = "assistant"
#: the architecture of Gemma 4's assistant models and the one of the target it drafts for
ASSISTANT_ARCH, ASSISTANT_TARGET_ARCH = "gemma4-assistant", "gemma4"


@dataclasses.dataclass(frozen=True)
class DraftFile:
    """What a draft file is, from its metadata and tensor table."""

    path: str
    arch: str
    kind: str            # NEXTN_HEAD or ASSISTANT
    n_nextn: int         # NextN blocks (an assistant: its blocks, all run in one graph)
    n_embd_in: int       # the hidden rows it takes: the target's width
    n_vocab: int
    has_trunk: bool      # a whole model given as a draft (its trunk loads, unused)

    @property
    def shares_memory(self) -> bool:
        """The draft attends over the target's KV cache (llama.cpp's ``is_mem_shared``)."""
        return self.kind == ASSISTANT

    @property
    def chained_heads(self) -> bool:
        """Draft step k runs NextN head k (llama.cpp's ``chain_heads``)."""
        return self.n_nextn > 1 and not self.shares_memory


def _model_keys(path: str, what: str):
    try:
        arch = read_keys(path, ["general.architecture"]).get("general.architecture")
        if arch is None:
            raise ValueError("it has no general.architecture")
        keys = read_keys(path, [f"{arch}.{k}" for k in ("block_count", "nextn_predict_layers", "embedding_length",
                                                        "embedding_length_out")])
        shapes = tensor_shapes(path)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {path} is not a readable GGUF model: {e}") from None
    return arch, {k.split(".", 1)[1]: int(v) for k, v in keys.items()}, shapes


def _n_vocab(shapes: dict, path: str, what: str) -> int:
    embd = shapes.get("token_embd.weight")
    if embd is None or len(embd) != 2:
        raise ValueError(f"{what} {path} has no token_embd.weight: not a model llama.cpp can draft with")
    return int(embd[1])


def read_draft_file(path: "os.PathLike | str") -> DraftFile:
    """The draft file at ``path``; ValueError when it is no file, not GGUF, or no draft model of a
    kind llama.cpp's draft-mtp runs (an MTP head, a Gemma 4 assistant)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"draft_model: the draft model file {path} does not exist")
    arch, kv, shapes = _model_keys(path, "draft_model:")
    n_vocab = _n_vocab(shapes, path, "draft_model:")
    n_blocks = kv.get("block_count", 0)
    if arch == ASSISTANT_ARCH:
        return DraftFile(path, arch, ASSISTANT, kv.get("nextn_predict_layers", n_blocks),
                         kv.get("embedding_length_out", kv.get("embedding_length", 0)), n_vocab, False)
    if n_blocks < 1 or f"blk.{n_blocks - 1}.nextn.eh_proj.weight" not in shapes:
        raise ValueError(
            f"draft_model: {path} ({arch!r}) is neither an MTP head (its last block has no nextn.eh_proj, as "
            f"llama.cpp recognises one) nor a Gemma 4 assistant: llama-metaws drafts with those alone "
            f"(--spec-type draft-mtp); a separate small model (draft-simple), EAGLE-3 or DFlash drafts are "
            f"not implemented")
    n_nextn = kv.get("nextn_predict_layers", 0)
    if n_nextn < 1:
        raise ValueError(f"draft_model: {path} has NextN tensors but no {arch}.nextn_predict_layers: llama.cpp "
                         f"would load it without its head")
    return DraftFile(path, arch, NEXTN_HEAD, n_nextn, kv.get("embedding_length", 0), n_vocab,
                     "blk.0.attn_norm.weight" in shapes)


def check_pair(target_path: str, draft: DraftFile, *, tensor_split: bool = False) -> Optional[str]:
    """ValueError unless ``draft`` drafts for the model at ``target_path`` (read without loading
    either); returns the target's architecture."""
    arch, kv, shapes = _model_keys(target_path, "the target")
    n_embd, n_vocab = kv.get("embedding_length", 0), _n_vocab(shapes, target_path, "the target")
    if draft.kind == ASSISTANT:
        if arch != ASSISTANT_TARGET_ARCH:
            raise ValueError(f"draft_model: a Gemma 4 assistant drafts for a {ASSISTANT_TARGET_ARCH!r} target (it "
                             f"reads that model's KV cache and token embeddings); this target is {arch!r}")
    else:
        check_mtp_graph(draft.arch)
        if draft.arch != arch:
            raise ValueError(f"draft_model: the MTP head is a {draft.arch!r} model and the target a {arch!r} one: "
                             f"a head drafts from its own model's hidden rows")
    if draft.n_embd_in != n_embd:
        raise ValueError(f"draft_model: the draft takes hidden rows of width {draft.n_embd_in}, the target's are "
                         f"{n_embd} wide (llama.cpp asserts they are equal)")
    if draft.n_vocab != n_vocab:
        raise ValueError(f"draft_model: the draft has {draft.n_vocab} tokens, the target {n_vocab}: its drafts "
                         f"would be another vocabulary's")
    if tensor_split:
        check_tensor_split(draft.arch)
        if draft.shares_memory:
            raise ValueError(
                "draft_model: a Gemma 4 assistant under split_mode='tensor': its context reads the target's KV "
                "cache, and each context's graphs rotate the per-graph tensor maps of that one meta buffer, so "
                "the target's next decode reads tensors the assistant's graph freed and llama.cpp aborts "
                "(GGML_ASSERT in set_rows, whatever the workspace). Use split_mode='layer' (layers over the "
                "devices) or 'none' (one device)")
    return arch
