"""Tiny GGUF models for tests: written on the spot with gguf-py, no downloads.

Three builders:

* :func:`make_tiny_mtp_model` -- a ``qwen35`` model (one gated-delta-net layer, one full
  attention layer, one NextN/MTP block) whose MTP head agrees with the target's greedy
  continuation at a chosen rate, or carries plain seeded random weights.
* :func:`make_tiny_model` -- a small model without NextN layers (``llama``, ``qwen3`` or
  ``qwen35``) with seeded random weights.
* :func:`make_mtp_model` -- a ``qwen35`` MTP model at real proportions (Qwen's 151,936-token
  vocabulary, a 0.6B-class trunk by default) with the same agreement design, f16 or q8_0,
  cached by its arguments (the benchmarks' model; see its docstring).

Every model uses the same tokenizer: ``tokenizer.ggml.model = "test"`` (llama.cpp's dummy
TEST vocabulary) with :data:`N_VOCAB` tokens (``make_mtp_model``: ``n_vocab``) whose texts are the token ids in lower-case hex
(``"0"`` .. ``"7f"``), which is exactly what llama.cpp prints for a TEST token, so
detokenizing gives readable text such as ``"1f7a"``.

The two tiny builders' weights are all f32 and drawn from ``np.random.default_rng(seed)`` in a
fixed order, and the gguf writer emits no timestamps, so the same arguments give the same bytes
every time. Each tiny file is under 10 MB and is written in well under a second.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import numpy as np

__all__ = [
    "N_VOCAB",
    "N_EMBD",
    "LOGIT_MARGIN",
    "SUPPORTED_ARCHS",
    "make_tiny_mtp_model",
    "make_tiny_model",
    "mtp_agreement_plan",
    "QWEN_N_VOCAB",
    "BENCH_SHAPE",
    "MTP_MODEL_DTYPES",
    "make_mtp_model",
    "mtp_model_path",
    "mtp_model_plan",
    "mtp_model_cycle_len",
    "mtp_model_logit_margin",
    "split_devices",
    "TEST_DEVICES_ENV",
    "free_port",
    "start_rpc_server",
    "stop_process",
    "VOCABS",
]

from .vocab import VOCABS, chars_vocab, write_vocab  # noqa: E402
from .metadata import add_metadata  # noqa: E402
from .families.agreement import LOGIT_MARGIN, agreement_plan, check_agreement, design_tensors  # noqa: E402

PathLike = Union[str, "os.PathLike[str]"]

#: Where the tests and ``llama-metaws repro`` take the devices of a tensor split from.
TEST_DEVICES_ENV = "LLAMA_METAWS_TEST_DEVICES"


def split_devices(n: int = 2) -> List[str]:
    """The n devices a tensor-split test spreads over.

    ``LLAMA_METAWS_TEST_DEVICES`` names them, comma-separated as llama.cpp prints them, and is
    cycled to n names: ``CUDA0`` gives ``CUDA0,CUDA0`` (one GPU listed twice), ``CUDA0,CUDA1``
    two GPUs. Unset, the CPU listed n times: the CPU test bed.
    """
    names = [d.strip() for d in os.environ.get(TEST_DEVICES_ENV, "").split(",") if d.strip()]
    names = names or ["CPU"]
    return [names[i % len(names)] for i in range(n)]

#: Vocabulary size of every tiny model.
N_VOCAB = 128
#: Embedding width of every tiny model.
N_EMBD = 256
#: Architectures :func:`make_tiny_model` can write.
SUPPORTED_ARCHS: Tuple[str, ...] = ("llama", "qwen3", "qwen35")

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


def _llama_like(t: _Tensors, n_layer: int, qk_norm: bool, V: int = N_VOCAB) -> None:
    E = N_EMBD
    t.normal("token_embd.weight", (V, E), 1.0)
    t.norm("output_norm.weight", E, 0.1)
    t.normal("output.weight", (V, E))
    for il in range(n_layer):
        p = f"blk.{il}."
        t.norm(p + "attn_norm.weight", E, 0.1)
        t.normal(p + "attn_q.weight", (_N_HEAD * _HEAD_DIM, E))
        t.normal(p + "attn_k.weight", (_N_HEAD * _HEAD_DIM, E))
        t.normal(p + "attn_v.weight", (_N_HEAD * _HEAD_DIM, E))
        t.normal(p + "attn_output.weight", (E, _N_HEAD * _HEAD_DIM))
        if qk_norm:
            t.norm(p + "attn_q_norm.weight", _HEAD_DIM, 0.1)
            t.norm(p + "attn_k_norm.weight", _HEAD_DIM, 0.1)
        t.norm(p + "ffn_norm.weight", E, 0.1)
        t.normal(p + "ffn_gate.weight", (_N_FF, E))
        t.normal(p + "ffn_up.weight", (_N_FF, E))
        t.normal(p + "ffn_down.weight", (E, _N_FF))


def make_tiny_model(path: PathLike, *, arch: str = "llama", seed: int = 0, vocab: str = "test",
                    context_length: int = _N_CTX, chat_template: Optional[str] = None,
                    n_vocab: int = N_VOCAB, vocab_words=()) -> Path:
    """Write a tiny GGUF without NextN layers, with seeded random weights.

    ``arch`` is one of :data:`SUPPORTED_ARCHS`:

    * ``"llama"``: 2 layers, E = 256, 2 heads of 128, n_ff = 384, separate ``output``;
    * ``"qwen3"``: the same plus per-head Q/K RMS norms;
    * ``"qwen35"``: the trunk of :func:`make_tiny_mtp_model` (a gated delta net layer and a
      gated full-attention layer) without the MTP block.

    All use the TEST tokenizer with :data:`N_VOCAB` tokens (``vocab="chars"``: characters, see
    :mod:`.vocab`). ``context_length``, ``chat_template``, ``n_vocab`` and ``vocab_words`` as for
    :func:`make_tiny_mtp_model`.
    Raises ``ValueError`` for any other ``arch``.
    """
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"unsupported arch {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    rng = np.random.default_rng(seed)
    t = _Tensors(rng)
    n_layer = 2

    if arch == "qwen35":
        t.normal("token_embd.weight", (n_vocab, N_EMBD), 1.0)
        t.norm("output_norm.weight", N_EMBD, 0.1)
        t.normal("output.weight", (n_vocab, N_EMBD))
        _qwen35_trunk(t, n_layer, 2, None, 0.1)
        kv = _qwen35_kv(n_layer, 0, context_length)
    else:
        _llama_like(t, n_layer, qk_norm=(arch == "qwen3"), V=n_vocab)
        kv = {
            "context_length": context_length,
            "embedding_length": N_EMBD,
            "block_count": n_layer,
            "feed_forward_length": _N_FF,
            "attention.head_count": _N_HEAD,
            "attention.head_count_kv": _N_HEAD,
            "attention.layer_norm_rms_epsilon": _RMS_EPS,
            "rope.dimension_count": _HEAD_DIM,
            "rope.freq_base": 10000.0,
        }
        if arch == "qwen3":
            kv["attention.key_length"] = _HEAD_DIM
            kv["attention.value_length"] = _HEAD_DIM
        if arch == "llama":
            kv["vocab_size"] = n_vocab

    return _write_gguf(Path(path), arch, kv, t, n_vocab, vocab, chat_template, vocab_words)


# --------------------------------------------------------------------------------------------
# real-shape MTP models: llama_metaws.testing.realshape (a module of its own: the size rule)

from .realshape import (  # noqa: E402  (re-exported: testing is where the builders are)
    BENCH_SHAPE,
    MTP_MODEL_DTYPES,
    QWEN_N_VOCAB,
    make_mtp_model,
    mtp_model_cycle_len,
    mtp_model_logit_margin,
    mtp_model_path,
    mtp_model_plan,
)


# --------------------------------------------------------------------------------------------
# ggml RPC servers on loopback (tests/test_rpc.py, bench/bench_rpc.py)


def generate_n(llm, tokens, n: int, **sampling) -> List[int]:
    """The first ``n`` tokens of ``llm.generate(tokens, **sampling)`` (greedy by default); the
    generator is closed after them, as ``create_completion`` closes it."""
    gen = llm.generate(list(tokens), **(sampling or {"temp": 0.0}))
    out: List[int] = []
    try:
        for t in gen:
            out.append(int(t))
            if len(out) == n:
                break
    finally:
        gen.close()
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In a child before exec (Linux): SIGKILL when the parent dies, even by an abort."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_rpc_server(port: int, host: str = "127.0.0.1", *, wait: float = 30.0, env=None, stderr=None):
    """``llama-metaws rpc-server`` on one CPU thread, as a child process (``.endpoint`` set) that
    dies with its parent; waits until it accepts connections (``wait`` seconds at most; 0: not)."""
    import socket
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_metaws", "rpc-server", "--host", host, "--port", str(port),
         "-t", "1", "--device", "CPU"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE if stderr is None else stderr, text=True,
        env=env, preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    proc.endpoint = f"{host}:{port}"
    deadline = time.monotonic() + wait
    while wait:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_process(proc)
                raise RuntimeError(f"rpc-server on {host}:{port} did not start (exit {proc.returncode})")
            time.sleep(0.1)
    return proc


def stop_process(proc) -> None:
    """Kill a child by its PID (SIGKILL) and reap it."""
    import signal

    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
