"""The demo's model: a tiny ``qwen35`` MTP model written on the spot with gguf-py, no downloads.

:func:`make_tiny_mtp_model` writes a ``qwen35`` model (one gated-delta-net layer, one full
attention layer, one NextN/MTP block) whose MTP head agrees with the target's greedy continuation
at a chosen rate (the agreement design, :mod:`.agreement`), or carries plain seeded random weights:
``llama-metaws demo`` and ``vram`` run on it when no model is given. The real-vocabulary model
(:func:`.realshape.make_mtp_model`) is the demo's second row. The tests build more models on the
same writer (the developer package ``llama_metaws_dev.testing``).

Every model uses the same tokenizer: ``tokenizer.ggml.model = "test"`` (llama.cpp's dummy TEST
vocabulary) with :data:`N_VOCAB` tokens whose texts are the token ids in lower-case hex (``"0"``
.. ``"7f"``), which is exactly what llama.cpp prints for a TEST token, so detokenizing gives
readable text such as ``"1f7a"``. The weights are all f32 and drawn from
``np.random.default_rng(seed)`` in a fixed order, and the gguf writer emits no timestamps, so the
same arguments give the same bytes every time; a file is under 10 MB, written in well under a second.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import numpy as np

__all__ = ["N_VOCAB", "N_EMBD", "EOS_TOKEN", "CHAT_TEMPLATE", "LOGIT_MARGIN", "make_tiny_mtp_model",
           "mtp_agreement_plan", "VOCABS"]

from .vocab import VOCABS, chars_vocab, write_vocab  # noqa: E402
from .metadata import add_metadata  # noqa: E402
from .agreement import LOGIT_MARGIN, agreement_plan, check_agreement, design_tensors  # noqa: E402

PathLike = Union[str, "os.PathLike[str]"]

#: Vocabulary size of every tiny model.
N_VOCAB = 128
#: Embedding width of every tiny model.
N_EMBD = 256
#: Architectures :func:`make_tiny_model` can write.

_N_CTX = 256
_N_HEAD = 2
_HEAD_DIM = N_EMBD // _N_HEAD  # 128
_N_FF = 384
_RMS_EPS = 1e-6

# qwen35 gated delta net (linear attention) sizes
_SSM_CONV = 4
_SSM_STATE = 128  # head_k_dim == head_v_dim
_SSM_GROUPS = 2  # number of K heads
_SSM_DT_RANK = 2  # number of V heads
_SSM_INNER = _SSM_STATE * _SSM_DT_RANK  # 256 (value_dim)
_SSM_CONV_DIM = 2 * _SSM_STATE * _SSM_GROUPS + _SSM_INNER  # 768

# scale of the projections that write into the residual stream in agreement models
_SMALL_OUT_STD = 1e-3


class _Tensors:
    """Ordered collection of named f32 tensors, drawn from one seeded generator.

    Shapes are given in numpy order, i.e. the reverse of ggml's ``ne``: a ggml tensor
    ``{n_in, n_out}`` is a numpy array of shape ``(n_out, n_in)``.
    """

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.items: List[Tuple[str, np.ndarray]] = []

    def add(self, name: str, value: np.ndarray) -> None:
        self.items.append((name, np.ascontiguousarray(value, dtype=np.float32)))

    def normal(self, name: str, shape: Tuple[int, ...], std: Optional[float] = None) -> None:
        """Gaussian weights; the default std is ``1/sqrt(fan_in)`` (the last numpy axis)."""
        if std is None:
            std = 1.0 / np.sqrt(shape[-1])
        self.add(name, self.rng.standard_normal(shape) * std)

    def ones(self, name: str, n: int) -> None:
        self.add(name, np.ones((n,), dtype=np.float32))

    def norm(self, name: str, n: int, jitter: float) -> None:
        """An RMS-norm weight: 1, or 1 plus a little seeded noise when ``jitter > 0``."""
        if jitter > 0:
            self.add(name, 1.0 + jitter * self.rng.standard_normal((n,)))
        else:
            self.ones(name, n)


# The end-of-generation token of every tiny model (the last one).
EOS_TOKEN = N_VOCAB - 1

# A plain chat template, so create_chat_completion has the model's own template to use.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _write_gguf(
    path: Path,
    arch: str,
    kv: Dict[str, object],
    tensors: _Tensors,
    n_vocab: int,
    vocab: str = "test",
    chat_template: Optional[str] = None,
    vocab_words=(),
) -> Path:
    """Write metadata, the tokenizer (:mod:`.vocab`), the chat template (default
    :data:`CHAT_TEMPLATE`) and the tensors to ``path`` with gguf-py."""
    import gguf  # local import: only the builders need it

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    try:
        writer.add_name(f"tiny-{arch}")
        add_metadata(writer, arch, kv)
        write_vocab(writer, vocab, n_vocab, n_vocab - 1, vocab_words)  # the last token ends generation
        writer.add_chat_template(CHAT_TEMPLATE if chat_template is None else chat_template)

        for name, value in tensors.items:
            writer.add_tensor(name, value)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path


# --------------------------------------------------------------------------------------------
# qwen35


def _qwen35_kv(n_layer_trunk: int, n_nextn: int, context_length: int = _N_CTX) -> Dict[str, object]:
    kv: Dict[str, object] = {
        "context_length": context_length,
        "embedding_length": N_EMBD,
        "block_count": n_layer_trunk + n_nextn,
        "feed_forward_length": _N_FF,
        "attention.head_count": _N_HEAD,
        "attention.head_count_kv": _N_HEAD,
        "attention.key_length": _HEAD_DIM,
        "attention.value_length": _HEAD_DIM,
        "attention.layer_norm_rms_epsilon": _RMS_EPS,
        "rope.freq_base": 10000.0,
        # llama.cpp reads exactly 4 INT32 entries (get_key_or_arr(..., 4, required));
        # with n_rot = head_dim = 128 the sections may sum to at most 128.
        "rope.dimension_sections": [32, 32, 32, 32],
        "full_attention_interval": 2,
        "ssm.conv_kernel": _SSM_CONV,
        "ssm.inner_size": _SSM_INNER,
        "ssm.state_size": _SSM_STATE,
        "ssm.time_step_rank": _SSM_DT_RANK,
        "ssm.group_count": _SSM_GROUPS,
    }
    if n_nextn:
        kv["nextn_predict_layers"] = n_nextn
    return kv


def _qwen35_ffn(t: _Tensors, p: str, out_std: Optional[float]) -> None:
    t.normal(p + "ffn_gate.weight", (_N_FF, N_EMBD))
    t.normal(p + "ffn_up.weight", (_N_FF, N_EMBD))
    t.normal(p + "ffn_down.weight", (N_EMBD, _N_FF), out_std)


def _qwen35_attn(t: _Tensors, p: str, out_std: Optional[float], jitter: float) -> None:
    """Full attention with a Q gate: attn_q is {E, 2 * n_head * head_dim}."""
    t.normal(p + "attn_q.weight", (2 * _N_HEAD * _HEAD_DIM, N_EMBD))
    t.normal(p + "attn_k.weight", (_N_HEAD * _HEAD_DIM, N_EMBD))
    t.normal(p + "attn_v.weight", (_N_HEAD * _HEAD_DIM, N_EMBD))
    t.normal(p + "attn_output.weight", (N_EMBD, _N_HEAD * _HEAD_DIM), out_std)
    t.norm(p + "attn_q_norm.weight", _HEAD_DIM, jitter)
    t.norm(p + "attn_k_norm.weight", _HEAD_DIM, jitter)


def _qwen35_linear_attn(t: _Tensors, p: str, out_std: Optional[float], jitter: float) -> None:
    """Gated delta net layer (the recurrent layers of qwen35)."""
    rng = t.rng
    t.normal(p + "attn_qkv.weight", (_SSM_CONV_DIM, N_EMBD))
    t.normal(p + "attn_gate.weight", (_SSM_INNER, N_EMBD))
    t.normal(p + "ssm_conv1d.weight", (_SSM_CONV_DIM, _SSM_CONV), 0.5)
    t.add(p + "ssm_dt.bias", rng.uniform(-1.0, 1.0, (_SSM_DT_RANK,)))
    # ssm_a multiplies softplus(alpha + dt): it is -exp(A_log), always negative (a decay)
    t.add(p + "ssm_a", -np.exp(rng.uniform(-1.0, 1.0, (_SSM_DT_RANK,))))
    t.normal(p + "ssm_beta.weight", (_SSM_DT_RANK, N_EMBD))
    t.normal(p + "ssm_alpha.weight", (_SSM_DT_RANK, N_EMBD))
    t.norm(p + "ssm_norm.weight", _SSM_STATE, jitter)
    t.normal(p + "ssm_out.weight", (N_EMBD, _SSM_INNER), out_std)


def _qwen35_trunk(
    t: _Tensors, n_layer: int, full_attn_interval: int, out_std: Optional[float], jitter: float
) -> None:
    for il in range(n_layer):
        p = f"blk.{il}."
        t.norm(p + "attn_norm.weight", N_EMBD, jitter)
        t.norm(p + "post_attention_norm.weight", N_EMBD, jitter)
        if (il + 1) % full_attn_interval != 0:
            _qwen35_linear_attn(t, p, out_std, jitter)
        else:
            _qwen35_attn(t, p, out_std, jitter)
        _qwen35_ffn(t, p, out_std)


def _qwen35_mtp_block(
    t: _Tensors, il: int, eh_proj: Optional[np.ndarray], out_std: Optional[float], jitter: float
) -> None:
    """The NextN block: a full-attention decoder block plus eh_proj/enorm/hnorm.

    ``nextn.embed_tokens``, ``nextn.shared_head_head`` and ``nextn.shared_head_norm`` are
    optional in llama.cpp and left out: the MTP graph then uses ``token_embd``, ``output``
    and ``output_norm``.
    """
    p = f"blk.{il}."
    t.norm(p + "attn_norm.weight", N_EMBD, jitter)
    t.norm(p + "post_attention_norm.weight", N_EMBD, jitter)
    _qwen35_attn(t, p, out_std, jitter)
    _qwen35_ffn(t, p, out_std)
    if eh_proj is None:
        t.normal(p + "nextn.eh_proj.weight", (N_EMBD, 2 * N_EMBD))
    else:
        t.add(p + "nextn.eh_proj.weight", eh_proj)
    t.norm(p + "nextn.enorm.weight", N_EMBD, jitter)
    t.norm(p + "nextn.hnorm.weight", N_EMBD, jitter)


def mtp_agreement_plan(agreement: float, seed: int = 0) -> Dict[str, np.ndarray]:
    """The token-level plan behind :func:`make_tiny_mtp_model` with ``agreement`` set.

    Returns a dict of int64 arrays of length :data:`N_VOCAB` (``cycle``: one less):

    * ``cycle``: the tokens but :data:`EOS_TOKEN`, in successor order,
      ``succ(cycle[k]) == cycle[(k+1) % (V-1)]`` (so greedy generation never ends);
    * ``succ``: ``succ[t]`` is the target's greedy next token after ``t``;
    * ``agree``: 1 where the MTP head's choice after ``t`` equals ``succ[t]``, else 0;
    * ``draft``: ``draft[t]`` is the MTP head's greedy choice after ``t``.

    The same seed gives the same plan as the model file written with that seed.
    """
    return _agreement_plan(np.random.default_rng(seed), _check_agreement(agreement))[0]


def _check_agreement(agreement: float) -> float:
    return check_agreement(agreement, 1)[0]


def _agreement_plan(
    rng: np.random.Generator, a: float
) -> Tuple[Dict[str, np.ndarray], np.ndarray]:
    """Draw the embedding basis and the successor cycle; return (plan, embeddings)."""
    return agreement_plan(rng, N_VOCAB, N_EMBD, [a])


def _end_tokens(n_vocab: int, vocab: str, words) -> List[int]:
    """The tokens that end a generation: the last one, and ChatML's end of turn where there is one."""
    out = [n_vocab - 1]
    if vocab.startswith("chars"):
        texts = chars_vocab(n_vocab, vocab, words)[0]
        out += [texts.index("<|im_end|>")] if "<|im_end|>" in texts else []
    return out


