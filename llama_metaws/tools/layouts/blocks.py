"""The pieces the families' blocks are made of, as llama.cpp's loaders name and shape them.

Each function adds one piece of block ``il`` to a :class:`~.layout.Layout` (ggml order:
``{fan_in, fan_out[, n_expert]}``), with the role that says how the agreement design fills it:
the projections that write into the residual stream are :data:`~.layout.OUT`. Sizes come from
the layout's :class:`~.layout.Dims` unless given.
"""

from __future__ import annotations

from typing import Optional

from .layout import BIAS, EH_PROJ, EMBD, FIXED, HEAD, Layout, negative, normal, uniform

# llama_expert_gating_func_type
GATING_SIGMOID = 2
GATING_SQRT_SOFTPLUS = 4


def blk(il: int) -> str:
    return f"blk.{il}."


def embeddings(L: Layout) -> None:
    """``token_embd``, ``output_norm`` and (unless ``dims.tie``) ``output``."""
    d = L.dims
    L.add("token_embd.weight", d.n_embd, d.n_vocab, role=EMBD)
    L.norm("output_norm.weight", d.n_embd)
    if not d.tie:
        L.add("output.weight", d.n_embd, d.n_vocab, role=HEAD)


def swa_pattern(L: Layout, default) -> list:
    """Per block, 1 for sliding-window attention: ``dims.swa``, else the family's tiny pattern."""
    from .layout import per_layer

    return per_layer(L, L.dims.swa or default)


def heads_per_layer(L: Layout, swa) -> tuple:
    """(query heads, K/V heads) per block where sliding-window blocks have their own counts."""
    d = L.dims
    return ([d.n_head_swa if s and d.n_head_swa else d.n_head for s in swa],
            [d.n_head_kv_swa if s and d.n_head_kv_swa else d.n_head_kv for s in swa])


def attention(L: Layout, il: int, *, n_head: Optional[int] = None, n_head_kv: Optional[int] = None,
              head_dim: Optional[int] = None, q_gate: bool = False, qk_norm: bool = False,
              fused: bool = False, head_gate: bool = False, qkv_bias: bool = False) -> None:
    """Multi-head attention with grouped K/V heads: ``attn_q/k/v`` (``fused``: one ``attn_qkv``,
    Q then K then V), ``attn_output``; ``q_gate``: Q doubled by a per-element output gate
    (qwen3.5/next); ``qk_norm``: per-head Q/K RMS norms; ``head_gate``: ``attn_gate``, one
    sigmoid gate per head (step35); ``qkv_bias``: Q/K/V biases (GLM)."""
    d, p = L.dims, blk(il)
    n_head = n_head or d.n_head
    n_head_kv = d.n_head_kv if n_head_kv is None else n_head_kv
    hd = head_dim or d.head_dim
    hd_v = d.head_dim_v or hd
    n_q, n_k, n_v = hd * n_head * (2 if q_gate else 1), hd * n_head_kv, hd_v * n_head_kv
    if fused:
        L.add(p + "attn_qkv.weight", d.n_embd, n_q + n_k + n_v)
    else:
        L.add(p + "attn_q.weight", d.n_embd, n_q)
        L.add(p + "attn_k.weight", d.n_embd, n_k)
        L.add(p + "attn_v.weight", d.n_embd, n_v)
        if qkv_bias:
            for name, n in (("attn_q", n_q), ("attn_k", n_k), ("attn_v", n_v)):
                L.bias(p + name + ".bias", n)
    L.out(p + "attn_output.weight", hd_v * n_head, d.n_embd)
    if qk_norm:
        L.norm(p + "attn_q_norm.weight", hd)
        L.norm(p + "attn_k_norm.weight", hd)
    if head_gate:
        L.add(p + "attn_gate.weight", d.n_embd, n_head)


