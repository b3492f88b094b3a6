"""A Hugging Face ``config.json`` as a GGUF header llama.cpp can plan from (no weights).

:func:`write_gguf_from_hf_config` writes the metadata and the tensor infos, with the tensor
names and shapes llama.cpp's qwen35 / qwen35moe loaders expect, and no data: the tensors'
bytes are a hole in a sparse file, so a 27B model's header costs a few MB on disk. The planner
(``plan.py``) loads it with ``no_alloc``; nothing ever reads a weight.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Union

from ..errors import PlanError

__all__ = ["WEIGHT_TYPES", "write_gguf_from_hf_config"]

#: weight types for a model written from a config.json
WEIGHT_TYPES = ("f32", "f16", "bf16", "q8_0", "q6_k", "q5_k", "q4_k", "q4_0")


def _field(cfg: dict, name: str, where: str, default=None, required: bool = True):
    if name in cfg and cfg[name] is not None:
        return cfg[name]
    if not required:
        return default
    raise PlanError(f"{where}: the config has no {name!r} field, which the qwen35 mapping needs")


def _text_config(cfg: dict) -> dict:
    text = cfg.get("text_config")
    return dict(text) if isinstance(text, dict) else dict(cfg)


def _qwen35_hparams(cfg: dict, where: str) -> dict:
    """The qwen35 / qwen35moe hyperparameters of a Hugging Face config (Qwen3.5/3.6/3.8)."""
    text = _text_config(cfg)
    model_type = text.get("model_type") or cfg.get("model_type")
    if model_type not in ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"):
        raise PlanError(f"{where}: model_type {model_type!r} is not one the planner maps "
                        "(qwen3_5 / qwen3_5_text / qwen3_5_moe / qwen3_5_moe_text)")
    f = lambda name, **kw: _field(text, name, where, **kw)  # noqa: E731
    moe = "moe" in model_type or text.get("num_experts")
    n_layer = int(f("num_hidden_layers"))
    head_dim = int(f("head_dim", default=int(f("hidden_size")) // int(f("num_attention_heads")), required=False))
    rope = text.get("rope_parameters") or {}
    prf = float(rope.get("partial_rotary_factor", f("partial_rotary_factor", default=1.0, required=False)))
    section = list(rope.get("mrope_section", text.get("mrope_section") or [])) or None
    n_rot = int(head_dim * prf)
    if section is None:
        section = [n_rot // 2, 0, 0, 0]
    section = (list(section) + [0, 0, 0, 0])[:4]
    interval = text.get("full_attention_interval")
    layer_types = text.get("layer_types")
    if interval is None and layer_types:
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        if not full:
            raise PlanError(f"{where}: layer_types has no 'full_attention' layer")
        interval = full[0] + 1
    hp = dict(
        moe=bool(moe), n_layer=n_layer, n_nextn=int(f("mtp_num_hidden_layers", default=0, required=False)),
        n_embd=int(f("hidden_size")), n_head=int(f("num_attention_heads")),
        n_head_kv=int(f("num_key_value_heads")), head_dim=head_dim, n_rot=n_rot,
        n_vocab=int(f("vocab_size")), n_ctx_train=int(f("max_position_embeddings", default=262144, required=False)),
        rms_eps=float(f("rms_norm_eps", default=1e-6, required=False)),
        rope_theta=float(rope.get("rope_theta", f("rope_theta", default=1e7, required=False))),
        rope_sections=[int(x) for x in section], full_attn_interval=int(interval or 4),
        conv_kernel=int(f("linear_conv_kernel_dim")), k_heads=int(f("linear_num_key_heads")),
        v_heads=int(f("linear_num_value_heads")), k_dim=int(f("linear_key_head_dim")),
        v_dim=int(f("linear_value_head_dim")), tie=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
    )
    if hp["k_dim"] != hp["v_dim"]:
        raise PlanError(f"{where}: linear_key_head_dim {hp['k_dim']} != linear_value_head_dim {hp['v_dim']}: "
                        "llama.cpp's qwen35 uses one ssm.state_size for both")
    if moe:
        hp.update(n_expert=int(f("num_experts")), n_expert_used=int(f("num_experts_per_tok")),
                  n_ff_exp=int(f("moe_intermediate_size")),
                  n_ff_shexp=int(f("shared_expert_intermediate_size", default=0, required=False)),
                  n_ff=int(f("intermediate_size", default=int(f("moe_intermediate_size")), required=False)))
    else:
        hp["n_ff"] = int(f("intermediate_size"))
    return hp


def _qwen35_tensors(hp: dict):
    """(name, ggml ne) of every tensor llama.cpp's qwen35/qwen35moe loader creates."""
    E, V = hp["n_embd"], hp["n_vocab"]
    hd, nh, nkv = hp["head_dim"], hp["n_head"], hp["n_head_kv"]
    key_dim, value_dim = hp["k_dim"] * hp["k_heads"], hp["v_dim"] * hp["v_heads"]
    conv_dim = 2 * key_dim + value_dim
    out = [("token_embd.weight", (E, V)), ("output_norm.weight", (E,))]
    if not hp["tie"]:
        out.append(("output.weight", (E, V)))

    def attn(p):
        return [(p + "attn_q.weight", (E, 2 * hd * nh)), (p + "attn_k.weight", (E, hd * nkv)),
                (p + "attn_v.weight", (E, hd * nkv)), (p + "attn_output.weight", (hd * nh, E)),
                (p + "attn_q_norm.weight", (hd,)), (p + "attn_k_norm.weight", (hd,))]

    def ffn(p):
        if not hp["moe"]:
            return [(p + "ffn_gate.weight", (E, hp["n_ff"])), (p + "ffn_up.weight", (E, hp["n_ff"])),
                    (p + "ffn_down.weight", (hp["n_ff"], E))]
        n_x, n_fx, n_fs = hp["n_expert"], hp["n_ff_exp"], hp["n_ff_shexp"] or hp["n_ff"]
        return [(p + "ffn_gate_inp.weight", (E, n_x)), (p + "ffn_gate_exps.weight", (E, n_fx, n_x)),
                (p + "ffn_up_exps.weight", (E, n_fx, n_x)), (p + "ffn_down_exps.weight", (n_fx, E, n_x)),
                (p + "ffn_gate_inp_shexp.weight", (E,)), (p + "ffn_gate_shexp.weight", (E, n_fs)),
                (p + "ffn_up_shexp.weight", (E, n_fs)), (p + "ffn_down_shexp.weight", (n_fs, E))]

    for il in range(hp["n_layer"] + hp["n_nextn"]):
        p = f"blk.{il}."
        out += [(p + "attn_norm.weight", (E,)), (p + "post_attention_norm.weight", (E,))]
        if il < hp["n_layer"] and (il + 1) % hp["full_attn_interval"] != 0:  # gated delta net
            out += [(p + "attn_qkv.weight", (E, conv_dim)), (p + "attn_gate.weight", (E, value_dim)),
                    (p + "ssm_conv1d.weight", (hp["conv_kernel"], conv_dim)),
                    (p + "ssm_dt.bias", (hp["v_heads"],)), (p + "ssm_a", (hp["v_heads"],)),
                    (p + "ssm_beta.weight", (E, hp["v_heads"])), (p + "ssm_alpha.weight", (E, hp["v_heads"])),
                    (p + "ssm_norm.weight", (hp["v_dim"],)), (p + "ssm_out.weight", (value_dim, E))]
        else:
            out += attn(p)
        out += ffn(p)
        if il >= hp["n_layer"]:  # the MTP block
            out += [(p + "nextn.eh_proj.weight", (2 * E, E)), (p + "nextn.enorm.weight", (E,)),
                    (p + "nextn.hnorm.weight", (E,))]
    return out


