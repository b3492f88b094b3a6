"""The real-shape model of the side-by-side step: its shape, how many layers fit, where it is kept.

The model is :func:`llama_metaws.demo.realshape.make_mtp_model`'s qwen35 with one NextN block, written
on the machine that runs the step (no download) into the kit's work folder, and found there
again by its arguments on a second run.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Dict, Optional, Sequence

#: The layer counts :func:`choose_layers` picks from (multiples of 4: make_mtp_model's
#: three gated-delta-net layers, then a full-attention one).
LADDER = (64, 48, 32, 24, 16, 12, 8, 4)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's width, FFN, vocabulary and most layers (the real model's count)."""

    name: str
    n_vocab: int
    n_embd: int
    n_ff: int
    max_layers: int


#: Qwen3.5/3.6-27B's width, FFN and vocabulary (bench/qwen3.6-27b-config.json: hidden 5120,
#: intermediate 17408, vocab 248320, 64 layers); the seed's Qwen3.8-27B has the same shape.
#: make_mtp_model's heads are 128 wide (40 query and 10 KV heads; Qwen's: 24 and 4 of 256).
REAL = Shape("qwen3.6-27b", n_vocab=248320, n_embd=5120, n_ff=17408, max_layers=64)
#: The CPU dry run's: the same step in seconds on 2 cores. Width 1024 is the least with two
#: KV heads (make_mtp_model gives a quarter of the query heads, at least one): with one, a split
#: over two devices aborts in ggml-backend-meta.cpp (``GGML_ASSERT(src_ss[0].axis !=
#: GGML_BACKEND_SPLIT_AXIS_0)``).
SMALL = Shape("small", n_vocab=4096, n_embd=1024, n_ff=1024, max_layers=4)
SHAPES: Dict[str, Shape] = {s.name: s for s in (REAL, SMALL)}

_HD = 128  # make_mtp_model's head and state size
_INTERVAL = 4  # its full-attention interval


def _row(n_in: int, dtype: str) -> int:
    return n_in // 32 * 34 if dtype == "q8_0" else 2 * n_in


def estimated_bytes(shape: Shape, n_layer: int, dtype: str = "q8_0") -> int:
    """The file make_mtp_model writes for this shape, to within the small f32 tensors' share:
    the matrices at ``dtype``, the norms and recurrent vectors at f32."""
    E, F, V = shape.n_embd, shape.n_ff, shape.n_vocab
    n_head, n_kv = E // _HD, max(1, E // _HD // 4)
    n_k, n_v = E // (2 * _HD), E // _HD
    inner = _HD * n_v
    conv = 2 * _HD * n_k + inner
    ffn = 2 * F * _row(E, dtype) + E * _row(F, dtype)
    gdn = (conv + inner) * _row(E, dtype) + E * _row(inner, dtype) + ffn
    gdn += 4 * (conv * 4 + 2 * n_v * E + 2 * n_v + _HD + 2 * E)
    attn = (2 * n_head * _HD + 2 * n_kv * _HD) * _row(E, dtype) + E * _row(n_head * _HD, dtype) + ffn
    attn += 4 * (2 * _HD + 2 * E)
    n_attn = n_layer // _INTERVAL
    nextn = attn + E * _row(2 * E, dtype) + 4 * 2 * E
    return 2 * V * _row(E, dtype) + 4 * E + (n_layer - n_attn) * gdn + n_attn * attn + nextn


