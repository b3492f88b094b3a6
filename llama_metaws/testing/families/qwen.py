"""Qwen's hybrid MoE families: ``qwen35moe`` (Qwen3.6-35B-A3B) and ``qwen3next`` (Qwen3-Next).

Block 0 is a gated delta net (recurrent), block 1 full attention with a Q gate
(``full_attention_interval`` 2), both with routed and gated shared experts; the NextN block is a
full-attention block with the same MoE (``src/models/qwen35moe.cpp``, ``qwen3next.cpp``).
"""

from __future__ import annotations

from .blocks import attention, blk, delta_net_kv, embeddings, gated_delta_net, moe_ffn, moe_kv, nextn
from .layout import Dims, Layout


def _hybrid_moe(arch: str, dims: Dims, *, fused_ba: bool, mrope: bool) -> Layout:
    L = Layout(arch, dims, n_layer=2, n_nextn=1)
    d = dims
    L.set(feed_forward_length=d.n_ff, expert_shared_feed_forward_length=d.n_ff_shexp,
          attention__head_count=d.n_head, attention__head_count_kv=d.n_head_kv,
          attention__key_length=d.head_dim, attention__value_length=d.head_dim,
          attention__layer_norm_rms_epsilon=d.rms_eps, full_attention_interval=2)
    if mrope:  # qwen3.5 reads exactly four sections
        L.set(rope__dimension_sections=[d.head_dim // 4] * 4)
    moe_kv(L)
    delta_net_kv(L)
    embeddings(L)
    for il in L.layers:
        p = blk(il)
        L.norm(p + "attn_norm.weight", d.n_embd)
        L.norm(p + "post_attention_norm.weight", d.n_embd)
        if il in L.trunk and (il + 1) % 2:
            gated_delta_net(L, il, fused_ba=fused_ba)
        else:
            attention(L, il, q_gate=True, qk_norm=True)
        moe_ffn(L, il, probs_bias=None, shared_gate_inp=True)
        if il in L.nextn:
            nextn(L, il)
    return L


def qwen35moe(dims: Dims) -> Layout:
    return _hybrid_moe("qwen35moe", dims, fused_ba=False, mrope=True)


def qwen3next(dims: Dims) -> Layout:
    return _hybrid_moe("qwen3next", dims, fused_ba=True, mrope=False)
