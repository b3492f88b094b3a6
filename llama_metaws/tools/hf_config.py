"""A Hugging Face ``config.json`` as a GGUF header llama.cpp can plan from (no weights).

Each mapping reads a family's config fields into the sizes of
:class:`llama_metaws.tools.layouts.Dims`; the family's layout (the same one the tiny
test models are written from) gives the metadata and the tensor names and shapes llama.cpp's
loader expects, and :func:`write_gguf_from_hf_config` writes them with no data: the tensors'
bytes are a hole in a sparse file, so a 300B model's header costs a few MB on disk. The planner
(``plan.py``) loads it with ``no_alloc``; nothing ever reads a weight.

Families (``model_type``): Qwen3.5/3.6/3.8 dense and MoE (``qwen3_5``, ``qwen3_5_moe``, and
their ``_text``), GLM-4.5 (``glm4_moe``), GLM-4.7-Flash (``glm4_moe_lite``: llama.cpp's
deepseek2), DeepSeek-V3.2 (``deepseek_v32``), MiMo-V2 / V2.5 (``mimo_v2_flash``, ``mimo_v2``),
Step-3.5 (``step3p5``) and Nemotron-H (``nemotron_h``: nemotron_h_moe with routed experts).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable, Dict, Tuple, Union

from ..errors import PlanError

__all__ = ["WEIGHT_TYPES", "MODEL_TYPES", "write_gguf_from_hf_config", "hf_layout"]

#: weight types for a model written from a config.json
WEIGHT_TYPES = ("f32", "f16", "bf16", "q8_0", "q6_k", "q5_k", "q4_k", "q4_0")


class _Config:
    """A config's text part, read field by field; a missing field names itself."""

    def __init__(self, cfg: dict, where: str) -> None:
        text = cfg.get("text_config")
        self.cfg, self.where = cfg, where
        self.text = dict(text) if isinstance(text, dict) else dict(cfg)
        self.model_type = self.text.get("model_type") or cfg.get("model_type")

    def __call__(self, name: str, default=None, *, required: bool = True, alias: Tuple[str, ...] = ()):
        for key in (name, *alias):
            if self.text.get(key) is not None:
                return self.text[key]
        if not required:
            return default
        raise PlanError(f"{self.where}: the config has no {name!r} field, which the "
                        f"{self.model_type} mapping needs")

    def int(self, name: str, default=None, **kw) -> int:
        return int(self(name, default, required=default is None, **kw))

    def common(self) -> dict:
        """The sizes every family has."""
        tie = self.cfg.get("tie_word_embeddings", self.text.get("tie_word_embeddings", False))
        return dict(n_vocab=self.int("vocab_size"), n_embd=self.int("hidden_size"),
                    n_ctx=self.int("max_position_embeddings", 131072), n_layer=self.int("num_hidden_layers"),
                    n_head=self.int("num_attention_heads"), tie=bool(tie),
                    rms_eps=float(self("rms_norm_eps", 1e-6, required=False,
                                        alias=("layernorm_epsilon", "layer_norm_epsilon"))))

    def moe(self, *, experts=("n_routed_experts",), used=("num_experts_per_tok",)) -> dict:
        return dict(n_expert=self.int(experts[0], alias=experts[1:]), n_expert_used=self.int(used[0], alias=used[1:]),
                    n_ff_exp=self.int("moe_intermediate_size"))

    def fail(self, why: str):
        raise PlanError(f"{self.where}: {why}")


def _dense_lead(c: _Config, flags) -> int:
    """The leading dense blocks of a per-layer MoE flag list, which must be dense then MoE."""
    flags = [bool(int(f)) for f in flags]
    lead = flags.index(True) if True in flags else len(flags)
    if any(not f for f in flags[lead:]):
        c.fail(f"MoE blocks after dense ones ({flags}): the layout takes leading dense blocks only")
    return lead