def mla_attention(L: Layout, il: int, *, head_gate: bool = False) -> None:
    """DeepSeek's multi-head latent attention with a low-rank Q, in the split form llama.cpp
    loads (``attn_k_b``/``attn_v_b`` per head)."""
    d, p = L.dims, blk(il)
    L.norm(p + "attn_q_a_norm.weight", d.q_lora)
    L.norm(p + "attn_kv_a_norm.weight", d.kv_lora)
    L.add(p + "attn_q_a.weight", d.n_embd, d.q_lora)
    L.add(p + "attn_q_b.weight", d.q_lora, d.n_head * (d.nope_dim + d.rope_dim))
    L.add(p + "attn_kv_a_mqa.weight", d.n_embd, d.kv_lora + d.rope_dim)
    L.add(p + "attn_k_b.weight", d.nope_dim, d.kv_lora, d.n_head)
    L.add(p + "attn_v_b.weight", d.kv_lora, d.v_mla, d.n_head)
    if head_gate:
        L.add(p + "attn_gate.weight", d.n_embd, d.n_head)
    L.out(p + "attn_output.weight", d.n_head * d.v_mla, d.n_embd)


def mla_kv(L: Layout) -> None:
    """The metadata of :func:`mla_attention`: the cache row is the latent plus the rotated part
    (one K/V head), the decompressed heads are ``key_length_mla``/``value_length_mla``."""
    d = L.dims
    L.set(attention__head_count=d.n_head, attention__head_count_kv=1,
          attention__q_lora_rank=d.q_lora, attention__kv_lora_rank=d.kv_lora,
          attention__key_length=d.kv_lora + d.rope_dim, attention__value_length=d.kv_lora,
          attention__key_length_mla=d.nope_dim + d.rope_dim, attention__value_length_mla=d.v_mla,
          rope__dimension_count=d.rope_dim, attention__layer_norm_rms_epsilon=d.rms_eps)


def dsa_indexer(L: Layout, il: int) -> None:
    """The lightning indexer of DeepSeek sparse attention (deepseek32, glm-dsa)."""
    d, p = L.dims, blk(il)
    L.norm(p + "indexer.k_norm.weight", d.indexer_dim)
    L.bias(p + "indexer.k_norm.bias", d.indexer_dim)
    L.add(p + "indexer.proj.weight", d.n_embd, d.indexer_heads)
    L.add(p + "indexer.attn_k.weight", d.n_embd, d.indexer_dim)
    L.add(p + "indexer.attn_q_b.weight", d.q_lora, d.indexer_heads * d.indexer_dim)


def dsa_kv(L: Layout) -> None:
    # a top-k past the context: every position is selected, the results do not hinge on ties
    d = L.dims
    L.set(attention__indexer__head_count=d.indexer_heads, attention__indexer__key_length=d.indexer_dim,
          attention__indexer__top_k=4 * d.n_ctx)


def dense_ffn(L: Layout, il: int, *, n_ff: Optional[int] = None, gated: bool = True) -> None:
    d, p = L.dims, blk(il)
    n_ff = n_ff or d.n_ff
    if gated:
        L.add(p + "ffn_gate.weight", d.n_embd, n_ff)
    L.add(p + "ffn_up.weight", d.n_embd, n_ff)
    L.out(p + "ffn_down.weight", n_ff, d.n_embd)


def moe_ffn(L: Layout, il: int, *, gated: bool = True, probs_bias: Optional[str] = "exp_probs_b.bias",
            shared: bool = True, shared_gate_inp: bool = False, n_ff_shexp: Optional[int] = None) -> None:
    """Routed experts (``ffn_*_exps``, ``{fan_in, fan_out, n_expert}``) with a router and, if
    named, its selection bias (``probs_bias``: the tensor's name after ``blk.N.``), plus shared
    experts (``shared``; ``shared_gate_inp``: qwen's sigmoid gate on them). ``gated``: SwiGLU
    (gate and up); else up only (nemotron's squared ReLU)."""
    d, p = L.dims, blk(il)
    E, X = d.n_embd, d.n_expert
    L.add(p + "ffn_gate_inp.weight", E, X)
    if probs_bias:
        L.bias(p + probs_bias, X)
    if gated:
        L.add(p + "ffn_gate_exps.weight", E, d.n_ff_exp, X)
    L.add(p + "ffn_up_exps.weight", E, d.n_ff_exp, X)
    L.out(p + "ffn_down_exps.weight", d.n_ff_exp, E, X)
    if shared:
        n_sh = n_ff_shexp or d.n_ff_shexp
        if shared_gate_inp:
            L.add(p + "ffn_gate_inp_shexp.weight", E)
        if gated:
            L.add(p + "ffn_gate_shexp.weight", E, n_sh)
        L.add(p + "ffn_up_shexp.weight", E, n_sh)
        L.out(p + "ffn_down_shexp.weight", n_sh, E)


