"""Real-shape MTP models: a ``qwen35`` with a real vocabulary and real proportions.

:func:`make_mtp_model` (re-exported by :mod:`llama_metaws_dev.testing`, next to the tiny builders)
generalizes :func:`llama_metaws_dev.testing.make_tiny_mtp_model`'s agreement design to
``n_vocab > n_embd``; see its docstring. This module imports nothing of the tiny builders (they
re-export it); the few constants both use are repeated here and checked equal by the tests.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import numpy as np

from .metadata import add_metadata

PathLike = Union[str, "os.PathLike[str]"]

# the tiny models' figures (llama_metaws_dev.testing: N_VOCAB, LOGIT_MARGIN, CHAT_TEMPLATE, ...)
N_VOCAB = 128
LOGIT_MARGIN = 10.0
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_RMS_EPS = 1e-6
_SSM_CONV = 4
_SMALL_OUT_STD = 1e-3


def _check_agreement(agreement: float) -> float:
    a = float(agreement)
    if not (0.0 <= a <= 1.0) or a != a:
        raise ValueError(f"agreement must be a float in [0, 1], got {agreement!r}")
    return a


def _token_texts(n_vocab: int) -> List[str]:
    return [format(i, "x") for i in range(n_vocab)]


#: Qwen's vocabulary size, the default of :func:`make_mtp_model`.
QWEN_N_VOCAB = 151936
#: The default shape of :func:`make_mtp_model` (and of ``bench/bench_realshape.py``): a
#: 0.6B-class qwen35 (28 trunk layers of width 1024, n_ff 3072, Qwen's vocabulary) plus one
#: NextN block, whose MTP step (one block and the output head) costs at most 30% of a target
#: decode step.
BENCH_SHAPE: Dict[str, int] = dict(n_vocab=QWEN_N_VOCAB, n_embd=1024, n_layer=28, n_ff=3072)
#: The data types :func:`make_mtp_model` writes its matrices in.
MTP_MODEL_DTYPES: Tuple[str, ...] = ("f16", "q8_0")

# Bump when make_mtp_model writes different bytes for the same arguments (it is in the cache key).
_MTP_MODEL_VERSION = 2
_RS_HEAD_DIM = 128  # attention head size and gated-delta-net state size
_RS_FULL_ATTN_INTERVAL = 4  # qwen35: three gated-delta-net layers, then one full-attention layer
_RS_CTX = 4096
_RS_POOL = 1 << 23  # at most this many values in the pool the plain matrices are cut from
# non-cycle tokens: their embedding is ALPHA * u + BETA * b (u, b unit vectors outside the
# cycle's span); the output row of the cycle's first token answers to u
_RS_ALPHA, _RS_BETA = 0.8, 0.6
_RS_NONCYCLE_OUT = 0.3  # output rows of non-cycle tokens, relative to a cycle row


def mtp_model_cycle_len(n_vocab: int, n_embd: int) -> int:
    """How many tokens the successor cycle of :func:`make_mtp_model` walks: at most
    ``n_embd // 2`` (their embeddings are orthogonal), at most ``n_vocab - 1``."""
    return min(n_vocab - 1, n_embd // 2)


def mtp_model_logit_margin(n_vocab: int) -> float:
    """The logit gap of :func:`make_mtp_model`'s designed token: :data:`LOGIT_MARGIN` plus
    ``ln(n_vocab / N_VOCAB)``, so its softmax peak is the tiny model's (~0.994) at any
    vocabulary size (a gap of 10 over 151,936 tokens would leave a peak of 0.13)."""
    return LOGIT_MARGIN + max(0.0, float(np.log(n_vocab / N_VOCAB)))


def _mtp_model_plan(rng: np.random.Generator, a: float, V: int, E: int) -> Dict[str, np.ndarray]:
    """The token-level plan of :func:`make_mtp_model` (drawn first from its generator)."""
    K = mtp_model_cycle_len(V, E)
    eos = V - 1
    cycle = rng.choice(V - 1, size=K, replace=False).astype(np.int64)  # never the last token
    succ = np.full(V, cycle[0], dtype=np.int64)  # after any token off the cycle: its first
    succ[cycle] = np.roll(cycle, -1)
    k = np.arange(K, dtype=np.int64)
    # the low-discrepancy pattern of make_tiny_mtp_model, along this cycle
    on_cycle = (np.floor((k + 1) * a + 1e-9) > np.floor(k * a + 1e-9)).astype(np.int64)
    agree = np.ones(V, dtype=np.int64)  # off the cycle the draft also answers cycle[0]
    agree[cycle] = on_cycle
    pi = np.arange(V, dtype=np.int64)
    pi[cycle] = np.where(on_cycle == 1, cycle, succ[cycle])
    draft = succ[pi]
    return {"cycle": cycle, "succ": succ, "agree": agree, "draft": draft, "pi": pi,
            "eos": np.array(eos)}


def mtp_model_plan(
    agreement: float, *, n_vocab: int = QWEN_N_VOCAB, n_embd: int = BENCH_SHAPE["n_embd"],
    seed: int = 0,
) -> Dict[str, np.ndarray]:
    """The token-level plan behind :func:`make_mtp_model` with these arguments.

    Int64 arrays: ``cycle`` (:func:`mtp_model_cycle_len` tokens in successor order), ``succ``
    (the target's greedy next token after each token: the next on the cycle, and the cycle's
    first token after any token off it), ``agree`` (1 where the MTP head's choice equals
    ``succ``), ``draft`` (the MTP head's greedy choice after each token).
    """
    return _mtp_model_plan(np.random.default_rng(seed), _check_agreement(agreement), n_vocab, n_embd)


class _Q:
    """One matrix type: f16 rows, or q8_0 blocks (gguf-py's quantizer), as bytes to write."""

    def __init__(self, dtype: str) -> None:
        import gguf

        self.dtype = dtype
        self.gguf = gguf
        self.qtype = gguf.GGMLQuantizationType.F16 if dtype == "f16" else gguf.GGMLQuantizationType.Q8_0

    def encode(self, x: np.ndarray) -> np.ndarray:
        """(n_out, n_in) float -> the array gguf writes (f16, or uint8 q8_0 bytes)."""
        if self.dtype == "f16":
            return np.ascontiguousarray(x, dtype=np.float16)
        return self.gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), self.qtype)

    def row_bytes(self, n_in: int) -> int:
        return 2 * n_in if self.dtype == "f16" else n_in // 32 * 34