def _tensor_type(name: str, ne, weight_type):
    import gguf

    small = len(ne) == 1 or "ssm_conv1d" in name or "ssm_alpha" in name or "ssm_beta" in name \
        or "ffn_gate_inp" in name
    if small:
        return gguf.GGMLQuantizationType.F32
    block, _ = gguf.GGML_QUANT_SIZES[weight_type]
    return weight_type if ne[0] % block == 0 else gguf.GGMLQuantizationType.F16


def write_gguf_from_hf_config(config: Union[str, os.PathLike, dict], path: Union[str, os.PathLike], *,
                              weight_type: str = "q4_k") -> Path:
    """Write a GGUF header for a qwen35 / qwen35moe Hugging Face ``config.json``: a sparse file.

    Metadata (``qwen35.*``, a TEST tokenizer of ``vocab_size`` tokens) and tensor infos with
    the names and shapes llama.cpp's loader expects; the data region is not written, the file
    is truncated to its full length (sparse on disk), so llama.cpp's bounds checks pass and
    nothing reads it under ``no_alloc``. Matrices get ``weight_type`` (rows that do not divide
    into its blocks: f16), norms and small SSM tensors f32.
    """
    import gguf

    where = os.fspath(config) if not isinstance(config, dict) else "config"
    if not isinstance(config, dict):
        try:
            config = json.loads(Path(config).read_text())
        except (OSError, ValueError) as e:
            raise PlanError(f"{where}: not a readable JSON config: {e}") from None
    try:
        wtype = gguf.GGMLQuantizationType[weight_type.upper()]
    except KeyError:
        raise PlanError(f"weight type {weight_type!r} is not one of {', '.join(WEIGHT_TYPES)}") from None
    hp = _qwen35_hparams(config, where)
    arch = "qwen35moe" if hp["moe"] else "qwen35"
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    a = arch + "."
    w.add_name(f"planned-{arch}")
    for key, value in (("context_length", hp["n_ctx_train"]), ("embedding_length", hp["n_embd"]),
                       ("block_count", hp["n_layer"] + hp["n_nextn"]), ("feed_forward_length", hp["n_ff"]),
                       ("attention.head_count", hp["n_head"]), ("attention.head_count_kv", hp["n_head_kv"]),
                       ("attention.key_length", hp["head_dim"]), ("attention.value_length", hp["head_dim"]),
                       ("rope.dimension_count", hp["n_rot"]), ("full_attention_interval", hp["full_attn_interval"]),
                       ("ssm.conv_kernel", hp["conv_kernel"]), ("ssm.inner_size", hp["v_dim"] * hp["v_heads"]),
                       ("ssm.state_size", hp["k_dim"]), ("ssm.time_step_rank", hp["v_heads"]),
                       ("ssm.group_count", hp["k_heads"])):
        w.add_uint32(a + key, int(value))
    if hp["n_nextn"]:
        w.add_uint32(a + "nextn_predict_layers", hp["n_nextn"])
    if hp["moe"]:
        w.add_uint32(a + "expert_count", hp["n_expert"])
        w.add_uint32(a + "expert_used_count", hp["n_expert_used"])
        w.add_uint32(a + "expert_feed_forward_length", hp["n_ff_exp"])
        if hp["n_ff_shexp"]:
            w.add_uint32(a + "expert_shared_feed_forward_length", hp["n_ff_shexp"])
    w.add_float32(a + "attention.layer_norm_rms_epsilon", hp["rms_eps"])
    w.add_float32(a + "rope.freq_base", hp["rope_theta"])
    w.add_array(a + "rope.dimension_sections", hp["rope_sections"])
    w.add_tokenizer_model("test")
    w.add_token_list([format(i, "x") for i in range(hp["n_vocab"])])
    w.add_token_scores([0.0] * hp["n_vocab"])
    w.add_token_types([int(gguf.TokenType.NORMAL)] * hp["n_vocab"])
    total = 0
    for name, ne in _qwen35_tensors(hp):
        t = _tensor_type(name, ne, wtype)
        block, size = gguf.GGML_QUANT_SIZES[t]
        n = 1
        for x in ne:
            n *= x
        nbytes = n // block * size
        import numpy as np

        w.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32), nbytes, raw_dtype=t)
        total += gguf.GGUFWriter.ggml_pad(nbytes, w.data_alignment)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with open(path, "r+b") as f:  # the data region: a hole, as long as the tensors say
        f.seek(0, os.SEEK_END)
        start = gguf.GGUFWriter.ggml_pad(f.tell(), w.data_alignment)
        f.truncate(start + total)
    return path
