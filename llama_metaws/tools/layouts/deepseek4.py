"""``deepseek4`` (DeepSeek-V4): hyper-connections over four residual streams, an attention with
one shared K/V head, a low-rank grouped output and per-head sinks, and sqrt-softplus routing.

Block 0 compresses its KV 4:1 with a lightning indexer (CSA), block 1 128:1 (HCA), as
DeepSeek-V4's trunk alternates them; the NextN block attends over a sliding window only
(ratio 0, which its graph requires) and carries all four streams in its hidden state
(``n_embd_out = 4 * n_embd``) (``src/models/deepseek4.cpp``). Without a 4:1 block llama.cpp's
lightning-indexer cache has no layers and sizing its rotation divides by zero.
"""

from __future__ import annotations

from .blocks import GATING_SQRT_SOFTPLUS, blk, embeddings, moe_ffn, moe_kv, nextn
from .layout import BIAS, NORM, OUT, Dims, Layout, per_layer

HC = 4          # residual streams (the graph asserts 4)
O_GROUPS = 2    # output projection groups
O_LORA = 16     # output low-rank size per group
RATIOS = (4, 128, 0)  # KV compression per block: CSA, HCA, the NextN block's none


def _hyper_connection(L: Layout, prefix: str, n_mix: int, n_scale: int) -> None:
    """A stream mixer: its projection (tiny in the agreement design: even mixing), its base
    and its scales."""
    L.add(prefix + "_fn.weight", HC * L.dims.n_embd, n_mix, role=OUT)
    L.add(prefix + "_base.weight", n_mix, role=BIAS)
    L.add(prefix + "_scale.weight", n_scale, role=NORM)


def _compressor(L: Layout, prefix: str, head_dim: int, ratio: int) -> None:
    """A KV compressor: its KV and gate projections (two overlapping windows at 4:1), its
    positional bias over the window, its norm."""
    width = (2 if ratio == 4 else 1) * head_dim
    L.add(prefix + "_kv.weight", L.dims.n_embd, width)
    L.add(prefix + "_gate.weight", L.dims.n_embd, width)
    L.add(prefix + "_ape.weight", width, ratio, role=BIAS)
    L.norm(prefix + "_norm.weight", head_dim)


def deepseek4(dims: Dims) -> Layout:
    L = Layout("deepseek4", dims)
    d = dims
    E, H, hd = d.n_embd, d.n_head, d.head_dim
    n_mix = (2 + HC) * HC
    L.set(attention__head_count=H, attention__head_count_kv=1, attention__key_length=hd,
          attention__value_length=hd, rope__dimension_count=hd // 2,
          attention__layer_norm_rms_epsilon=d.rms_eps, attention__q_lora_rank=d.q_lora,
          attention__sliding_window=d.n_swa, attention__output_group_count=O_GROUPS,
          attention__output_lora_rank=O_LORA, attention__compress_ratios=per_layer(L, RATIOS),
          attention__compress_rope_freq_base=160000.0, attention__indexer__head_count=d.indexer_heads,
          attention__indexer__key_length=d.indexer_dim, attention__indexer__top_k=4 * d.n_ctx,
          hyper_connection__count=HC, hyper_connection__sinkhorn_iterations=2,
          hyper_connection__epsilon=1e-6, hash_layer_count=0, swiglu_clamp_exp=10.0,
          expert_shared_count=1, expert_weights_scale=1.0, expert_weights_norm=True,
          expert_gating_func=GATING_SQRT_SOFTPLUS)
    moe_kv(L)
    embeddings(L)
    _hyper_connection(L, "output_hc", HC, 1)
    for il in L.layers:
        p = blk(il)
        L.norm(p + "attn_norm.weight", E)
        L.add(p + "attn_sinks.weight", H, role=BIAS)
        L.add(p + "attn_q_a.weight", E, d.q_lora)
        L.norm(p + "attn_q_a_norm.weight", d.q_lora)
        L.add(p + "attn_q_b.weight", d.q_lora, H * hd)
        L.add(p + "attn_kv.weight", E, hd)
        L.norm(p + "attn_kv_a_norm.weight", hd)
        L.add(p + "attn_output_a.weight", H * hd // O_GROUPS, O_LORA, O_GROUPS)
        L.out(p + "attn_output_b.weight", O_GROUPS * O_LORA, E)
        for mixer in ("hc_attn", "hc_ffn"):
            _hyper_connection(L, p + mixer, n_mix, 3)
        if RATIOS[il]:
            _compressor(L, p + "attn_compressor", hd, RATIOS[il])
        if RATIOS[il] == 4:
            L.add(p + "indexer.proj.weight", E, d.indexer_heads)
            L.add(p + "indexer.attn_q_b.weight", d.q_lora, d.indexer_heads * d.indexer_dim)
            _compressor(L, p + "indexer_compressor", d.indexer_dim, 4)
        L.norm(p + "ffn_norm.weight", E)
        moe_ffn(L, il, n_ff_shexp=d.n_ff_exp)
        if il in L.nextn:
            nextn(L, il)
    return L