def _qwen35(c: _Config) -> Tuple[str, dict]:
    rope = c.text.get("rope_parameters") or {}
    head_dim = c.int("head_dim", c.int("hidden_size") // c.int("num_attention_heads"))
    prf = float(rope.get("partial_rotary_factor", c("partial_rotary_factor", 1.0, required=False)))
    section = list(rope.get("mrope_section", c.text.get("mrope_section") or [])) or [int(head_dim * prf) // 2]
    interval = c.text.get("full_attention_interval")
    types = c.text.get("layer_types")
    if interval is None and types:
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        if not full:
            c.fail("layer_types has no 'full_attention' layer")
        interval = full[0] + 1
    k_dim, v_dim = c.int("linear_key_head_dim"), c.int("linear_value_head_dim")
    if k_dim != v_dim:
        c.fail(f"linear_key_head_dim {k_dim} != linear_value_head_dim {v_dim}: llama.cpp's qwen35 uses one "
               "ssm.state_size for both")
    dims = dict(c.common(), n_ctx=c.int("max_position_embeddings", 262144), n_nextn=c.int("mtp_num_hidden_layers", 0),
                n_head_kv=c.int("num_key_value_heads"), head_dim=head_dim, n_rot=int(head_dim * prf),
                rope_sections=tuple((section + [0, 0, 0, 0])[:4]), full_attn_interval=int(interval or 4),
                ssm_conv=c.int("linear_conv_kernel_dim"), ssm_groups=c.int("linear_num_key_heads"),
                ssm_heads=c.int("linear_num_value_heads"), ssm_state=k_dim)
    if "moe" in c.model_type or c.text.get("num_experts"):
        dims.update(c.moe(experts=("num_experts",)), n_ff_shexp=c.int("shared_expert_intermediate_size", 0),
                    n_ff=c.int("intermediate_size", c.int("moe_intermediate_size")))
        return "qwen35moe", dims
    return "qwen35", dict(dims, n_ff=c.int("intermediate_size"))


def _glm4_moe(c: _Config) -> Tuple[str, dict]:
    head_dim = c.int("head_dim", c.int("hidden_size") // c.int("num_attention_heads"))
    return "glm4moe", dict(**c.common(), **c.moe(), n_nextn=c.int("num_nextn_predict_layers", 0),
                           n_head_kv=c.int("num_key_value_heads"), head_dim=head_dim,
                           n_rot=int(head_dim * float(c("partial_rotary_factor", 0.5, required=False))),
                           n_ff=c.int("intermediate_size"), dense_lead=c.int("first_k_dense_replace", 1),
                           n_expert_shared=c.int("n_shared_experts", 1))


def _mla(arch: str, c: _Config, **extra) -> Tuple[str, dict]:
    if not c.text.get("q_lora_rank"):
        c.fail("q_lora_rank is missing or 0: llama.cpp's MTP graph for MLA needs the low-rank Q")
    return arch, dict(**c.common(), **c.moe(), n_nextn=c.int("num_nextn_predict_layers", 0),
                      q_lora=c.int("q_lora_rank"), kv_lora=c.int("kv_lora_rank"),
                      nope_dim=c.int("qk_nope_head_dim"), rope_dim=c.int("qk_rope_head_dim"),
                      v_mla=c.int("v_head_dim"), n_ff=c.int("intermediate_size"),
                      dense_lead=c.int("first_k_dense_replace", 1), n_expert_shared=c.int("n_shared_experts", 1),
                      **extra)


def _deepseek32(c: _Config) -> Tuple[str, dict]:
    return _mla("deepseek32", c, indexer_heads=c.int("index_n_heads"), indexer_dim=c.int("index_head_dim"))


def _mimo2(c: _Config) -> Tuple[str, dict]:
    n_layer, n_nextn = c.int("num_hidden_layers"), c.int("num_nextn_predict_layers", 0)
    pattern = list(c("hybrid_layer_pattern"))
    if len(pattern) != n_layer:
        c.fail(f"hybrid_layer_pattern has {len(pattern)} entries for {n_layer} layers")
    head_dim = c.int("head_dim")
    return "mimo2", dict(**c.common(), **c.moe(), n_nextn=n_nextn, n_head_kv=c.int("num_key_value_heads"),
                         n_head_swa=c.int("swa_num_attention_heads", c.int("num_attention_heads")),
                         n_head_kv_swa=c.int("swa_num_key_value_heads", c.int("num_key_value_heads")),
                         head_dim=head_dim, head_dim_v=c.int("v_head_dim", head_dim),
                         n_ff=c.int("intermediate_size"), n_swa=c.int("sliding_window", alias=("sliding_window_size",)),
                         # the MTP blocks attend over the window, as the trunk's sliding blocks
                         swa=tuple(int(p) for p in pattern) + (1,) * n_nextn,
                         dense_lead=_dense_lead(c, c("moe_layer_freq")),
                         n_rot=int(head_dim * float(c("partial_rotary_factor", 1.0, required=False))))


def _step35(c: _Config) -> Tuple[str, dict]:
    n_layer, n_nextn = c.int("num_hidden_layers"), c.int("num_nextn_predict_layers", 0)
    types = list(c("layer_types"))
    if len(types) not in (n_layer, n_layer + n_nextn):
        c.fail(f"layer_types has {len(types)} entries for {n_layer} layers and {n_nextn} MTP layers")
    types += ["full_attention"] * (n_layer + n_nextn - len(types))
    moe_layers = {int(x) for x in str(c("moe_layers_enum")).split(",") if x.strip()}
    swa_set = c.text.get("attention_other_setting") or {}
    return "step35", dict(c.common(), n_nextn=n_nextn,
                          n_expert=c.int("moe_num_experts", alias=("num_experts",)),
                          n_expert_used=c.int("moe_top_k", alias=("num_experts_per_tok",)),
                          n_ff_exp=c.int("moe_intermediate_size"), n_ff_shexp=c.int("share_expert_dim"),
                          n_head_kv=c.int("num_attention_groups", alias=("num_key_value_heads",)),
                          n_head_swa=int(swa_set.get("num_attention_heads", 0)),
                          n_head_kv_swa=int(swa_set.get("num_attention_groups", 0)),
                          head_dim=c.int("head_dim"), n_ff=c.int("intermediate_size"),
                          n_swa=c.int("sliding_window"), swa=tuple(int(t == "sliding_attention") for t in types),
                          dense_lead=_dense_lead(c, [i in moe_layers for i in range(n_layer)]))


def _nemotron_h(c: _Config) -> Tuple[str, dict]:
    pattern = c("hybrid_override_pattern")
    if not isinstance(pattern, str) or set(pattern) - set("M*E"):
        c.fail(f"hybrid_override_pattern {pattern!r}: the layout maps M (Mamba-2), * (attention) and E (MoE)")
    mtp = c("mtp_hybrid_override_pattern", "*E", required=False)
    if c.int("num_nextn_predict_layers", 0) and mtp != "*E":
        c.fail(f"mtp_hybrid_override_pattern {mtp!r}: llama.cpp's NextN block is attention then MoE ('*E')")
    dims = dict(**c.common(), **c.moe(), n_nextn=c.int("num_nextn_predict_layers", 0), layer_types=pattern,
                n_head_kv=c.int("num_key_value_heads"), head_dim=c.int("head_dim"),
                n_ff=c.int("intermediate_size", c.int("moe_intermediate_size")),
                n_ff_shexp=c.int("moe_shared_expert_intermediate_size"),
                ssm_conv=c.int("conv_kernel", alias=("mamba_d_conv",)), ssm_state=c.int("ssm_state_size"),
                ssm_heads=c.int("mamba_num_heads"), ssm_head_dim=c.int("mamba_head_dim"),
                ssm_groups=c.int("n_groups", alias=("mamba_n_groups",)))
    return "nemotron_h_moe", dims


#: model_type -> its mapping onto a family's sizes
MODEL_TYPES: Dict[str, Callable[[_Config], Tuple[str, dict]]] = {
    "qwen3_5": _qwen35, "qwen3_5_text": _qwen35, "qwen3_5_moe": _qwen35, "qwen3_5_moe_text": _qwen35,
    "glm4_moe": _glm4_moe, "glm4_moe_lite": lambda c: _mla("deepseek2", c), "deepseek_v32": _deepseek32,
    "mimo_v2_flash": _mimo2, "mimo_v2": _mimo2, "step3p5": _step35, "nemotron_h": _nemotron_h,
}


def hf_layout(config: dict, where: str = "config"):
    """The family layout (:mod:`llama_metaws.tools.layouts`) of a Hugging Face config."""
    from .layouts import Dims, family_layout

    c = _Config(config, where)
    mapping = MODEL_TYPES.get(c.model_type)
    if mapping is None:
        raise PlanError(f"{where}: model_type {c.model_type!r} is not one the planner maps "
                        f"({' / '.join(MODEL_TYPES)})")
    arch, sizes = mapping(c)
    known = {f.name for f in dataclasses.fields(Dims)}
    return family_layout(arch, Dims(**{k: v for k, v in sizes.items() if k in known}))


def _tensor_type(name: str, ne, weight_type):
    import gguf

    small = len(ne) == 1 or name.endswith((".ssm_a", ".ssm_d")) \
        or any(k in name for k in ("ssm_conv1d", "ssm_alpha", "ssm_beta", "ffn_gate_inp"))
    if small:
        return gguf.GGMLQuantizationType.F32
    block, _ = gguf.GGML_QUANT_SIZES[weight_type]
    return weight_type if ne[0] % block == 0 else gguf.GGMLQuantizationType.F16


def write_gguf_from_hf_config(config: Union[str, os.PathLike, dict], path: Union[str, os.PathLike], *,
                              weight_type: str = "q4_k") -> Path:
    """Write a GGUF header for a Hugging Face ``config.json`` (a family :data:`MODEL_TYPES`
    maps): a sparse file.

    Metadata (a TEST tokenizer of ``vocab_size`` tokens) and tensor infos with the names and
    shapes llama.cpp's loader expects; the data region is not written, the file is truncated to
    its full length (sparse on disk), so llama.cpp's bounds checks pass and nothing reads it
    under ``no_alloc``. Matrices get ``weight_type`` (rows that do not divide into its blocks:
    f16), norms, routers and small SSM tensors f32.
    """
    import gguf

    from .layouts.layout import write_header

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
    layout = hf_layout(config, where)
    return write_header(layout, Path(path), lambda name, ne: _tensor_type(name, ne, wtype))
