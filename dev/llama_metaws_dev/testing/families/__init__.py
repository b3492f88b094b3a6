"""Tiny models of every family the vendored llama.cpp drafts for with MTP, and of nemotron_h.

Each family module writes a model as its llama.cpp loader reads it (``src/models/<arch>.cpp``:
``load_arch_hparams``, ``load_arch_tensors``; names from ``src/llama-arch.cpp``): vocabulary and
width 128, f32 weights, two trunk blocks (three for nemotron) and the family's NextN blocks.
The registry :data:`FAMILIES` maps an architecture to its :class:`Family`;
:func:`make_family_model` writes one, with seeded random weights or with the agreement design
(:mod:`.agreement`: head k's greedy draft equals the target's next token at a chosen rate), and
:func:`check_model` loads it through llama.cpp in a child process, raising
:class:`FamilyModelError` with llama.cpp's own message if it refuses the file.

    >>> from llama_metaws_dev.testing.families import FAMILIES, make_family_model
    >>> path = make_family_model("glm4moe", "/tmp/glm4moe.gguf", seed=1, agreement=0.8)
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable, Dict, Optional, Union

import numpy as np

from llama_metaws.native.archs import MTP_GRAPH_ARCHS, NO_TENSOR_SPLIT_ARCHS
from llama_metaws.tools import layouts
from llama_metaws.tools.layouts import LAYOUTS
from llama_metaws.demo.agreement import Agreement, agreement_plan, check_agreement, design_tensors
from .check import FamilyModelError, check_model, check_models
from llama_metaws.tools.layouts.layout import Dims, Layout, materialize, write

__all__ = ["Family", "FAMILIES", "MTP_FAMILIES", "make_family_model", "family_plan", "family_layout",
           "check_model", "check_models", "FamilyModelError", "Dims"]

PathLike = Union[str, "os.PathLike[str]"]


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture's tiny model and what llama.cpp does with it."""

    arch: str
    #: the model the family stands for (its NextN layout, not its size)
    example: str
    #: the target's memory holds recurrent state (llama.cpp's hybrid or recurrent archs)
    recurrent: bool
    #: Dims -> Layout: the metadata and tensors llama.cpp's loader reads
    build: Callable[[Dims], Layout]
    dims: Dims = Dims()
    #: writes the tiny file instead of the layout (qwen35: make_tiny_mtp_model, bytes kept)
    tiny: Optional[Callable] = None

    @property
    def n_nextn(self) -> int:
        """The NextN (MTP) blocks after the trunk."""
        return self.dims.n_nextn

    @property
    def mtp_graph(self) -> bool:
        """llama.cpp builds an MTP graph for it (``draft="mtp"`` can work)."""
        return self.arch in MTP_GRAPH_ARCHS

    @property
    def tensor_split(self) -> bool:
        """llama.cpp loads it under ``LLAMA_SPLIT_MODE_TENSOR``."""
        return self.arch not in NO_TENSOR_SPLIT_ARCHS

    @property
    def chained_heads(self) -> bool:
        """More than one NextN head: llama.cpp drafts step k with head k."""
        return self.n_nextn > 1


def _qwen35_tiny(path, *, seed, agreement):
    from .. import make_tiny_mtp_model

    return make_tiny_mtp_model(path, seed=seed, agreement=agreement)


def _family(arch, example, recurrent, tiny=None, **dims) -> Family:
    return Family(arch, example, recurrent, LAYOUTS[arch], Dims(**dims), tiny)


FAMILIES: Dict[str, Family] = {f.arch: f for f in (
    _family("qwen35", "Qwen3.5/3.6 dense (the seed's Qwen3.8-27B)", True, _qwen35_tiny),
    _family("qwen35moe", "Qwen3.6-35B-A3B", True),
    _family("qwen3next", "Qwen3-Next-80B-A3B", True),
    _family("glm4moe", "GLM-4.5-Air", False),
    _family("glm-dsa", "GLM-5.2", False),
    _family("deepseek2", "GLM-4.7-Flash (MLA)", False),
    _family("deepseek32", "DeepSeek-V3.2", False),
    # an indexer head as wide as the attention head makes llama.cpp build a Hadamard rotation
    # for the empty full-attention KV cache of the MTP context (every block here is SWA), and
    # sizing it divides by zero (llama_kv_cache::build_input_k_rot): DeepSeek-V4's are 128/512
    _family("deepseek4", "DeepSeek-V4", True, indexer_dim=128),
    _family("mimo2", "MiMo-V2.5 / MiMo-V2-Flash", False, n_nextn=3),
    _family("step35", "Step-3.5-Flash", False, n_nextn=3),
    _family("nemotron_h_moe", "Nemotron-3 (Nemotron-H MoE)", True, n_layer=3),
    _family("nemotron_h", "Nemotron-H (dense arch, NextN layers, no MTP graph)", True,
            n_layer=3),
    _family("bailingmoe3", "Ling/Ring 3.0 (bailingmoe3)", True),
    _family("hy_v3", "Hunyuan V3", False),
    _family("cohere2moe", "Command A MoE (cohere2moe)", False),
)}

#: the families llama.cpp drafts for
MTP_FAMILIES = tuple(a for a, f in FAMILIES.items() if f.mtp_graph)


def family_layout(arch: str, dims: Optional[Dims] = None) -> Layout:
    """The metadata and tensor list of ``arch``'s model: the tiny one, or at ``dims``
    (the planner's, from a config.json)."""
    return layouts.family_layout(arch, dims or _get(arch).dims)


def family_plan(arch: str, agreement: Agreement, seed: int = 0) -> Dict[str, np.ndarray]:
    """The token plan of ``make_family_model(arch, ..., seed=seed, agreement=agreement)``
    (:func:`.agreement.agreement_plan`): ``succ``, and each head's ``draft``."""
    fam = _get(arch)
    if fam.tiny is not None:
        from .. import mtp_agreement_plan
        return mtp_agreement_plan(float(agreement), seed)
    d = fam.dims
    return agreement_plan(np.random.default_rng(seed), d.n_vocab, d.n_embd,
                          check_agreement(agreement, fam.n_nextn))[0]


def make_family_model(arch: str, path: PathLike, *, seed: int = 0, agreement: Optional[Agreement] = None,
                      check: bool = False) -> Path:
    """Write ``arch``'s tiny model to ``path`` and return the path.

    ``agreement=None``: seeded random weights (a draft is accepted ~1/128 of the time);
    ``agreement=a`` (one rate, or one per NextN head): the agreement design. The same arguments
    give the same bytes. ``check``: load it through llama.cpp first (:func:`check_model`, a
    child process, about a second) and raise :class:`FamilyModelError` with llama.cpp's message
    if it refuses the file.
    """
    fam = _get(arch)
    if fam.tiny is not None:
        out = fam.tiny(path, seed=seed, agreement=agreement)
    else:
        layout = fam.build(fam.dims)
        rng = np.random.default_rng(seed)
        design = None
        if agreement is not None:
            plan, emb = agreement_plan(rng, fam.dims.n_vocab, fam.dims.n_embd,
                                       check_agreement(agreement, fam.n_nextn))
            design = design_tensors(plan, emb)
        out = write(layout, Path(path), materialize(layout, rng, design))
    if check:
        check_model(out, draft=fam.mtp_graph)
    return out


def _get(arch: str) -> Family:
    try:
        return FAMILIES[arch]
    except KeyError:
        raise ValueError(f"no tiny model for architecture {arch!r}; families: {', '.join(FAMILIES)}") from None
