"""The MLA families: ``deepseek2`` (as GLM-4.7-Flash uses it), ``deepseek32`` and ``glm-dsa``.

Multi-head latent attention with a low-rank Q in every block; block 0 has a dense FFN
(``leading_dense_block_count`` 1), the others sigmoid-routed experts with a selection bias and
one shared expert; the NextN block is a MoE block (``src/models/deepseek2.cpp``,
``deepseek32.cpp``, ``glm-dsa.cpp``). deepseek32 and glm-dsa add DeepSeek sparse attention's
lightning indexer to every block (glm-dsa before 5.2, a context under 1M: every indexer full).
"""

from __future__ import annotations

from .blocks import GATING_SIGMOID, blk, dense_ffn, dsa_indexer, dsa_kv, embeddings, mla_attention, mla_kv, moe_ffn, moe_kv, nextn
from .layout import Dims, Layout


def _mla_moe(arch: str, dims: Dims, *, indexer: bool) -> Layout:
    L = Layout(arch, dims, n_layer=2, n_nextn=1)
    d = dims
    mla_kv(L)
    moe_kv(L, feed_forward_length=d.n_ff, leading_dense_block_count=1, expert_shared_count=1,
           expert_weights_scale=1.0, expert_weights_norm=True, expert_gating_func=GATING_SIGMOID)
    if indexer:
        dsa_kv(L)
    embeddings(L)
    for il in L.layers:
        p = blk(il)
        L.norm(p + "attn_norm.weight", d.n_embd)
        mla_attention(L, il)
        if indexer:
            dsa_indexer(L, il)
        L.norm(p + "ffn_norm.weight", d.n_embd)
        if il == 0:
            dense_ffn(L, il)
        else:
            moe_ffn(L, il, n_ff_shexp=d.n_ff_exp)  # one shared expert of the routed size
        if il in L.nextn:
            nextn(L, il)
    return L


def deepseek2(dims: Dims) -> Layout:
    return _mla_moe("deepseek2", dims, indexer=False)


def deepseek32(dims: Dims) -> Layout:
    return _mla_moe("deepseek32", dims, indexer=True)


def glm_dsa(dims: Dims) -> Layout:
    return _mla_moe("glm-dsa", dims, indexer=True)
