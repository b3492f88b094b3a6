"""Hybrid recurrent families: ``nemotron_h_moe`` / ``nemotron_h`` (Mamba-2, attention and MoE
blocks) and ``bailingmoe3`` (Kimi delta attention and MLA).

Nemotron-H types each trunk block by its per-layer sizes: no K/V heads and no FFN is a Mamba-2
block, K/V heads and no FFN attention, an FFN a MoE block (squared ReLU, no gate); one of each
(``"M*E"``, ``dims.layer_types`` in the config's spelling) is the smallest trunk. Its NextN block folds an attention and a MoE sub-layer and ends in a
LayerNorm (``nextn.shared_head_norm``) (``src/models/nemotron-h.cpp``). ``nemotron_h`` is the
same file under the dense architecture's name: llama.cpp loads its NextN block but has no MTP
graph for it (``nemotron-h-moe.cpp`` has one).

Ling 3.0 (bailingmoe3) marks a Kimi-delta-attention block by no K/V heads, MLA with a per-head
output gate otherwise; the NextN block is an MLA MoE block whose final norm is
``layer_output_norm`` (``src/models/bailingmoe3.cpp``).
"""

from __future__ import annotations

from .blocks import (GATING_SIGMOID, attention, blk, decoder, embeddings, mla_attention, mla_kv, moe_ffn, moe_kv,
                     nextn)
from .layout import FIXED, Dims, Layout, constant, negative, normal, per_layer, uniform


def mamba2(L: Layout, il: int) -> None:
    """A Mamba-2 mixer: ``ssm_in`` (z, x, B, C, dt), a short convolution over x/B/C, the decay
    ``ssm_a`` (negative) and skip ``ssm_d`` per head, a grouped RMS norm, ``ssm_out``."""
    d, p = L.dims, blk(il)
    d_inner = (d.ssm_head_dim or d.ssm_state) * d.ssm_heads
    xbc = d_inner + 2 * d.ssm_groups * d.ssm_state
    L.add(p + "ssm_in.weight", d.n_embd, d_inner + xbc + d.ssm_heads)
    L.add(p + "ssm_conv1d.weight", d.ssm_conv, xbc, role=FIXED, init=normal(0.5))
    L.add(p + "ssm_conv1d.bias", xbc, role=FIXED, init=normal(0.1))
    L.add(p + "ssm_dt.bias", d.ssm_heads, role=FIXED, init=uniform(-1.0, 1.0))
    L.add(p + "ssm_a", 1, d.ssm_heads, role=FIXED, init=negative)
    L.add(p + "ssm_d", 1, d.ssm_heads, role=FIXED, init=constant(1.0))
    L.norm(p + "ssm_norm.weight", d_inner // d.ssm_groups, d.ssm_groups)
    L.out(p + "ssm_out.weight", d_inner, d.n_embd)


def _nemotron(arch: str, dims: Dims) -> Layout:
    L = Layout(arch, dims)
    d = dims
    kinds = d.layer_types or "M*E"  # one of each: the smallest trunk
    if len(kinds) != d.n_layer or set(kinds) - set("M*E"):
        raise ValueError(f"{arch}: layer_types {kinds!r} must give M, * or E for each of {d.n_layer} trunk blocks")
    d_inner = (d.ssm_head_dim or d.ssm_state) * d.ssm_heads
    L.set(attention__head_count=d.n_head,
          attention__head_count_kv=per_layer(L, [d.n_head_kv if k == "*" else 0 for k in kinds]
                                             + [d.n_head_kv] * d.n_nextn),
          feed_forward_length=per_layer(L, [d.n_ff if k == "E" else 0 for k in kinds] + [d.n_ff] * d.n_nextn),
          attention__key_length=d.head_dim, attention__value_length=d.head_dim,
          attention__layer_norm_epsilon=1e-5, attention__layer_norm_rms_epsilon=d.rms_eps,
          ssm__conv_kernel=d.ssm_conv, ssm__inner_size=d_inner, ssm__state_size=d.ssm_state,
          ssm__time_step_rank=d.ssm_heads, ssm__group_count=d.ssm_groups,
          expert_shared_feed_forward_length=d.n_ff_shexp, expert_shared_count=1,
          expert_weights_norm=True, expert_weights_scale=1.0)
    moe_kv(L)
    embeddings(L)
    block = {"M": mamba2, "*": attention, "E": lambda L, il: moe_ffn(L, il, gated=False)}
    for il, kind in zip(L.trunk, kinds):
        L.norm(blk(il) + "attn_norm.weight", d.n_embd)
        block[kind](L, il)
    for il in L.nextn:
        p = blk(il)
        nextn(L, il, head_norm="nextn.shared_head_norm.weight")
        L.norm(p + "attn_norm.weight", d.n_embd)
        attention(L, il)
        L.norm(p + "post_attention_norm.weight", d.n_embd)
        moe_ffn(L, il, gated=False)
    return L


def nemotron_h_moe(dims: Dims) -> Layout:
    return _nemotron("nemotron_h_moe", dims)


def nemotron_h(dims: Dims) -> Layout:
    return _nemotron("nemotron_h", dims)


def kimi_delta_attention(L: Layout, il: int) -> None:
    """A Kimi delta attention block as bailingmoe3 loads it: Q/K/V with short per-channel
    convolutions, the forget gate (``ssm_f_a``, ``ssm_a``, ``ssm_dt.bias``), beta, the output
    gate (``ssm_g_a``) and a per-head norm, ``attn_output``."""
    d, p = L.dims, blk(il)
    E, n_head = d.n_embd, d.n_head
    d_inner = d.head_dim * n_head
    for qkv in "qkv":
        L.add(p + f"ssm_conv1d_{qkv}.weight", d.ssm_conv, 1, d_inner, 1, role=FIXED, init=normal(0.5))
    for qkv in "qkv":
        L.add(p + f"attn_{qkv}.weight", E, d_inner)
    L.add(p + "ssm_f_a.weight", E, d_inner)
    L.add(p + "ssm_beta.weight", E, n_head)
    L.add(p + "ssm_a", 1, n_head, role=FIXED, init=uniform(0.5, 1.5))
    L.add(p + "ssm_dt.bias", d_inner, role=FIXED, init=uniform(-1.0, 1.0))
    L.add(p + "ssm_g_a.weight", E, d_inner)
    L.norm(p + "ssm_norm.weight", d.head_dim)
    L.out(p + "attn_output.weight", d_inner, E)


def bailingmoe3(dims: Dims) -> Layout:
    L = Layout("bailingmoe3", dims)
    d = dims
    mla_kv(L)
    L.set(attention__head_count_kv=per_layer(L, [0, 1, 1]), ssm__conv_kernel=d.ssm_conv,
          kda__head_dim=d.head_dim, kda__safe_gate=True, kda__gate_lower_bound=-5.0,
          feed_forward_length=d.n_ff, leading_dense_block_count=d.dense_lead, expert_shared_count=1,
          expert_shared_feed_forward_length=d.n_ff_shexp, expert_weights_scale=1.0,
          expert_weights_norm=True, expert_gating_func=GATING_SIGMOID)
    moe_kv(L)
    embeddings(L)
    for il in L.layers:  # block 0 (dense_lead 1): Kimi delta attention, the others MLA
        decoder(L, il, kimi_delta_attention if il == 0 else lambda L, il: mla_attention(L, il, head_gate=True),
                head_norm="layer_output_norm.weight")
    return L
