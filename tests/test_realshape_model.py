"""``make_mtp_model``: a qwen35 MTP model at real proportions (n_vocab > n_embd), checked with
the binding's low-level API: the MTP head's argmax against the target's greedy next token."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np
import pytest

import llama_metaws  # noqa: F401  (sets LLAMA_CPP_LIB_PATH: must come before llama_cpp)
import llama_cpp.llama_cpp as ll
import llama_cpp.llama_cpp_ext as llx

from llama_metaws.native.params import set_fields
from llama_metaws_dev.testing import (
    BENCH_SHAPE,
    make_mtp_model,
    mtp_model_cycle_len,
    mtp_model_path,
    mtp_model_plan,
)

# small-ish, but a vocabulary larger than the width, as at real scale
SHAPE = dict(n_vocab=4096, n_embd=256, n_layer=4, n_ff=512)
N_CTX = 256
N_STEPS = 64
PROMPT = [5, 4000, 17, 3001, 42]  # tokens off the cycle and (perhaps) on it


@pytest.fixture(scope="module", autouse=True)
def _backend() -> None:
    ll.llama_backend_init()


def _decode(ctx, tokens: Sequence[int], pos0: int, n_embd: int, embd_rows=None, logits_all=False) -> None:
    n = len(tokens)
    batch = ll.llama_batch_init(n, 0, 1)
    buf = None
    try:
        for i, tok in enumerate(tokens):
            batch.token[i] = int(tok)
            batch.pos[i] = pos0 + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if (logits_all or i == n - 1) else 0
        batch.n_tokens = n
        if embd_rows is not None:
            rows = np.ascontiguousarray(embd_rows, dtype=np.float32)
            assert rows.shape == (n, n_embd)
            buf = (ctypes.c_float * rows.size).from_buffer_copy(rows.tobytes())
            batch.embd = ctypes.cast(buf, ctypes.POINTER(ctypes.c_float))
        assert ll.llama_decode(ctx, batch) == 0
    finally:
        batch.embd = ctypes.cast(None, ctypes.POINTER(ctypes.c_float))
        ll.llama_batch_free(batch)


def _argmax(ctx, i: int, n_vocab: int) -> int:
    ptr = ll.llama_get_logits_ith(ctx, i)
    assert ptr
    row = np.ctypeslib.as_array(ptr, shape=(n_vocab,))
    assert np.all(np.isfinite(row))
    return int(np.argmax(row))


def _hidden(ctx, i: int, n_embd: int) -> np.ndarray:
    ptr = llx.llama_get_embeddings_nextn_ith(ctx, i)
    assert ptr
    return np.ctypeslib.as_array(ptr, shape=(n_embd,)).copy()


def measure(path: Path, prompt: Sequence[int], n_steps: int) -> Tuple[float, List[int], List[int], int]:
    """Target greedy for ``n_steps``; at each step the MTP head drafts from (token, previous
    hidden row). Returns (agreement, drafts, targets, the target's choice after the prompt)."""
    mp = ll.llama_model_default_params()
    set_fields(mp, dict(n_gpu_layers=0, load_mtp=True))
    model = ll.llama_model_load_from_file(str(path).encode(), mp)
    assert model
    ctxs = []
    try:
        n_embd = ll.llama_model_n_embd(model)
        n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))

        def context(mtp: bool):
            cp = ll.llama_context_default_params()
            set_fields(cp, dict(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_seq_max=1, n_threads=2,
                                n_threads_batch=2, n_rs_seq=0 if mtp else 1,
                                ctx_type=ll.LLAMA_CONTEXT_TYPE_MTP if mtp else ll.LLAMA_CONTEXT_TYPE_DEFAULT))
            ctx = ll.llama_init_from_model(model, cp)
            assert ctx
            ctxs.append(ctx)
            return ctx

        tgt, dft = context(False), context(True)
        llx.llama_set_embeddings_nextn(tgt, True, False)
        k = len(prompt)
        _decode(tgt, prompt, 0, n_embd, logits_all=True)
        h = np.stack([_hidden(tgt, i, n_embd) for i in range(k)])
        x = _argmax(tgt, k - 1, n_vocab)
        first = x
        shifted = np.vstack([np.zeros((1, n_embd), dtype=np.float32), h[:-1]])
        _decode(dft, prompt, 0, n_embd, embd_rows=shifted)
        h_prev = h[k - 1]
        drafts, targets = [], []
        for pos in range(k, k + n_steps):
            _decode(dft, [x], pos, n_embd, embd_rows=h_prev[None, :])
            drafts.append(_argmax(dft, 0, n_vocab))
            _decode(tgt, [x], pos, n_embd)
            x = _argmax(tgt, 0, n_vocab)
            targets.append(x)
            h_prev = _hidden(tgt, 0, n_embd)
        rate = sum(int(a == b) for a, b in zip(drafts, targets)) / n_steps
        return rate, drafts, targets, first
    finally:
        for ctx in reversed(ctxs):
            ll.llama_free(ctx)
        ll.llama_model_free(model)


