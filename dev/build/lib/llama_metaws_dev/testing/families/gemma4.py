"""Gemma 4 and its assistant: a target and the draft model llama.cpp drafts for it with.

Gemma 4 has no NextN blocks: it drafts through a separate assistant model (``gemma4-assistant``,
``src/models/gemma4-assistant.cpp``), loaded with ``-md`` as an MTP context whose memory is the
target's (``ctx_other``): the assistant has no K/V projections, its sliding-window blocks attend
over the target's last sliding-window layer and its full-attention blocks over the target's last
full-attention layer, and it embeds each token with the target's ``token_embd`` (scaled by the
square root of the target's width) before ``nextn.pre_projection`` maps ``[embedding; hidden]``
to its own width. Its logits come from its own ``token_embd`` (tied), and
``nextn.post_projection`` gives the hidden row its next step takes.

:func:`gemma4` and :func:`gemma4_assistant` are the two layouts as the loaders read them
(``src/models/gemma4.cpp``, ``gemma4-assistant.cpp``; keys as ``convert_hf_to_gguf.py`` writes
them): the target's blocks alternate sliding-window and full attention ending ``[swa, full]``,
the assistant's blocks are one of each. :func:`make_gemma4_pair` writes both, with random weights
or with the agreement design:

* the target is :mod:`.agreement`'s: orthonormal ``token_embd``, ``output`` mapping the current
  token to its successor; a Gemma block re-normalizes each branch before adding it
  (``post_attention_norm``, ``post_ffw_norm``), so those norms are tiny here (every other norm 1),
  and the residual stream stays the scaled embedding;
* the assistant's ``token_embd`` rows ``u_t`` are orthonormal in its own width (wider than the
  vocabulary), and ``nextn.pre_projection = [A | 0]`` with ``A e_t = u_draft(t)`` reads the token
  half only: after token ``x`` it drafts ``draft(x) = succ(pi(x))``, the target's next token on
  the agreeing tokens (``pi(x) = x``) and two ahead elsewhere, at the chosen rate along the cycle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np

from llama_metaws.demo.agreement import agreement_plan, check_agreement, design_tensors
from .check import check_draft_model, check_model
from llama_metaws.tools.layouts.layout import EMBD, FIXED, HEAD, Dims, Layout, constant, materialize, write

__all__ = ["gemma4", "gemma4_assistant", "make_gemma4_pair", "gemma4_plan", "TARGET_DIMS", "ASSISTANT_DIMS"]

#: the target: two blocks, sliding-window then full attention (the assistant shares the last of each)
TARGET_DIMS = Dims(n_vocab=128, n_embd=128, n_layer=2, n_nextn=0, swa=(1, 0), n_head=2, n_head_kv=1,
                   head_dim=64, n_ff=192, n_swa=64)
#: the assistant: its own width (the loader refuses the target's), one block of each kind
ASSISTANT_DIMS = Dims(n_vocab=128, n_embd=256, n_layer=0, n_nextn=2, swa=(1, 0), n_head=2, n_head_kv=1,
                      head_dim=64, n_ff=192, n_swa=64)
#: a Gemma post-norm weight in the agreement design: the branch it scales adds next to nothing
TINY_POST_NORM = 1e-3
ROPE_BASE, ROPE_BASE_SWA = 1.0e6, 1.0e4


def _kv(L: Layout) -> None:
    d = L.dims
    L.set(feed_forward_length=d.n_ff, attention__head_count=d.n_head, attention__head_count_kv=d.n_head_kv,
          attention__key_length=d.head_dim, attention__value_length=d.head_dim,
          attention__key_length_swa=d.head_dim, attention__value_length_swa=d.head_dim,
          attention__layer_norm_rms_epsilon=d.rms_eps, attention__sliding_window=d.n_swa,
          attention__sliding_window_pattern=[bool(s) for s in d.swa], attention__shared_kv_layers=0,
          rope__freq_base=ROPE_BASE, rope__freq_base_swa=ROPE_BASE_SWA, rope__dimension_count=d.head_dim,
          rope__dimension_count_swa=d.head_dim)


def _block(L: Layout, il: int, *, kv: bool, rope_freqs: bool) -> None:
    """A Gemma 4 block: attention with Q/K norms (K, V where ``kv``), each branch re-normalized
    before it is added, and the block's output scale."""
    d, p = L.dims, f"blk.{il}."
    q = d.head_dim * d.n_head
    L.norm(p + "attn_norm.weight", d.n_embd)
    L.add(p + "attn_q.weight", d.n_embd, q)
    if kv:
        L.add(p + "attn_k.weight", d.n_embd, d.head_dim * d.n_head_kv)
        L.add(p + "attn_v.weight", d.n_embd, d.head_dim * d.n_head_kv)
        L.norm(p + "attn_k_norm.weight", d.head_dim)
    L.out(p + "attn_output.weight", q, d.n_embd)
    L.norm(p + "attn_q_norm.weight", d.head_dim)
    L.norm(p + "post_attention_norm.weight", d.n_embd)
    L.add(p + "layer_output_scale.weight", 1, role=FIXED, init=constant(1.0))
    if rope_freqs:  # the first full-attention block's (the others use it too)
        L.add("rope_freqs.weight", d.head_dim // 2, role=FIXED, init=constant(1.0))
    L.norm(p + "ffn_norm.weight", d.n_embd)
    L.add(p + "ffn_gate.weight", d.n_embd, d.n_ff)
    L.add(p + "ffn_up.weight", d.n_embd, d.n_ff)
    L.out(p + "ffn_down.weight", d.n_ff, d.n_embd)
    L.norm(p + "post_ffw_norm.weight", d.n_embd)


def _blocks(L: Layout, *, kv: bool) -> None:
    first_full = next(i for i, s in enumerate(L.dims.swa) if not s)
    for il in L.layers:
        _block(L, il, kv=kv, rope_freqs=il == first_full)


def gemma4(dims: Dims = TARGET_DIMS) -> Layout:
    """The target (``gemma4``): no per-layer embeddings, no MoE, no KV-sharing layers."""
    L = Layout("gemma4", dims)
    _kv(L)
    L.set(embedding_length_per_layer_input=0)
    L.add("token_embd.weight", dims.n_embd, dims.n_vocab, role=EMBD)
    L.norm("output_norm.weight", dims.n_embd)
    L.add("output.weight", dims.n_embd, dims.n_vocab, role=HEAD)
    _blocks(L, kv=True)
    return L


def gemma4_assistant(dims: Dims = ASSISTANT_DIMS, target: Dims = TARGET_DIMS) -> Layout:
    """The assistant (``gemma4-assistant``): ``block_count`` NextN blocks and no trunk, its width
    ``embedding_length``, the target's ``embedding_length_out``."""
    if dims.n_embd == target.n_embd:
        raise ValueError("the assistant's width must differ from the target's (llama.cpp reads the target's "
                         "from embedding_length_out)")
    L = Layout("gemma4-assistant", dims)
    _kv(L)
    L.set(embedding_length_out=target.n_embd)
    L.add("token_embd.weight", dims.n_embd, dims.n_vocab, role="assistant_embd")
    L.norm("output_norm.weight", dims.n_embd)
    L.add("nextn.pre_projection.weight", 2 * target.n_embd, dims.n_embd, role="pre_projection")
    L.add("nextn.post_projection.weight", dims.n_embd, target.n_embd)
    _blocks(L, kv=False)
    return L


def gemma4_plan(agreement: float, seed: int = 0) -> Dict[str, np.ndarray]:
    """The token plan of :func:`make_gemma4_pair` with ``agreement`` (``succ``, ``draft``, ...)."""
    d = TARGET_DIMS
    return agreement_plan(np.random.default_rng(seed), d.n_vocab, d.n_embd, check_agreement(agreement, 1))[0]


def _design(tensors, values: Dict[str, np.ndarray]):
    """The layout's tensors with the design's own values and its Gemma post-norms tiny."""
    out = []
    for name, value in tensors:
        if name in values:
            value = values[name]
        elif name.endswith(("post_attention_norm.weight", "post_ffw_norm.weight")):
            value = np.full_like(value, TINY_POST_NORM)
        out.append((name, value))
    return out


def make_gemma4_pair(target_path, assistant_path, *, seed: int = 0, agreement: Optional[float] = None,
                     check: bool = True) -> Tuple[Path, Path]:
    """Write the target and its assistant (the module docstring); ``check``: load them through
    llama.cpp in a child process, the target alone, then the assistant as its draft, and raise
    :class:`.FamilyModelError` with llama.cpp's words if it refuses either."""
    rng = np.random.default_rng(seed)
    T, A = gemma4(), gemma4_assistant()
    if agreement is None:  # (the assistant's own roles draw as projections do)
        target, assistant = materialize(T, rng, None), materialize(A, rng, None)
    else:
        plan, emb = agreement_plan(rng, TARGET_DIMS.n_vocab, TARGET_DIMS.n_embd, check_agreement(agreement, 1))
        target = _design(materialize(T, rng, design_tensors(plan, emb)), {})
        assistant = _design(materialize(A, rng, {"eh_proj": []}), _assistant_design(plan, emb, rng))
    write(T, Path(target_path), target)
    write(A, Path(assistant_path), assistant)
    if check:
        check_model(target_path, draft=False)
        check_draft_model(target_path, assistant_path)
    return Path(target_path), Path(assistant_path)


def _assistant_design(plan, emb: np.ndarray, rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """The assistant's own embeddings and its pre-projection (numpy shapes)."""
    V, Eb = emb.shape
    Ea = ASSISTANT_DIMS.n_embd
    q, _ = np.linalg.qr(rng.standard_normal((Ea, V)))
    u = np.ascontiguousarray(q.T)  # V x Ea, orthonormal rows
    pre = np.zeros((Ea, 2 * Eb))
    pre[:, :Eb] = u[plan["draft"]].T @ emb  # e_t -> u_draft(t): the token half; the hidden half is 0
    return {"token_embd.weight": u, "nextn.pre_projection.weight": pre}
