"""The MLA families: ``deepseek2`` (as GLM-4.7-Flash uses it), ``deepseek32`` and ``glm-dsa``.

Multi-head latent attention with a low-rank Q in every block; the leading blocks have a dense
FFN (``leading_dense_block_count``, 1 in the tiny models), the others sigmoid-routed experts with a selection bias and
one shared expert; the NextN block is a MoE block (``src/models/deepseek2.cpp``,
``deepseek32.cpp``, ``glm-dsa.cpp``). deepseek32 and glm-dsa add DeepSeek sparse attention's
lightning indexer to every block (glm-dsa before 5.2, a context under 1M: every indexer full).
"""

from __future__ import annotations

from .blocks import GATING_SIGMOID, decoder, dsa_indexer, dsa_kv, embeddings, mla_attention, mla_kv, moe_kv
from .layout import Dims, Layout


def _mla_moe(arch: str, dims: Dims, *, indexer: bool) -> Layout:
    L = Layout(arch, dims)
    d = dims
    mla_kv(L)
    moe_kv(L, feed_forward_length=d.n_ff, leading_dense_block_count=d.dense_lead, expert_shared_count=d.n_expert_shared,
           expert_weights_scale=1.0, expert_weights_norm=True, expert_gating_func=GATING_SIGMOID)
    if indexer:
        dsa_kv(L)
    def attend(L, il):
        mla_attention(L, il)
        if indexer:
            dsa_indexer(L, il)

    embeddings(L)
    for il in L.layers:  # shared experts of the routed size
        decoder(L, il, attend, moe=dict(n_ff_shexp=d.n_ff_exp * d.n_expert_shared))
    return L


def deepseek2(dims: Dims) -> Layout:
    return _mla_moe("deepseek2", dims, indexer=False)


def deepseek32(dims: Dims) -> Layout:
    return _mla_moe("deepseek32", dims, indexer=True)


def glm_dsa(dims: Dims) -> Layout:
    return _mla_moe("glm-dsa", dims, indexer=True)
