"""Qwen's hybrid families: ``qwen35`` (Qwen3.5/3.6 dense), ``qwen35moe`` (Qwen3.6-35B-A3B) and
``qwen3next`` (Qwen3-Next).

Every ``full_attention_interval``-th trunk block is full attention with a Q gate, the others
gated delta nets (recurrent); the FFNs are dense (qwen35) or routed experts with a gated shared
expert; the NextN block is a full-attention block with the trunk's FFN (``src/models/qwen35.cpp``,
``qwen35moe.cpp``, ``qwen3next.cpp``). The tiny qwen35 file is
:func:`llama_metaws_dev.testing.make_tiny_mtp_model`'s; this layout is the planner's.
"""

from __future__ import annotations

from .blocks import attention, decoder, delta_net_kv, embeddings, gated_delta_net, moe_kv
from .layout import Dims, Layout


def _hybrid(arch: str, dims: Dims, *, moe: bool, fused_ba: bool, mrope: bool) -> Layout:
    L = Layout(arch, dims)
    d = dims
    L.set(feed_forward_length=d.n_ff, attention__head_count=d.n_head, attention__head_count_kv=d.n_head_kv,
          attention__key_length=d.head_dim, attention__value_length=d.head_dim,
          attention__layer_norm_rms_epsilon=d.rms_eps, full_attention_interval=d.full_attn_interval)
    if d.n_rot:
        L.set(rope__dimension_count=d.n_rot)
    if mrope:  # qwen3.5 reads exactly four sections
        L.set(rope__dimension_sections=list(d.rope_sections) or [d.head_dim // 4] * 4)
    if moe:
        moe_kv(L, expert_shared_feed_forward_length=d.n_ff_shexp)
    delta_net_kv(L)
    embeddings(L)
    def attend(L, il):
        if il in L.trunk and (il + 1) % d.full_attn_interval:
            gated_delta_net(L, il, fused_ba=fused_ba)
        else:
            attention(L, il, q_gate=True, qk_norm=True)

    for il in L.layers:
        decoder(L, il, attend, ffn_norm="post_attention_norm.weight",
                moe=dict(probs_bias=None, shared_gate_inp=True), is_moe=lambda il: moe)
    return L


def qwen35(dims: Dims) -> Layout:
    return _hybrid("qwen35", dims, moe=False, fused_ba=False, mrope=True)


def qwen35moe(dims: Dims) -> Layout:
    return _hybrid("qwen35moe", dims, moe=True, fused_ba=False, mrope=True)


def qwen3next(dims: Dims) -> Layout:
    return _hybrid("qwen3next", dims, moe=True, fused_ba=True, mrope=False)
