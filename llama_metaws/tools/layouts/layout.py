"""A tiny model as llama.cpp's loader sees it: metadata keys and named tensors, each with a role.

A family module describes its model as a :class:`Layout` (the keys its ``load_arch_hparams``
reads, the tensors its ``load_arch_tensors`` creates, in ggml's dimension order); the role of a
tensor says how its values are drawn, so that one function (:func:`materialize`) fills every
family the same way:

* seeded random weights (``agreement=None``): ``1/sqrt(fan_in)`` Gaussians, RMS-norm weights near
  1, the special values a few tensors need (a negative SSM decay, ...);
* the agreement design (``agreement=a``, :mod:`.agreement`): orthonormal token embeddings, an
  output matrix that maps the current token to its successor, every projection that writes into
  the residual stream (role :data:`OUT`) tiny, and each NextN head's ``eh_proj`` passing the
  embedding half through a token permutation, so that head k's greedy draft equals the target's
  next token at rate ``a[k]`` whatever the family's blocks do in between.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

# roles
IN = "in"            # a projection into a branch (attention, FFN, SSM input, router, gate)
OUT = "out"          # a projection whose output is added to the residual stream
NORM = "norm"        # a norm weight (1 in the agreement design)
BIAS = "bias"        # a bias or a routing bias (0 in the agreement design)
EMBD = "embd"        # token_embd
HEAD = "head"        # output (the LM head)
EH_PROJ = "eh_proj"  # a NextN head's [embedding | hidden] projection
FIXED = "fixed"      # drawn by the tensor's own init, in both designs

#: a tensor's own values: (generator, numpy shape) -> array
Init = Callable[[np.random.Generator, Tuple[int, ...]], np.ndarray]

#: std of the OUT projections in the agreement design: the residual stream stays the embedding
SMALL_OUT_STD = 1e-3
#: noise on norm weights with random weights
NORM_JITTER = 0.1


@dataclasses.dataclass(frozen=True)
class Dims:
    """The sizes every family starts from (each family keeps what its loader needs)."""

    n_vocab: int = 128
    n_embd: int = 128
    n_ctx: int = 256
    # the structure (the tiny models: two trunk blocks, one NextN block; the planner: a config's)
    n_layer: int = 2         # trunk blocks
    n_nextn: int = 1         # NextN blocks after them
    dense_lead: int = 1      # leading blocks with a dense FFN (MoE families)
    swa: Tuple[int, ...] = ()  # per block (trunk and NextN): 1 = sliding-window attention
    n_swa: int = 64          # the window
    layer_types: str = ""    # nemotron's trunk: M (Mamba-2), * (attention), E (MoE)
    full_attn_interval: int = 2  # qwen's hybrids: every k-th trunk block is full attention
    tie: bool = False        # no output.weight: the LM head is token_embd
    n_head: int = 2
    n_head_kv: int = 2
    head_dim: int = 64
    head_dim_v: int = 0      # 0: head_dim
    n_head_kv_swa: int = 0   # K/V heads of a sliding-window block (0: n_head_kv)
    n_rot: int = 0           # rotated dimensions (0: the loader's default, the whole head)
    rope_sections: Tuple[int, ...] = ()  # qwen3.5's M-RoPE sections (empty: head_dim / 4 each)
    n_ff: int = 192
    n_head_swa: int = 0      # query heads of a sliding-window block (0: n_head)
    n_expert: int = 4
    n_expert_used: int = 2
    n_expert_shared: int = 1
    n_ff_exp: int = 64
    n_ff_shexp: int = 64
    # MLA (deepseek2 and its kin)
    q_lora: int = 64
    kv_lora: int = 64
    rope_dim: int = 32       # the rotated part of an MLA head
    nope_dim: int = 32       # the rest of an MLA key head
    v_mla: int = 64
    # DSA indexers
    indexer_heads: int = 4
    indexer_dim: int = 64
    # recurrent layers
    ssm_conv: int = 4
    ssm_state: int = 64
    ssm_heads: int = 2
    ssm_head_dim: int = 0    # Mamba-2's head size (0: ssm_state)
    ssm_groups: int = 2
    rms_eps: float = 1e-6


@dataclasses.dataclass
class Tensor:
    name: str
    ne: Tuple[int, ...]  # ggml order: ne[0] is the row length (a projection's fan-in)
    role: str
    init: Optional[Init] = None

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(reversed(self.ne))


class Layout:
    """Metadata and tensors of one model: ``dims.n_layer`` trunk blocks, then ``dims.n_nextn``
    NextN blocks (``block_count = n_layer + n_nextn``, as llama.cpp counts them)."""

    def __init__(self, arch: str, dims: Dims) -> None:
        self.arch, self.dims = arch, dims
        self.n_layer, self.n_nextn = n_layer, n_nextn = dims.n_layer, dims.n_nextn
        self.kv: Dict[str, object] = {
            "context_length": dims.n_ctx,
            "embedding_length": dims.n_embd,
            "block_count": n_layer + n_nextn,
        }
        if n_nextn:
            self.kv["nextn_predict_layers"] = n_nextn
        self.tensors: List[Tensor] = []

    @property
    def trunk(self) -> range:
        return range(self.n_layer)

    @property
    def nextn(self) -> range:
        return range(self.n_layer, self.n_layer + self.n_nextn)

    @property
    def layers(self) -> range:
        return range(self.n_layer + self.n_nextn)

    def set(self, **kv) -> "Layout":
        """Metadata keys without the ``<arch>.`` prefix; ``__`` stands for ``.``
        (``attention__head_count``)."""
        for key, value in kv.items():
            self.kv[key.replace("__", ".")] = value
        return self

    def add(self, name: str, *ne: int, role: str = IN, init: Optional[Init] = None) -> None:
        if any(t.name == name for t in self.tensors):
            raise ValueError(f"{self.arch}: tensor {name} added twice")
        self.tensors.append(Tensor(name, tuple(int(n) for n in ne), role, init))

    def out(self, name: str, *ne: int) -> None:
        self.add(name, *ne, role=OUT)

    def norm(self, name: str, *ne: int) -> None:
        self.add(name, *ne, role=NORM)

    def bias(self, name: str, n: int) -> None:
        self.add(name, n, role=BIAS)


def materialize(layout: Layout, rng: np.random.Generator, design: Optional[dict]) -> List[Tuple[str, np.ndarray]]:
    """Every tensor's values, drawn from ``rng`` in the layout's order. ``design``: None for
    random weights, else :func:`.agreement.design_tensors`'s ``token_embd``/``output``/per-head
    ``eh_proj`` arrays."""
    out = []
    heads = iter(design["eh_proj"]) if design else None
    for t in layout.tensors:
        out.append((t.name, _values(t, rng, design, heads)))
    return out


def _values(t: Tensor, rng: np.random.Generator, design: Optional[dict], heads) -> np.ndarray:
    shape = t.shape
    if t.init is not None:
        return t.init(rng, shape)
    if design is not None:
        if t.role == EMBD:
            return design["token_embd"]
        if t.role == HEAD:
            return design["output"]
        if t.role == EH_PROJ:
            return next(heads)
        if t.role == NORM:
            return np.ones(shape)
        if t.role == BIAS:
            return np.zeros(shape)
        if t.role == OUT:
            return rng.standard_normal(shape) * SMALL_OUT_STD
        return rng.standard_normal(shape) / np.sqrt(shape[-1])
    if t.role == EMBD:
        return rng.standard_normal(shape)
    if t.role == NORM:
        return 1.0 + NORM_JITTER * rng.standard_normal(shape)
    if t.role == BIAS:
        return 0.02 * rng.standard_normal(shape)
    return rng.standard_normal(shape) / np.sqrt(shape[-1])


# ---------------------------------------------------------------------------------------------
# inits of the tensors whose values a graph relies on


def negative(rng: np.random.Generator, shape) -> np.ndarray:
    """An SSM decay (``-exp(A_log)``): always negative."""
    return -np.exp(rng.uniform(-1.0, 1.0, shape))


def uniform(low: float, high: float) -> Init:
    return lambda rng, shape: rng.uniform(low, high, shape)


def normal(std: float) -> Init:
    return lambda rng, shape: rng.standard_normal(shape) * std


def constant(value: float) -> Init:
    return lambda rng, shape: np.full(shape, value)


def per_layer(layout: Layout, values: Sequence[int]) -> List[int]:
    """A per-layer metadata array, checked to cover every block."""
    values = [int(v) for v in values]
    if len(values) != layout.n_layer + layout.n_nextn:
        raise ValueError(f"{layout.arch}: {len(values)} per-layer values for "
                         f"{layout.n_layer + layout.n_nextn} blocks")
    return values


def write(layout: Layout, path: Path, tensors: List[Tuple[str, np.ndarray]]) -> Path:
    """The GGUF file: metadata, the TEST tokenizer (the last token ends generation), the tensors
    in f32."""
    from ...demo.model import _Tensors, _write_gguf  # the writer every tiny model shares

    t = _Tensors(np.random.default_rng(0))
    for name, value in tensors:
        t.add(name, value)
    return _write_gguf(Path(path), layout.arch, layout.kv, t, layout.dims.n_vocab)


def write_header(layout: Layout, path: Path, tensor_type: Callable[[str, Tuple[int, ...]], object]) -> Path:
    """A GGUF file with the layout's metadata, a TEST tokenizer and tensor infos of
    ``tensor_type(name, ne)`` (a ``gguf.GGMLQuantizationType``), whose data is a hole: the
    file is truncated to its full length (sparse on disk), so llama.cpp's bounds checks pass
    and a ``no_alloc`` load reads nothing past the header (the planner's model)."""
    import os

    import gguf

    from ...demo.metadata import add_metadata
    from ...demo.vocab import write_vocab

    w = gguf.GGUFWriter(str(path), layout.arch)
    w.add_name(f"planned-{layout.arch}")
    add_metadata(w, layout.arch, layout.kv)
    write_vocab(w, "test", layout.dims.n_vocab, layout.dims.n_vocab - 1)
    total = 0
    for t in layout.tensors:
        kind = tensor_type(t.name, t.ne)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        nbytes = int(np.prod(t.ne, dtype=np.int64)) // block * size
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), nbytes, raw_dtype=kind)
        total += gguf.GGUFWriter.ggml_pad(nbytes, w.data_alignment)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with open(path, "r+b") as f:  # the data region: a hole, as long as the tensors say
        f.seek(0, os.SEEK_END)
        f.truncate(gguf.GGUFWriter.ggml_pad(f.tell(), w.data_alignment) + total)
    return Path(path)
