"""The grouped-query-attention MoE families: ``glm4moe``, ``hy_v3``, ``cohere2moe``, and the
multi-head ones, ``mimo2`` (three NextN blocks, sliding-window attention) and ``step35``
(three chained heads, a per-head attention gate).

Each trunk starts with ``dims.dense_lead`` dense blocks (``leading_dense_block_count`` where the
loader reads it; mimo2, step35 and hy_v3 pick the FFN by which tensors the block has), then MoE
blocks, and each NextN
block is a full block of its family plus ``eh_proj``/``enorm``/``hnorm``
(``src/models/glm4-moe.cpp``, ``hy-v3.cpp``, ``cohere2moe.cpp``, ``mimo2.cpp``, ``step35.cpp``).
"""

from __future__ import annotations

from .blocks import GATING_SIGMOID, attention, decoder, embeddings, heads_per_layer, moe_kv, swa_pattern
from .layout import Dims, Layout


def _gqa_kv(L: Layout, **extra) -> None:
    d = L.dims
    L.set(feed_forward_length=d.n_ff, attention__head_count=d.n_head, attention__head_count_kv=d.n_head_kv,
          attention__key_length=d.head_dim, attention__value_length=d.head_dim,
          attention__layer_norm_rms_epsilon=d.rms_eps, **extra)


def glm4moe(dims: Dims) -> Layout:
    """GLM-4.5(-Air): Q/K/V biases, a post-attention norm before the FFN, sigmoid routing
    with a selection bias and one shared expert."""
    L = Layout("glm4moe", dims)
    d = dims
    _gqa_kv(L, rope__dimension_count=d.n_rot or d.head_dim // 2)  # partial rotary, GLM-4.5's 0.5
    moe_kv(L, leading_dense_block_count=d.dense_lead, expert_shared_count=d.n_expert_shared, expert_weights_scale=1.0,
           expert_weights_norm=True, expert_gating_func=GATING_SIGMOID)
    embeddings(L)
    for il in L.layers:
        decoder(L, il, lambda L, il: attention(L, il, qkv_bias=True), ffn_norm="post_attention_norm.weight",
                moe=dict(n_ff_shexp=d.n_ff_exp * d.n_expert_shared))
    return L


def hy_v3(dims: Dims) -> Layout:
    """Hunyuan V3: Q/K norms, a sigmoid router whose selection bias is ``exp_probs_b`` (no
    suffix), an ungated-router shared expert; the NextN block keeps its final norm in
    ``nextn.shared_head_norm``."""
    L = Layout("hy_v3", dims)
    d = dims
    _gqa_kv(L, expert_shared_feed_forward_length=d.n_ff_shexp, expert_weights_scale=1.0,
            expert_weights_norm=True, expert_gating_func=GATING_SIGMOID)
    moe_kv(L)
    embeddings(L)
    for il in L.layers:
        decoder(L, il, lambda L, il: attention(L, il, qk_norm=True), moe=dict(probs_bias="exp_probs_b"),
                head_norm="nextn.shared_head_norm.weight")
    return L


def cohere2moe(dims: Dims) -> Layout:
    """Cohere's parallel blocks (attention and FFN read the same norm), sliding-window layers,
    a logit scale; RMS norms (an RMS epsilon in the metadata picks them)."""
    L = Layout("cohere2moe", dims)
    d = dims
    _gqa_kv(L, attention__sliding_window=d.n_swa, logit_scale=1.0, leading_dense_block_count=d.dense_lead,
            expert_shared_feed_forward_length=d.n_ff_shexp, expert_shared_count=1,
            expert_weights_norm=True, expert_gating_func=GATING_SIGMOID)
    L.set(attention__sliding_window_pattern=swa_pattern(L, [1, 0, 0]))
    moe_kv(L)
    embeddings(L)
    for il in L.layers:
        decoder(L, il, attention, ffn_norm=None, moe=dict(probs_bias=None))
    return L


def mimo2(dims: Dims) -> Layout:
    """MiMo-V2: fused Q/K/V, sliding-window attention (its own K/V head count) on block 1 and on
    the three NextN blocks, which have dense FFNs; sigmoid-routed experts without shared ones."""
    L = Layout("mimo2", dims)
    d = dims
    swa = swa_pattern(L, [0, 1, 1, 1, 1])
    heads, heads_kv = heads_per_layer(L, swa)
    _gqa_kv(L, attention__sliding_window=d.n_swa)
    L.set(attention__sliding_window_pattern=swa, attention__head_count=heads, attention__head_count_kv=heads_kv)
    if d.head_dim_v:
        L.set(attention__value_length=d.head_dim_v)
    moe_kv(L)
    embeddings(L)
    for il in L.layers:  # dense FFNs in the NextN blocks
        decoder(L, il, lambda L, il: attention(L, il, fused=True, n_head=heads[il], n_head_kv=heads_kv[il]),
                moe=dict(shared=False), is_moe=lambda il: d.dense_lead <= il < d.n_layer)
    return L


def step35(dims: Dims) -> Layout:
    """Step-3.5: Q/K norms, a sigmoid gate per attention head (``attn_gate``), full attention
    rotating half the head, alternating sliding-window blocks; routed experts with a selection
    bias and a shared expert in block 1 and in each of the three chained NextN blocks."""
    L = Layout("step35", dims)
    d = dims
    _gqa_kv(L, attention__sliding_window=d.n_swa, expert_shared_feed_forward_length=d.n_ff_shexp,
            expert_weights_scale=1.0, expert_weights_norm=True, expert_gating_func=GATING_SIGMOID)
    swa = swa_pattern(L, [0, 1, 0, 1, 0])
    heads, heads_kv = heads_per_layer(L, swa)
    L.set(attention__sliding_window_pattern=swa, attention__head_count=heads, attention__head_count_kv=heads_kv)
    moe_kv(L)
    embeddings(L)
    for il in L.layers:
        decoder(L, il, lambda L, il: attention(L, il, qk_norm=True, head_gate=True, n_head=heads[il],
                                               n_head_kv=heads_kv[il]))
    return L