class _Pool:
    """Plain matrices cut from one seeded pool of N(0, 1) values, encoded once per scale.

    Drawing and quantizing hundreds of millions of values takes minutes; slicing a pool
    takes nothing. Each matrix starts at its own seeded offset (whole q8_0 blocks).
    """

    def __init__(self, rng: np.random.Generator, q: _Q, n: int) -> None:
        self.rng, self.q, self.n = rng, q, n
        self.base = rng.standard_normal(n, dtype=np.float32)
        # q8_0: quantized once; a scale only multiplies each block's f16 scale
        self.blocks = q.encode(self.base.reshape(-1, 32)).reshape(-1, 34) if q.dtype == "q8_0" else None
        self.scaled: Dict[float, np.ndarray] = {}

    def _encoded(self, std: float) -> np.ndarray:
        enc = self.scaled.get(std)
        if enc is None:
            if self.blocks is None:
                enc = (self.base * np.float32(std)).astype(np.float16)
            else:
                blocks = self.blocks.copy()
                d = blocks[:, :2].copy().view(np.float16)
                blocks[:, :2] = (d.astype(np.float32) * np.float32(std)).astype(np.float16).view(np.uint8)
                enc = blocks.reshape(-1)  # 34-byte q8_0 blocks end to end
            enc = np.concatenate([enc, enc])  # any window of up to n values is contiguous
            self.scaled[std] = enc
        return enc

    def matrix(self, n_out: int, n_in: int, std: float) -> np.ndarray:
        enc = self._encoded(std)
        n = n_out * n_in
        if n > self.n:
            reps = -(-n // self.n)
            whole = np.concatenate([enc[: len(enc) // 2]] * reps)
            enc, off = whole, 0
        else:
            off = int(self.rng.integers(0, self.n // 32)) * 32
        if self.q.dtype == "f16":
            return enc[off: off + n].reshape(n_out, n_in)
        b = off // 32 * 34
        return enc[b: b + n // 32 * 34].reshape(n_out, n_in // 32 * 34)


#: Up to this width the embedding basis is one QR of a Gaussian matrix (the bench shapes' bytes,
#: unchanged: the version stays); wider, blocks of :data:`_RS_BASIS_BLOCK` (a 5120-wide QR took
#: 78 s of a 118 s write on 2 cores; the GPU kit's real-shape step writes 5120-wide models).
_RS_FULL_QR_MAX = 2048
_RS_BASIS_BLOCK = 256


def _orthonormal_rows(rng: np.random.Generator, E: int) -> np.ndarray:
    """``E`` orthonormal rows of width ``E`` (float32), drawn from ``rng``: the Q of one QR up to
    :data:`_RS_FULL_QR_MAX`; wider, a block-diagonal of ``E / 256`` such Qs with its rows and
    columns permuted at random (as orthonormal, at a fraction of the cost)."""
    if E <= _RS_FULL_QR_MAX:  # (n_embd is a multiple of 256)
        q, _ = np.linalg.qr(rng.standard_normal((E, E)))
        return q.T.astype(np.float32)
    n = _RS_BASIS_BLOCK
    out = np.zeros((E, E), dtype=np.float32)
    for i in range(0, E, n):
        q, _ = np.linalg.qr(rng.standard_normal((n, n)))
        out[i:i + n, i:i + n] = q.T
    return np.ascontiguousarray(out[rng.permutation(E)][:, rng.permutation(E)])


def _mtp_model_args(n_vocab: int, n_embd: int, n_layer: int, n_ff: int, agreement: float,
                    dtype: str, seed: int) -> Dict[str, object]:
    a = _check_agreement(agreement)
    if dtype not in MTP_MODEL_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(MTP_MODEL_DTYPES)}, got {dtype!r}")
    for name, v in (("n_vocab", n_vocab), ("n_embd", n_embd), ("n_layer", n_layer), ("n_ff", n_ff)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if n_embd % (2 * _RS_HEAD_DIM):
        raise ValueError(f"n_embd must be a multiple of {2 * _RS_HEAD_DIM}, got {n_embd}")
    n_head = n_embd // _RS_HEAD_DIM
    if n_head % max(1, n_head // 4):  # grouped-query attention: whole groups (llama.cpp aborts)
        raise ValueError(f"n_embd={n_embd} gives {n_head} query heads and {max(1, n_head // 4)} KV heads, "
                         "not whole groups: take a multiple of 512 (or 256, 768, 1280)")
    if n_ff % 32:
        raise ValueError(f"n_ff must be a multiple of 32 (q8_0 blocks), got {n_ff}")
    if n_layer % _RS_FULL_ATTN_INTERVAL:
        raise ValueError(f"n_layer must be a multiple of {_RS_FULL_ATTN_INTERVAL} (three gated "
                         f"delta net layers, then a full-attention one), got {n_layer}")
    if n_vocab < 2:
        raise ValueError(f"n_vocab must be at least 2, got {n_vocab}")
    return dict(n_vocab=n_vocab, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, agreement=a,
                dtype=dtype, seed=int(seed), version=_MTP_MODEL_VERSION)


def mtp_model_path(**kwargs: object) -> Path:
    """Where :func:`make_mtp_model` caches a model with these arguments (``path=None``):
    ``<cache root>/models/qwen35-mtp-<shape>-<hash of the arguments>.gguf``."""
    import hashlib
    import json

    from ..paths import cache_root

    args = _mtp_model_args(**{**BENCH_SHAPE, "agreement": 1.0, "dtype": "f16", "seed": 0, **kwargs})
    digest = hashlib.sha256(json.dumps(args, sort_keys=True).encode()).hexdigest()[:16]
    name = (f"qwen35-mtp-v{args['n_vocab']}-e{args['n_embd']}-l{args['n_layer']}-f{args['n_ff']}"
            f"-a{args['agreement']:g}-{args['dtype']}-{digest}.gguf")
    return cache_root() / "models" / name


def make_mtp_model(
    path: Optional[PathLike] = None,
    *,
    n_vocab: int = BENCH_SHAPE["n_vocab"],
    n_embd: int = BENCH_SHAPE["n_embd"],
    n_layer: int = BENCH_SHAPE["n_layer"],
    n_ff: int = BENCH_SHAPE["n_ff"],
    agreement: float,
    dtype: str = "f16",
    seed: int = 0,
) -> Path:
    """Write a ``qwen35`` MTP model at real proportions whose MTP head agrees with the target's
    greedy continuation at rate ``agreement``; return its path.

    Shape: ``n_layer`` trunk layers (a multiple of 4: three gated-delta-net layers, then one
    full-attention layer, as in Qwen3.5) plus one NextN block (``block_count = n_layer + 1``);
    heads of 128 (``n_embd / 128`` query heads, a quarter of that for K/V, at least 1), a
    gated delta net with state 128, ``n_embd / 256`` key heads and ``n_embd / 128`` value
    heads; ``n_ff`` the FFN width; the TEST tokenizer with ``n_vocab`` tokens (Qwen's
    151,936 by default; the last one is the end of generation). The defaults are
    :data:`BENCH_SHAPE`. Matrices are ``dtype`` (``"f16"`` or ``"q8_0"``, quantized by gguf-py),
    norms and the small recurrent tensors f32.

    Agreement, as :func:`make_tiny_mtp_model` builds it, generalized to ``n_vocab > n_embd``:
    a seeded successor cycle over ``K = min(n_vocab - 1, n_embd // 2)`` tokens with orthogonal
    embeddings (norm ``sqrt(n_embd)``); every other token has an embedding outside the cycle's
    span (``0.8 u + 0.6 b``, ``u`` one direction shared by all of them, ``b`` one of a few
    others) and an output row that no cycle token's state reaches, so it is in every matrix
    but never chosen; after any token off the cycle both the target and the MTP head choose
    the cycle's first token (its output row also answers to ``u``). The residual writes of
    every layer are tiny (std 1e-3), so the target's last state is its current token's
    embedding, and ``output`` maps the embedding of ``t`` to ``succ(t)`` with a logit margin
    of :func:`mtp_model_logit_margin` (softmax peak ~0.994 at any vocabulary size). The NextN block's ``eh_proj`` maps the embedding of ``t`` to that of
    ``pi(t)`` (``t`` where the head agrees, ``succ(t)`` where it does not) and ignores the
    hidden half; agreeing positions follow the tiny model's low-discrepancy pattern along the
    cycle, so any 64 consecutive steps agree at ``agreement`` within +-2/64.
    :func:`mtp_model_plan` gives the tables. The plain matrices (attention, gated delta net,
    FFN) are windows of one seeded pool of Gaussians scaled by ``1/sqrt(fan_in)`` (q8_0: the
    pool is quantized once), so the default file is written in under a minute on 2 cores.

    Cached by its arguments: ``path=None`` writes to :func:`mtp_model_path`; a file whose
    ``<file>.args.json`` records the same arguments is returned at once, unwritten. The same
    arguments give the same bytes.
    """
    import json

    args = _mtp_model_args(n_vocab, n_embd, n_layer, n_ff, agreement, dtype, seed)
    path = Path(path) if path is not None else mtp_model_path(**{k: v for k, v in args.items() if k != "version"})
    stamp = path.with_name(path.name + ".args.json")
    if path.is_file() and stamp.is_file():
        try:
            rec = json.loads(stamp.read_text())
        except ValueError:
            rec = None
        if rec and rec.get("args") == args and rec.get("size") == path.stat().st_size:
            return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        _write_mtp_model(tmp, args)
        os.replace(tmp, path)
    except BaseException:
        if tmp.exists():
            tmp.unlink()
        raise
    stamp.write_text(json.dumps({"args": args, "size": path.stat().st_size}, indent=2) + "\n")
    return path


def _write_mtp_model(path: Path, args: Dict[str, object]) -> None:
    import gguf

    V, E, L, F = (int(args[k]) for k in ("n_vocab", "n_embd", "n_layer", "n_ff"))
    a, seed = float(args["agreement"]), int(args["seed"])  # type: ignore[arg-type]
    q = _Q(str(args["dtype"]))
    rng = np.random.default_rng(seed)
    plan = _mtp_model_plan(rng, a, V, E)
    K = len(plan["cycle"])
    cycle, pi = plan["cycle"], plan["pi"]
    eos = int(plan["eos"])

    hd = _RS_HEAD_DIM
    n_head = E // hd
    n_head_kv = max(1, n_head // 4)
    n_k_heads, n_v_heads = E // (2 * hd), E // hd  # gated delta net: key and value heads
    inner = hd * n_v_heads
    conv_dim = 2 * hd * n_k_heads + inner

    # the embedding geometry: an orthonormal basis; the cycle takes the first K directions,
    # u the next one, the rest ("b") the tokens off the cycle
    basis = _orthonormal_rows(rng, E)
    e_cycle, u, b = basis[:K], basis[K], basis[K + 1:]
    off = np.ones(V, dtype=bool)
    off[cycle] = False
    off_ids = np.flatnonzero(off)
    n_b = len(b)
    sq = np.float32(np.sqrt(E))
    scale = np.float32(mtp_model_logit_margin(V) / np.sqrt(E))

    # token_embd: distinct rows (cycle rows, then one per direction b), then one per token
    emb_rows = np.vstack([sq * e_cycle, sq * (_RS_ALPHA * u + _RS_BETA * b)]) if n_b else sq * e_cycle
    emb_idx = np.empty(V, dtype=np.int64)
    emb_idx[cycle] = np.arange(K)
    if n_b:
        emb_idx[off_ids] = K + rng.integers(0, n_b, len(off_ids))
    else:  # no direction left for b: the tokens off the cycle share u
        emb_rows = np.vstack([emb_rows, sq * u])
        emb_idx[off_ids] = K
    # output: row succ(t) = scale * e_t on the cycle (the cycle's first token also answers
    # to u); off the cycle small rows along b (never reached from a cycle state); EOS zero
    out_distinct = np.zeros((K + n_b + 1, E), dtype=np.float32)  # + 1: the zero row
    pos_on_cycle = np.empty(V, dtype=np.int64)
    pos_on_cycle[cycle] = np.arange(K)
    prev = np.roll(cycle, 1)  # prev[k] is the token whose successor is cycle[k]
    out_distinct[:K] = scale * e_cycle[pos_on_cycle[prev]]
    out_distinct[0] += scale * u
    if n_b:
        out_distinct[K:K + n_b] = np.float32(_RS_NONCYCLE_OUT) * scale * b
    out_idx = np.full(V, K + n_b, dtype=np.int64)  # zero row
    out_idx[cycle] = np.arange(K)
    others = off_ids[off_ids != eos]
    if n_b and len(others):
        out_idx[others] = K + rng.integers(0, n_b, len(others))
    # eh_proj = [M | 0], M e_t = e_pi(t) on the cycle and M u = u
    m = e_cycle[pos_on_cycle[pi[cycle]]].T @ e_cycle + np.outer(u, u)
    eh_proj = np.zeros((E, 2 * E), dtype=np.float32)
    eh_proj[:, :E] = m

    largest = max(conv_dim * E, F * E, 2 * n_head * hd * E)  # no matrix repeats within itself
    pool = _Pool(rng, q, int(min(_RS_POOL, 1 << int(np.ceil(np.log2(largest))))))
    specs: List[Tuple[str, Tuple[int, ...], object]] = []  # (name, numpy shape, maker)

    def mat(name: str, n_out: int, n_in: int, std: Optional[float] = None) -> None:
        s = float(1.0 / np.sqrt(n_in)) if std is None else std
        specs.append((name, (n_out, n_in), lambda: pool.matrix(n_out, n_in, s)))

    def f32(name: str, value_fn) -> None:
        specs.append((name, None, value_fn))  # type: ignore[arg-type]

    def ones(name: str, n: int) -> None:
        f32(name, lambda: np.ones((n,), dtype=np.float32))

    def designed(name: str, rows: np.ndarray, idx: Optional[np.ndarray]) -> None:
        def make() -> np.ndarray:
            enc = q.encode(rows)
            return enc if idx is None else enc[idx]
        n_out = len(rows) if idx is None else len(idx)
        specs.append((name, (n_out, rows.shape[1]), make))

    small = _SMALL_OUT_STD

    def attn(p: str) -> None:
        mat(p + "attn_q.weight", 2 * n_head * hd, E)
        mat(p + "attn_k.weight", n_head_kv * hd, E)
        mat(p + "attn_v.weight", n_head_kv * hd, E)
        mat(p + "attn_output.weight", E, n_head * hd, small)
        ones(p + "attn_q_norm.weight", hd)
        ones(p + "attn_k_norm.weight", hd)

    def ffn(p: str) -> None:
        mat(p + "ffn_gate.weight", F, E)
        mat(p + "ffn_up.weight", F, E)
        mat(p + "ffn_down.weight", E, F, small)

    def small_f32(shape: Tuple[int, ...], fn) -> object:
        return lambda: np.ascontiguousarray(fn(shape), dtype=np.float32)

    designed("token_embd.weight", emb_rows, emb_idx)
    ones("output_norm.weight", E)
    designed("output.weight", out_distinct, out_idx)
    for il in range(L + 1):
        p = f"blk.{il}."
        ones(p + "attn_norm.weight", E)
        ones(p + "post_attention_norm.weight", E)
        if il < L and (il + 1) % _RS_FULL_ATTN_INTERVAL != 0:
            mat(p + "attn_qkv.weight", conv_dim, E)
            mat(p + "attn_gate.weight", inner, E)
            f32(p + "ssm_conv1d.weight", small_f32((conv_dim, _SSM_CONV), lambda s: 0.5 * rng.standard_normal(s)))
            f32(p + "ssm_dt.bias", small_f32((n_v_heads,), lambda s: rng.uniform(-1.0, 1.0, s)))
            f32(p + "ssm_a", small_f32((n_v_heads,), lambda s: -np.exp(rng.uniform(-1.0, 1.0, s))))
            f32(p + "ssm_beta.weight", small_f32((n_v_heads, E), lambda s: rng.standard_normal(s) / np.sqrt(E)))
            f32(p + "ssm_alpha.weight", small_f32((n_v_heads, E), lambda s: rng.standard_normal(s) / np.sqrt(E)))
            ones(p + "ssm_norm.weight", hd)
            mat(p + "ssm_out.weight", E, inner, small)
        else:
            attn(p)
        ffn(p)
        if il == L:
            designed(p + "nextn.eh_proj.weight", eh_proj, None)
            ones(p + "nextn.enorm.weight", E)
            ones(p + "nextn.hnorm.weight", E)

    kv: Dict[str, object] = {
        "context_length": _RS_CTX,
        "embedding_length": E,
        "block_count": L + 1,
        "nextn_predict_layers": 1,
        "feed_forward_length": F,
        "attention.head_count": n_head,
        "attention.head_count_kv": n_head_kv,
        "attention.key_length": hd,
        "attention.value_length": hd,
        "attention.layer_norm_rms_epsilon": _RMS_EPS,
        "rope.freq_base": 10000.0,
        "rope.dimension_sections": [hd // 4] * 4,
        "full_attention_interval": _RS_FULL_ATTN_INTERVAL,
        "ssm.conv_kernel": _SSM_CONV,
        "ssm.inner_size": inner,
        "ssm.state_size": hd,
        "ssm.time_step_rank": n_v_heads,
        "ssm.group_count": n_k_heads,
    }

    # the file: metadata and tensor infos first, then each tensor made, written and dropped
    writer = gguf.GGUFWriter(str(path), "qwen35")
    try:
        writer.add_name(f"qwen35-mtp-e{E}-l{L}")
        add_metadata(writer, "qwen35", kv)
        writer.add_tokenizer_model("test")
        writer.add_token_list(_token_texts(V))
        writer.add_token_scores([0.0] * V)
        writer.add_token_types([int(gguf.TokenType.NORMAL)] * V)
        writer.add_add_bos_token(False)
        writer.add_add_eos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
        writer.add_eos_token_id(eos)

        shapes = {}
        for name, shape, make in specs:
            if shape is None:  # f32: small, made now
                arr = make()
                shapes[name] = arr
                writer.add_tensor_info(name, arr.shape, np.dtype(np.float32), arr.nbytes)
            else:
                n_out, n_in = shape
                nbytes = n_out * q.row_bytes(n_in)
                if q.dtype == "f16":
                    writer.add_tensor_info(name, shape, np.dtype(np.float16), nbytes)
                else:
                    writer.add_tensor_info(name, (n_out, q.row_bytes(n_in)), np.dtype(np.uint8), nbytes,
                                           raw_dtype=q.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name, shape, make in specs:
            arr = shapes.pop(name) if shape is None else make()
            writer.write_tensor_data(np.ascontiguousarray(arr))
    finally:
        writer.close()
