"""The tiny GGUF models of ``llama_metaws_dev.testing``, checked with the binding's low-level API."""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np
import pytest

import llama_metaws  # noqa: F401  (sets LLAMA_CPP_LIB_PATH: must come before llama_cpp)
import llama_cpp.llama_cpp as ll
import llama_cpp.llama_cpp_ext as llx

from llama_metaws.native.params import set_fields
from llama_metaws_dev.testing import (
    N_EMBD,
    N_VOCAB,
    SUPPORTED_ARCHS,
    make_tiny_model,
    make_tiny_mtp_model,
    mtp_agreement_plan,
)

N_CTX = 256
N_THREADS = 1  # tiny graphs: a second thread only spins, and stalls when the cores are busy
MAX_BYTES = 10 * 1024 * 1024
MAX_SECONDS = 2.0

PROMPT = [5, 17, 42, 99]
N_STEPS = 64


@pytest.fixture(scope="module", autouse=True)
def _backend() -> None:
    ll.llama_backend_init()


# --------------------------------------------------------------------------------------------
# low-level helpers


class Model:
    """A model and its contexts, freed in reverse order."""

    def __init__(self, path: Path, *, load_mtp: bool = False) -> None:
        mp = ll.llama_model_default_params()
        set_fields(mp, dict(n_gpu_layers=0, load_mtp=load_mtp))
        self.model = ll.llama_model_load_from_file(str(path).encode(), mp)
        assert self.model, f"failed to load {path}"
        self.n_embd = ll.llama_model_n_embd(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.contexts: List[ll.llama_context_p] = []

    def context(self, *, mtp: bool = False, n_rs_seq: int = 0) -> ll.llama_context_p:
        cp = ll.llama_context_default_params()
        set_fields(cp, dict(n_ctx=N_CTX, n_batch=N_CTX, n_ubatch=N_CTX, n_seq_max=1, n_threads=N_THREADS,
                            n_threads_batch=N_THREADS, n_rs_seq=n_rs_seq,
                            ctx_type=ll.LLAMA_CONTEXT_TYPE_MTP if mtp else ll.LLAMA_CONTEXT_TYPE_DEFAULT))
        ctx = ll.llama_init_from_model(self.model, cp)
        assert ctx, "failed to create a context"
        self.contexts.append(ctx)
        return ctx

    def close(self) -> None:
        for ctx in reversed(self.contexts):
            ll.llama_free(ctx)
        self.contexts.clear()
        if self.model:
            ll.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def decode(
    ctx: ll.llama_context_p,
    tokens: Sequence[int],
    pos0: int,
    *,
    logits_all: bool = False,
    embd_rows: Optional[np.ndarray] = None,
) -> None:
    """Decode ``tokens`` at positions ``pos0..`` in sequence 0 with ``llama_decode``.

    With ``embd_rows`` (shape ``(len(tokens), n_embd)``) the batch carries both ``token`` and
    ``embd``, the pairing an MTP draft context takes: token ``x_p`` with the target's hidden
    row of position ``p - 1``. The last token always asks for logits.
    """
    n = len(tokens)
    batch = ll.llama_batch_init(n, 0, 1)
    embd_buf = None
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
            assert rows.shape == (n, N_EMBD)
            embd_buf = (ctypes.c_float * rows.size).from_buffer_copy(rows.tobytes())
            batch.embd = ctypes.cast(embd_buf, ctypes.POINTER(ctypes.c_float))
        rc = ll.llama_decode(ctx, batch)
        assert rc == 0, f"llama_decode returned {rc}"
    finally:
        # embd belongs to Python: keep llama_batch_free away from it
        batch.embd = ctypes.cast(None, ctypes.POINTER(ctypes.c_float))
        ll.llama_batch_free(batch)


def logits(ctx: ll.llama_context_p, i: int, n_vocab: int = N_VOCAB) -> np.ndarray:
    ptr = ll.llama_get_logits_ith(ctx, i)
    assert ptr, "no logits"
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,)).copy()


def hidden(ctx: ll.llama_context_p, i: int, n_embd: int = N_EMBD) -> np.ndarray:
    ptr = llx.llama_get_embeddings_nextn_ith(ctx, i)
    assert ptr, "no nextn embeddings"
    return np.ctypeslib.as_array(ptr, shape=(n_embd,)).copy()


def measure_mtp_agreement(
    m: Model, prompt: Sequence[int], n_steps: int
) -> Tuple[float, List[int], List[int]]:
    """Run the target greedily ``n_steps`` steps, drafting each next token with the MTP head.

    Returns (agreement rate, the draft's argmax at each step, the target's argmax at each
    step). At step n the target has just chosen ``x`` (position n) from the logits of
    position n-1; the draft gets ``(x, h_{n-1})`` at position n and its argmax is compared
    with the target's argmax after decoding ``x``.
    """
    tgt = m.context(n_rs_seq=1)
    dft = m.context(mtp=True)
    llx.llama_set_embeddings_nextn(tgt, True, False)  # unmasked: one hidden row per token

    k = len(prompt)
    decode(tgt, prompt, 0, logits_all=True)
    h = np.stack([hidden(tgt, i) for i in range(k)])
    x = int(np.argmax(logits(tgt, k - 1)))
    h_prev = h[k - 1]

    # draft catch-up over the prompt: token p_i paired with h_{i-1} (zeros before the start)
    shifted = np.vstack([np.zeros((1, N_EMBD), dtype=np.float32), h[:-1]])
    decode(dft, prompt, 0, embd_rows=shifted)

    drafts: List[int] = []
    targets: List[int] = []
    pos = k
    for _ in range(n_steps):
        decode(dft, [x], pos, embd_rows=h_prev[None, :])
        d = logits(dft, 0)
        assert np.all(np.isfinite(d))
        drafts.append(int(np.argmax(d)))

        decode(tgt, [x], pos)
        y = int(np.argmax(logits(tgt, 0)))
        targets.append(y)
        h_prev = hidden(tgt, 0)
        x = y
        pos += 1

    agree = sum(int(a == b) for a, b in zip(drafts, targets))
    return agree / n_steps, drafts, targets