@pytest.mark.parametrize("dtype", ["f16", "q8_0"])
@pytest.mark.parametrize("agreement", [0.0, 0.3, 0.5, 0.8, 1.0])
def test_the_mtp_head_agrees_at_the_requested_rate(tmp_path: Path, agreement: float, dtype: str) -> None:
    seed = 3
    path = make_mtp_model(tmp_path / "m.gguf", agreement=agreement, dtype=dtype, seed=seed, **SHAPE)
    rate, drafts, targets, first = measure(path, PROMPT, N_STEPS)
    assert abs(rate - agreement) <= 0.1, f"agreement {rate:.3f}, asked for {agreement}"

    # the target walks the cycle, never the rest of the vocabulary, and the head follows the plan
    plan = mtp_model_plan(agreement, n_vocab=SHAPE["n_vocab"], n_embd=SHAPE["n_embd"], seed=seed)
    on_cycle = set(plan["cycle"].tolist())
    assert first == int(plan["succ"][PROMPT[-1]])
    assert set(targets) <= on_cycle
    chosen = [first] + targets[:-1]
    assert targets == [int(plan["succ"][t]) for t in chosen]
    assert drafts == [int(plan["draft"][t]) for t in chosen]


def test_the_vocabulary_is_larger_than_the_cycle() -> None:
    assert SHAPE["n_vocab"] > SHAPE["n_embd"]
    assert mtp_model_cycle_len(SHAPE["n_vocab"], SHAPE["n_embd"]) == SHAPE["n_embd"] // 2
    assert mtp_model_cycle_len(100, 256) == 99