def moe_kv(L: Layout, **extra) -> None:
    d = L.dims
    L.set(expert_count=d.n_expert, expert_used_count=d.n_expert_used,
          expert_feed_forward_length=d.n_ff_exp, **extra)


def nextn(L: Layout, il: int, *, head_norm: Optional[str] = None) -> None:
    """A NextN head's input fusion: ``eh_proj`` over ``[enorm(embedding); hnorm(hidden)]``;
    ``head_norm``: the name of the head's own final norm, where the loader wants one."""
    d, p = L.dims, blk(il)
    L.add(p + "nextn.eh_proj.weight", 2 * d.n_embd, d.n_embd, role=EH_PROJ)
    L.norm(p + "nextn.enorm.weight", d.n_embd)
    L.norm(p + "nextn.hnorm.weight", d.n_embd)
    if head_norm:
        L.norm(p + head_norm, d.n_embd)


def gated_delta_net(L: Layout, il: int, *, fused_ba: bool) -> None:
    """Qwen3-Next's linear attention (qwen3next, qwen35moe): ``attn_qkv`` and ``attn_gate`` in,
    a short convolution, the decay (``ssm_a``, negative) and step bias, beta/alpha (one fused
    ``ssm_ba`` in qwen3next, two tensors in qwen3.5), a gated RMS norm, ``ssm_out``."""
    d, p = L.dims, blk(il)
    E = d.n_embd
    key_dim = d.ssm_state * d.ssm_groups
    value_dim = d.ssm_state * d.ssm_heads
    conv_dim = 2 * key_dim + value_dim
    L.add(p + "attn_qkv.weight", E, conv_dim)
    L.add(p + "attn_gate.weight", E, value_dim)
    L.add(p + "ssm_conv1d.weight", d.ssm_conv, conv_dim, role=FIXED, init=normal(0.5))
    L.add(p + "ssm_dt.bias", d.ssm_heads, role=FIXED, init=uniform(-1.0, 1.0))
    L.add(p + "ssm_a", d.ssm_heads, role=FIXED, init=negative)
    if fused_ba:
        L.add(p + "ssm_ba.weight", E, 2 * d.ssm_heads)
    else:
        L.add(p + "ssm_beta.weight", E, d.ssm_heads)
        L.add(p + "ssm_alpha.weight", E, d.ssm_heads)
    L.norm(p + "ssm_norm.weight", d.ssm_state)
    L.out(p + "ssm_out.weight", value_dim, E)


def delta_net_kv(L: Layout) -> None:
    d = L.dims
    L.set(ssm__conv_kernel=d.ssm_conv, ssm__state_size=d.ssm_state, ssm__group_count=d.ssm_groups,
          ssm__time_step_rank=d.ssm_heads, ssm__inner_size=d.ssm_state * d.ssm_heads)


def decoder(L: Layout, il: int, attend, *, ffn_norm: Optional[str] = "ffn_norm.weight",
            moe: Optional[dict] = None, is_moe=None, head_norm: Optional[str] = None) -> None:
    """A pre-norm block: ``attn_norm``, ``attend(L, il)``, ``ffn_norm`` (None: a parallel block
    whose FFN reads the attention's input), ``moe_ffn(**moe)`` where ``is_moe(il)`` (default:
    after the ``dims.dense_lead`` leading blocks) and a dense FFN elsewhere, and a NextN block's
    input fusion."""
    d, p = L.dims, blk(il)
    L.norm(p + "attn_norm.weight", d.n_embd)
    attend(L, il)
    if ffn_norm:
        L.norm(p + ffn_norm, d.n_embd)
    if not (is_moe(il) if is_moe else il >= d.dense_lead):
        dense_ffn(L, il)
    else:
        moe_ffn(L, il, **(moe or {}))
    if il in L.nextn:
        nextn(L, il, head_norm=head_norm)