@dataclasses.dataclass(frozen=True)
class Costs:
    """What the step's time is made of, per byte of model and per configuration.

    First guesses for one H200 machine, no GPU run has measured them yet (the step's JSON
    records what the write and each row took, to set them from): ``write_s`` and ``write_bps``
    make_mtp_model writing (a fixed part for the vocabulary's designed matrices and metadata,
    then the file: 4.4 GiB at the real shape and 4 layers took 33 s on the 2-core CPU machine,
    its disk at 340 MB/s), ``load_bps`` a process loading the file onto the devices,
    ``start_s`` a process starting (Python, CUDA), ``step_bps`` the weight bytes one decode step
    reads per second, ``step_s`` a step's fixed cost."""

    write_s: float = 20.0
    write_bps: float = 0.5e9
    load_bps: float = 1.5e9
    start_s: float = 6.0
    step_bps: float = 1.5e12
    step_s: float = 0.004

    def estimate(self, n_bytes: int, n_configs: int, tokens: int) -> float:
        """Seconds to write the model, then run ``n_configs`` configurations of ``tokens``
        generated tokens each (no drafting's rate: the slowest)."""
        per_config = self.start_s + n_bytes / self.load_bps + tokens * (n_bytes / self.step_bps + self.step_s)
        return self.write_s + n_bytes / self.write_bps + n_configs * per_config


def choose_layers(shape: Shape, budget_s: float, *, n_configs: int, tokens: int, dtype: str = "q8_0",
                  free_bytes: Optional[int] = None, free_disk: Optional[int] = None, costs: Costs = Costs(),
                  share: float = 0.6, ladder: Sequence[int] = LADDER) -> dict:
    """The most layers (from ``ladder``, at most ``shape.max_layers``) whose estimated time fits
    ``share`` of ``budget_s``, whose weights fit ``free_bytes`` (the device memory free, when
    known) with 25% and 4 GiB to spare, and whose file fits ``free_disk`` with 10% to spare.
    Returns ``{"n_layer", "bytes", "estimate_s", "why"}`` (``why``: the counts passed over and
    why); when not even the smallest fits the time, the smallest that fits the memory, with
    ``over_budget`` set (the step then cuts what runs past its deadline); ``n_layer`` 0 when
    none fits the memory."""
    tried, smallest = [], None
    for n in sorted((n for n in ladder if n <= shape.max_layers), reverse=True):
        b = estimated_bytes(shape, n, dtype)
        est = costs.estimate(b, n_configs, tokens)
        if free_bytes is not None and b * 1.25 + 4 * 2**30 > free_bytes:
            tried.append(f"{n} layers: {b / 2**30:.1f} GiB of weights, {free_bytes / 2**30:.1f} GiB free")
            continue
        if free_disk is not None and b * 1.1 > free_disk:
            tried.append(f"{n} layers: a {b / 2**30:.1f} GiB file, {free_disk / 2**30:.1f} GiB free on disk")
            continue
        fits = {"n_layer": n, "bytes": b, "estimate_s": round(est, 1), "why": list(tried)}
        if est > share * budget_s:
            tried.append(f"{n} layers: ~{est:.0f} s, over {share:.0%} of {budget_s:.0f} s")
            smallest = fits
            continue
        return fits
    if smallest is not None:
        return dict(smallest, over_budget=True)
    return {"n_layer": 0, "bytes": 0, "estimate_s": None, "why": tried}


def model_path(work: os.PathLike, shape: Shape, n_layer: int, dtype: str, agreement: float) -> Path:
    """Where the step keeps this model in the kit's work folder."""
    return Path(work) / "models" / (f"qwen35-mtp-{shape.name}-v{shape.n_vocab}-e{shape.n_embd}-l{n_layer}"
                                    f"-f{shape.n_ff}-{dtype}-a{agreement:g}.gguf")


def write_model(work: os.PathLike, shape: Shape, n_layer: int, dtype: str = "q8_0",
                agreement: float = 0.75) -> Path:
    """make_mtp_model into the work folder; a model already there with the same arguments is
    returned at once (make_mtp_model's own stamp)."""
    from llama_metaws.demo.realshape import make_mtp_model

    return make_mtp_model(model_path(work, shape, n_layer, dtype, agreement), n_vocab=shape.n_vocab,
                          n_embd=shape.n_embd, n_layer=n_layer, n_ff=shape.n_ff, agreement=agreement,
                          dtype=dtype)