def test_the_cache_returns_the_same_file_without_rewriting(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LLAMA_METAWS_CACHE", str(tmp_path / "cache"))
    kw = dict(agreement=0.5, dtype="q8_0", **SHAPE)
    first = make_mtp_model(**kw)
    assert first == mtp_model_path(**kw)
    assert first.parent == tmp_path / "cache" / "models"
    st = first.stat()
    again = make_mtp_model(**kw)
    assert again == first
    st2 = again.stat()
    assert (st2.st_mtime_ns, st2.st_ino, st2.st_size) == (st.st_mtime_ns, st.st_ino, st.st_size)
    # other arguments, another file; the same arguments give the same bytes
    other = make_mtp_model(**dict(kw, agreement=0.8))
    assert other != first and other.is_file()
    rewritten = make_mtp_model(tmp_path / "copy.gguf", **kw)
    assert rewritten.read_bytes() == first.read_bytes()


def test_a_stale_cache_entry_is_rewritten(tmp_path: Path) -> None:
    p = make_mtp_model(tmp_path / "m.gguf", agreement=1.0, **SHAPE)
    good = p.read_bytes()
    with open(p, "r+b") as f:  # truncated: the recorded size no longer matches
        f.truncate(len(good) // 2)
    assert make_mtp_model(p, agreement=1.0, **SHAPE).read_bytes() == good


@pytest.mark.parametrize("bad", [dict(dtype="q4_0"), dict(n_embd=200), dict(n_layer=3), dict(n_ff=100),
                                 dict(agreement=1.5), dict(n_embd=2304)])  # 2304: 18 heads, 4 KV heads
def test_bad_arguments_are_value_errors(tmp_path: Path, bad: dict) -> None:
    kw = dict(SHAPE, agreement=0.5)
    kw.update(bad)
    with pytest.raises(ValueError):
        make_mtp_model(tmp_path / "x.gguf", **kw)
    assert not list(tmp_path.iterdir())


def test_the_default_is_the_bench_shape_at_qwens_vocabulary() -> None:
    p = mtp_model_path(agreement=0.5)
    assert f"v{BENCH_SHAPE['n_vocab']}-e{BENCH_SHAPE['n_embd']}-l{BENCH_SHAPE['n_layer']}" in p.name
    assert BENCH_SHAPE["n_vocab"] == 151936


def test_the_designed_token_has_the_tiny_models_peak_at_any_vocabulary() -> None:
    from llama_metaws_dev.testing import LOGIT_MARGIN, N_VOCAB, mtp_model_logit_margin

    for v in (N_VOCAB, 4096, 151936):
        m = mtp_model_logit_margin(v)
        peak = np.exp(m) / (np.exp(m) + v - 1)
        assert peak > 0.99, (v, peak)
    assert mtp_model_logit_margin(N_VOCAB) == LOGIT_MARGIN


def test_the_constants_shared_with_the_tiny_builders_agree() -> None:
    from llama_metaws.demo import model as tiny, realshape
    from llama_metaws_dev import testing

    assert (realshape.N_VOCAB, realshape.LOGIT_MARGIN) == (tiny.N_VOCAB, tiny.LOGIT_MARGIN)
    assert realshape.CHAT_TEMPLATE == tiny.CHAT_TEMPLATE
    assert (realshape._RMS_EPS, realshape._SSM_CONV, realshape._SMALL_OUT_STD) == (
        tiny._RMS_EPS, tiny._SSM_CONV, tiny._SMALL_OUT_STD)
    assert testing.make_mtp_model is realshape.make_mtp_model  # the tests' builders re-export the demo's


def test_the_embedding_basis_is_orthonormal_at_every_width_and_one_qr_up_to_2048() -> None:
    from llama_metaws.demo import realshape

    # the bench widths: the QR they always had, so their files' bytes did not change
    q, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((1024, 1024)))
    assert np.array_equal(realshape._orthonormal_rows(np.random.default_rng(0), 1024), q.T.astype(np.float32))
    # wider: blocks of 256 in shuffled rows and columns, as orthonormal
    wide = realshape._orthonormal_rows(np.random.default_rng(0), 3072)
    assert wide.shape == (3072, 3072) and wide.dtype == np.float32
    rows = np.arange(0, 3072, 7)
    assert np.abs(wide[rows] @ wide.T - np.eye(3072, dtype=np.float32)[rows]).max() < 1e-5
    assert ((wide != 0).sum(axis=1) == realshape._RS_BASIS_BLOCK).all()


def test_a_wide_model_on_the_block_basis_follows_its_plan(tmp_path: Path) -> None:
    """Wider than 2048 the basis is built from blocks: the design still holds, token for token."""
    shape = dict(n_vocab=2048, n_embd=3072, n_layer=4, n_ff=256)
    path = make_mtp_model(tmp_path / "wide.gguf", agreement=0.5, dtype="q8_0", seed=3, **shape)
    prompt = [5, 17, 42]
    _rate, drafts, targets, first = measure(path, prompt, 24)
    plan = mtp_model_plan(0.5, n_vocab=shape["n_vocab"], n_embd=shape["n_embd"], seed=3)
    chosen = [first] + targets[:-1]
    assert first == int(plan["succ"][prompt[-1]])
    assert targets == [int(plan["succ"][t]) for t in chosen]
    assert drafts == [int(plan["draft"][t]) for t in chosen]
    assert 0 < sum(plan["agree"][t] for t in chosen) < len(chosen)  # some agree, some do not
