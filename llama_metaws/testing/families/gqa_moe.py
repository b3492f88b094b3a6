"""The grouped-query-attention MoE families: ``glm4moe``, ``hy_v3``, ``cohere2moe``, and the
multi-head ones, ``mimo2`` (three NextN blocks, sliding-window attention) and ``step35``
(three chained heads, a per-head attention gate).

Each trunk is a dense block then a MoE block (``leading_dense_block_count`` 1 where the loader
reads it; mimo2, step35 and hy_v3 pick the FFN by which tensors the block has), and each NextN
block is a full block of its family plus ``eh_proj``/``enorm``/``hnorm``
(``src/models/glm4-moe.cpp``, ``hy-v3.cpp``, ``cohere2moe.cpp``, ``mimo2.cpp``, ``step35.cpp``).
"""

from __future__ import annotations

from .blocks import GATING_SIGMOID, attention, blk, dense_ffn, embeddings, moe_ffn, moe_kv, nextn
from .layout import Dims, Layout, per_layer


def _gqa_kv(L: Layout, **extra) -> None:
    d = L.dims
    L.set(feed_forward_length=d.n_ff, attention__head_count=d.n_head, attention__head_count_kv=d.n_head_kv,
          attention__key_length=d.head_dim, attention__value_length=d.head_dim,
          attention__layer_norm_rms_epsilon=d.rms_eps, **extra)


def glm4moe(dims: Dims) -> Layout:
    """GLM-4.5(-Air): Q/K/V biases, a post-attention norm before the FFN, sigmoid routing
    with a selection bias and one shared expert."""
    L = Layout("glm4moe", dims, n_layer=2, n_nextn=1)
    d = dims
    _gqa_kv(L, rope__dimension_count=d.head_dim // 2)  # partial rotary, as GLM-4.5's 0.5
    moe_kv(L, leading_dense_block_count=1, expert_shared_count=1, expert_weights_scale=1.0,
           expert_weights_norm=True, expert_gating_func=GATING_SIGMOID)
    embeddings(L)
    for il in L.layers:
        p = blk(il)
        L.norm(p + "attn_norm.weight", d.n_embd)
        attention(L, il, qkv_bias=True)
        L.norm(p + "post_attention_norm.weight", d.n_embd)
        if il == 0:
            dense_ffn(L, il)
        else:
            moe_ffn(L, il, n_ff_shexp=d.n_ff_exp)
        if il in L.nextn:
            nextn(L, il)
    return L


def hy_v3(dims: Dims) -> Layout:
    """Hunyuan V3: Q/K norms, a sigmoid router whose selection bias is ``exp_probs_b`` (no
    suffix), an ungated-router shared expert; the NextN block keeps its final norm in
    ``nextn.shared_head_norm``."""
    L = Layout("hy_v3", dims, n_layer=2, n_nextn=1)
    d = dims
    _gqa_kv(L, expert_shared_feed_forward_length=d.n_ff_shexp, expert_weights_scale=1.0,
            expert_weights_norm=True, expert_gating_func=GATING_SIGMOID)
    moe_kv(L)
    embeddings(L)
    for il in L.layers:
        p = blk(il)
        L.norm(p + "attn_norm.weight", d.n_embd)
        attention(L, il, qk_norm=True)
        L.norm(p + "ffn_norm.weight", d.n_embd)
        if il == 0:
            dense_ffn(L, il)
        else:
            moe_ffn(L, il, probs_bias="exp_probs_b")
        if il in L.nextn:
            nextn(L, il, head_norm="nextn.shared_head_norm.weight")
    return L


def cohere2moe(dims: Dims) -> Layout:
    """Cohere's parallel blocks (attention and FFN read the same norm), sliding-window layers,
    a logit scale; RMS norms (an RMS epsilon in the metadata picks them)."""
    L = Layout("cohere2moe", dims, n_layer=2, n_nextn=1)
    d = dims
    _gqa_kv(L, attention__sliding_window=d.n_ctx // 4, logit_scale=1.0, leading_dense_block_count=1,
            expert_shared_feed_forward_length=d.n_ff_shexp, expert_shared_count=1,
            expert_weights_norm=True, expert_gating_func=GATING_SIGMOID)
    L.set(attention__sliding_window_pattern=per_layer(L, [1, 0, 0]))
    moe_kv(L)
    embeddings(L)
    for il in L.layers:
        L.norm(blk(il) + "attn_norm.weight", d.n_embd)
        attention(L, il)
        if il == 0:
            dense_ffn(L, il)
        else:
            moe_ffn(L, il, probs_bias=None)
        if il in L.nextn:
            nextn(L, il)
    return L


def mimo2(dims: Dims) -> Layout:
    """MiMo-V2: fused Q/K/V, sliding-window attention on block 1 and on the three NextN blocks
    (dense FFNs), sigmoid-routed experts without shared ones in block 1."""
    L = Layout("mimo2", dims, n_layer=2, n_nextn=3)
    d = dims
    _gqa_kv(L, attention__sliding_window=d.n_ctx // 4)
    L.set(attention__sliding_window_pattern=per_layer(L, [0, 1, 1, 1, 1]))
    moe_kv(L)
    embeddings(L)
    for il in L.layers:
        p = blk(il)
        L.norm(p + "attn_norm.weight", d.n_embd)
        attention(L, il, fused=True)
        L.norm(p + "ffn_norm.weight", d.n_embd)
        if il == 1:
            moe_ffn(L, il, shared=False)
        else:
            dense_ffn(L, il)
        if il in L.nextn:
            nextn(L, il)
    return L


def step35(dims: Dims) -> Layout:
    """Step-3.5: Q/K norms, a sigmoid gate per attention head (``attn_gate``), full attention
    rotating half the head, alternating sliding-window blocks; routed experts with a selection
    bias and a shared expert in block 1 and in each of the three chained NextN blocks."""
    L = Layout("step35", dims, n_layer=2, n_nextn=3)
    d = dims
    _gqa_kv(L, attention__sliding_window=d.n_ctx // 4, expert_shared_feed_forward_length=d.n_ff_shexp,
            expert_weights_scale=1.0, expert_weights_norm=True, expert_gating_func=GATING_SIGMOID)
    L.set(attention__sliding_window_pattern=per_layer(L, [0, 1, 0, 1, 0]))
    moe_kv(L)
    embeddings(L)
    for il in L.layers:
        p = blk(il)
        L.norm(p + "attn_norm.weight", d.n_embd)
        attention(L, il, qk_norm=True, head_gate=True)
        L.norm(p + "ffn_norm.weight", d.n_embd)
        if il == 0:
            dense_ffn(L, il)
        else:
            moe_ffn(L, il)
        if il in L.nextn:
            nextn(L, il)
    return L