def make_tiny_mtp_model(
    path: PathLike, *, seed: int = 0, agreement: Optional[float] = None, vocab: str = "test",
    context_length: int = _N_CTX, chat_template: Optional[str] = None, n_vocab: int = N_VOCAB,
    vocab_words=(), quiet_ends: bool = False,
) -> Path:
    """Write a tiny ``qwen35`` GGUF with 2 trunk layers and 1 NextN (MTP) block.

    Layout (E = 256, V = 128, 2 heads of 128, n_ff = 384): ``blk.0`` is a gated delta net
    (recurrent) layer, ``blk.1`` a full-attention layer with a Q gate (``full_attention_interval``
    2), ``blk.2`` the MTP block (``nextn_predict_layers`` 1, ``block_count`` 3). The model has
    its own ``output.weight`` (not tied to ``token_embd``). Load it with
    ``llama_model_params.load_mtp = True`` to get the MTP block; without it the block is
    skipped and the file still loads as a plain target model.

    ``agreement=None``: seeded random weights (``1/sqrt(fan_in)`` Gaussians, RMS-norm
    weights near 1, negative ``ssm_a``), giving finite, spread-out logits.

    ``agreement=a`` (a float in [0, 1]): weights built so that the MTP head's greedy token
    equals the target's next greedy token at rate ``a``:

    1. ``token_embd`` rows ``e_t`` are orthonormal (QR of a seeded Gaussian), so an RMS norm
       maps ``e_t`` to ``16 * e_t`` (``16 = sqrt(E)``).
    2. Every projection that writes into the residual stream (``attn_output``, ``ssm_out``,
       ``ffn_down``, in the trunk and in the MTP block) is tiny (std 1e-3), so the target's
       last hidden state after ``output_norm`` (weight 1) is ``~16 * e_x`` for the current
       token ``x``, whatever the context.
    3. ``output`` row ``succ(t)`` is ``(LOGIT_MARGIN / 16) * e_t``, where ``succ`` is a single
       seeded cycle through all tokens but the end-of-generation one (:data:`EOS_TOKEN`, whose
       row is zero: greedy decoding never ends by itself): after ``x`` the target's logits are
       ``LOGIT_MARGIN`` (10) for ``succ(x)`` and ~0 elsewhere (softmax peak ~0.994), so the
       greedy continuation walks the cycle.
    4. The MTP block gets ``(x, h)`` -- the token just chosen and the target's hidden row of
       the previous position -- and computes ``eh_proj @ [enorm(e_x); hnorm(h)]``.
       ``eh_proj = [M | 0]`` with ``M = sum_t e_pi(t) e_t^T``: the hidden half is ignored and
       the embedding half becomes ``16 * e_pi(x)``, which passes the (tiny) attention and FFN
       and ``output_norm`` unchanged; the shared head (``output``) then picks
       ``succ(pi(x))``.
    5. ``pi(x) = x`` on "agreeing" tokens (draft == target), ``pi(x) = succ(x)`` otherwise
       (the draft guesses two tokens ahead, always wrong). With ``c_k`` the k-th token on the
       cycle, ``c_k`` agrees iff ``floor((k+1)a) > floor(ka)``, so any 64 consecutive steps
       of the greedy continuation agree at rate ``a`` within +-2/64.

    :func:`mtp_agreement_plan` returns the resulting ``succ``/``draft`` tables. ``vocab``: the
    tokenizer (:mod:`.vocab`; ``"chars"`` for tests that generate JSON). ``context_length``: the
    model's training context (256); ``chat_template``: its template (default
    :data:`CHAT_TEMPLATE`); ``n_vocab``: its vocabulary's size (another than :data:`N_VOCAB` only
    with random weights: the agreement design needs orthonormal embeddings, ``V <= E``; the
    last token ends generation); ``vocab_words``: words a ``chars`` vocabulary spells as one token
    each (:func:`.vocab.chars_vocab`). ``quiet_ends`` (random weights): the end-of-generation
    tokens' output rows are zero, so neither the target's text nor the head's drafts end by
    themselves (as a trained story model seldom ends mid-sentence).
    """
    if agreement is not None and n_vocab != N_VOCAB:
        raise ValueError(f"agreement models have {N_VOCAB} tokens; n_vocab={n_vocab} needs agreement=None")
    rng = np.random.default_rng(seed)
    n_trunk, n_nextn, interval = 2, 1, 2
    E, V = N_EMBD, n_vocab
    t = _Tensors(rng)

    if agreement is None:
        t.normal("token_embd.weight", (V, E), 1.0)
        t.norm("output_norm.weight", E, 0.1)
        t.normal("output.weight", (V, E))
        if quiet_ends:
            t.items[-1][1][_end_tokens(V, vocab, vocab_words)] = 0.0
        _qwen35_trunk(t, n_trunk, interval, None, 0.1)
        _qwen35_mtp_block(t, n_trunk, None, None, 0.1)
    else:
        plan, emb = _agreement_plan(rng, _check_agreement(agreement))
        design = design_tensors(plan, emb)
        eh_proj, output = design["eh_proj"][0], design["output"]
        t.add("token_embd.weight", emb)
        t.ones("output_norm.weight", E)
        t.add("output.weight", output)
        _qwen35_trunk(t, n_trunk, interval, _SMALL_OUT_STD, 0.0)
        _qwen35_mtp_block(t, n_trunk, eh_proj, _SMALL_OUT_STD, 0.0)

    return _write_gguf(Path(path), "qwen35", _qwen35_kv(n_trunk, n_nextn, context_length), t, V,
                       vocab, chat_template, vocab_words)


# --------------------------------------------------------------------------------------------
# plain models