# --------------------------------------------------------------------------------------------
# the files


MAKERS = [
    pytest.param(lambda p, s: make_tiny_mtp_model(p, seed=s), id="mtp-random"),
    pytest.param(lambda p, s: make_tiny_mtp_model(p, seed=s, agreement=0.5), id="mtp-agree-0.5"),
] + [
    pytest.param(lambda p, s, a=a: make_tiny_model(p, arch=a, seed=s), id=f"plain-{a}")
    for a in SUPPORTED_ARCHS
]


@pytest.mark.parametrize("make", MAKERS)
def test_files_are_small_fast_and_deterministic(tmp_path: Path, make) -> None:
    # CPU time, not wall time: a busy machine (a native build running) must not fail this
    t0 = time.process_time()
    a = make(tmp_path / "a.gguf", 3)
    elapsed = time.process_time() - t0
    b = make(tmp_path / "b.gguf", 3)
    c = make(tmp_path / "c.gguf", 4)
    assert elapsed < MAX_SECONDS
    assert a.stat().st_size < MAX_BYTES
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()


def test_unsupported_arch_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llama"):
        make_tiny_model(tmp_path / "x.gguf", arch="nope")
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_agreement_out_of_range_is_a_value_error(tmp_path: Path, bad: float) -> None:
    with pytest.raises(ValueError):
        make_tiny_mtp_model(tmp_path / "x.gguf", agreement=bad)


# --------------------------------------------------------------------------------------------
# loading and decoding


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_plain_model_decodes_to_finite_logits(tmp_path: Path, arch: str) -> None:
    path = make_tiny_model(tmp_path / f"{arch}.gguf", arch=arch, seed=1)
    with Model(path) as m:
        assert (m.n_embd, m.n_vocab) == (N_EMBD, N_VOCAB)
        ctx = m.context()
        decode(ctx, PROMPT, 0)
        out = logits(ctx, len(PROMPT) - 1)
        assert np.all(np.isfinite(out)) and out.std() > 1e-3
        nxt = int(np.argmax(out))
        decode(ctx, [nxt], len(PROMPT))
        assert np.all(np.isfinite(logits(ctx, 0)))


def test_mtp_model_target_and_draft_decode(tmp_path: Path) -> None:
    path = make_tiny_mtp_model(tmp_path / "mtp.gguf", seed=1)
    with Model(path, load_mtp=True) as m:
        tgt = m.context(n_rs_seq=1)
        dft = m.context(mtp=True)
        llx.llama_set_embeddings_nextn(tgt, True, False)

        decode(tgt, PROMPT, 0, logits_all=True)
        for i in range(len(PROMPT)):
            out = logits(tgt, i)
            assert np.all(np.isfinite(out)) and out.std() > 1e-3
        h = np.stack([hidden(tgt, i) for i in range(len(PROMPT))])
        assert np.all(np.isfinite(h)) and np.abs(h).max() > 0

        # the draft takes token p_i with the target's hidden row of position i-1
        rows = np.vstack([np.zeros((1, N_EMBD), dtype=np.float32), h[:-1]])
        decode(dft, PROMPT, 0, embd_rows=rows)
        out = logits(dft, len(PROMPT) - 1)
        assert np.all(np.isfinite(out)) and out.std() > 1e-3

        x = int(np.argmax(logits(tgt, len(PROMPT) - 1)))
        decode(dft, [x], len(PROMPT), embd_rows=h[-1:])
        assert np.all(np.isfinite(logits(dft, 0)))


def test_mtp_model_loads_without_mtp(tmp_path: Path) -> None:
    path = make_tiny_mtp_model(tmp_path / "mtp.gguf", seed=2)
    with Model(path, load_mtp=False) as m:
        ctx = m.context()
        decode(ctx, PROMPT, 0)
        assert np.all(np.isfinite(logits(ctx, len(PROMPT) - 1)))


# --------------------------------------------------------------------------------------------
# the agreement design


@pytest.mark.parametrize("agreement", [0.0, 0.5, 1.0])
def test_mtp_head_agrees_at_the_chosen_rate(tmp_path: Path, agreement: float) -> None:
    seed = 7
    path = make_tiny_mtp_model(tmp_path / "agree.gguf", seed=seed, agreement=agreement)
    plan = mtp_agreement_plan(agreement, seed=seed)
    with Model(path, load_mtp=True) as m:
        rate, drafts, targets = measure_mtp_agreement(m, PROMPT, N_STEPS)

    # the target walks the successor cycle and the draft follows the plan token by token
    chosen = [int(plan["succ"][PROMPT[-1]])] + targets[:-1]
    assert targets == [int(plan["succ"][t]) for t in chosen]
    assert drafts == [int(plan["draft"][t]) for t in chosen]
    assert abs(rate - agreement) <= 0.1, f"agreement {rate:.4f}, wanted {agreement}"
    assert abs(rate - agreement) <= 2 / N_STEPS + 1e-9
