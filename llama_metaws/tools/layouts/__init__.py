"""Each architecture's model as its llama.cpp loader reads it: metadata and tensors at given sizes.

One module per kind of block (``src/models/<arch>.cpp``'s ``load_arch_hparams`` and
``load_arch_tensors``; names from ``src/llama-arch.cpp``): :mod:`.qwen` (the delta-net hybrids),
:mod:`.gqa_moe`, :mod:`.mla`, :mod:`.hybrid` (Mamba-2 hybrids), :mod:`.deepseek4`, built from
:mod:`.blocks` on :mod:`.layout`'s :class:`~.layout.Layout`. The planner writes the header of a
Hugging Face config's model from them (:mod:`llama_metaws.tools.hf_config`); the developer
package writes every MTP family's tiny test model on the same layouts.
"""

from __future__ import annotations

from typing import Callable, Dict

from . import deepseek4 as _deepseek4, gqa_moe as _gqa, hybrid as _hybrid, mla as _mla, qwen as _qwen
from .layout import Dims, Layout

__all__ = ["LAYOUTS", "Dims", "Layout", "family_layout"]

#: architecture -> its layout at given sizes
LAYOUTS: Dict[str, Callable[[Dims], Layout]] = {
    "qwen35": _qwen.qwen35, "qwen35moe": _qwen.qwen35moe, "qwen3next": _qwen.qwen3next,
    "glm4moe": _gqa.glm4moe, "glm-dsa": _mla.glm_dsa, "deepseek2": _mla.deepseek2, "deepseek32": _mla.deepseek32,
    "deepseek4": _deepseek4.deepseek4, "mimo2": _gqa.mimo2, "step35": _gqa.step35,
    "nemotron_h_moe": _hybrid.nemotron_h_moe, "nemotron_h": _hybrid.nemotron_h, "bailingmoe3": _hybrid.bailingmoe3,
    "hy_v3": _gqa.hy_v3, "cohere2moe": _gqa.cohere2moe,
}


def family_layout(arch: str, dims: Dims) -> Layout:
    """The metadata and tensor list of ``arch``'s model at ``dims``."""
    try:
        build = LAYOUTS[arch]
    except KeyError:
        raise ValueError(f"no layout for architecture {arch!r}; layouts: {', '.join(LAYOUTS)}") from None
    return build(dims)
