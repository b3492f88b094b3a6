"""MTP speculative decoding (``llama_metaws.engine.mtp``) on the tiny qwen35 MTP models, on the CPU."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
import pytest

import llama_metaws  # noqa: F401  (points llama_cpp at the patched build: import it first)
import llama_cpp
import llama_cpp.llama_cpp_ext as llx

from llama_metaws.engine import contexts as loading
from llama_metaws.engine.mtp import DraftStats, MTPDrafter
from llama_metaws.testing import N_EMBD, N_VOCAB, make_tiny_mtp_model

N_CTX = 256
N_BATCH = 16  # n_batch = n_ubatch: the long prompt spans several batches
N_THREADS = 1  # tiny graphs: a second thread only spins, and stalls when the cores are busy
SEED = 0

SHORT_PROMPT = [5, 17, 42, 99]
LONG_PROMPT = [(7 * i + 3) % N_VOCAB for i in range(40)]  # > n_batch = n_ubatch = 16
ONE_TOKEN_PROMPT = [11]
# (prompt, n): several requests in a row on the same contexts
REQUESTS = [(SHORT_PROMPT, 24), (LONG_PROMPT, 20), (ONE_TOKEN_PROMPT, 9), (SHORT_PROMPT, 13)]


@pytest.fixture(scope="module", autouse=True)
def _backend() -> None:
    llama_cpp.llama_backend_init()


_PATHS: Dict[object, Path] = {}


def _model_path(tmp_path_factory, agreement) -> Path:
    if agreement not in _PATHS:
        name = "random" if agreement is None else f"agree-{agreement}"
        d = tmp_path_factory.mktemp(f"mtp-{name}")
        _PATHS[agreement] = make_tiny_mtp_model(d / f"{name}.gguf", seed=SEED, agreement=agreement)
    return _PATHS[agreement]


class Setup:
    """One model (loaded with its MTP block), a reference context and target/draft contexts."""

    def __init__(self, path: Path) -> None:
        self.model = loading.load_model(path, load_mtp=True)
        self.ref = self.context(n_batch=64)
        self.tgt = self.context(n_batch=N_BATCH, n_rs_seq=3)
        self.dft = self.context(n_batch=N_BATCH, mtp=True)
        self._expected: Dict[Tuple[Tuple[int, ...], int], List[int]] = {}

    def context(self, **kw):
        ctx = loading.new_context(self.model, n_ctx=N_CTX, **kw)
        llama_cpp.llama_set_n_threads(ctx.ctx, N_THREADS, N_THREADS)
        return ctx

    def expected(self, prompt: Sequence[int], n: int) -> List[int]:
        """Plain greedy decoding of the target alone (a context of its own, cleared each time)."""
        key = (tuple(prompt), n)
        if key not in self._expected:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ref.ctx), True)
            self._expected[key] = loading.greedy_tokens(self.ref, prompt, n)
        return self._expected[key]

    def close(self) -> None:
        for ctx in (self.dft, self.tgt, self.ref):
            ctx.close()
        self.model.close()


@pytest.fixture(scope="module", params=[None, 1.0, 0.0], ids=["random", "agree-1.0", "agree-0.0"])
def setup(request, tmp_path_factory):
    s = Setup(_model_path(tmp_path_factory, request.param))
    s.agreement = request.param
    yield s
    s.close()


# --------------------------------------------------------------------------------------------
# output and acceptance


@pytest.mark.parametrize("draft_max", [1, 3])
def test_greedy_output_is_the_targets_and_acceptance_follows_the_head(setup, draft_max) -> None:
    drafter = MTPDrafter(setup.tgt, setup.dft, draft_max=draft_max)
    try:
        per_call = DraftStats()
        for prompt, n in REQUESTS:
            seen: List[int] = []
            out = drafter.generate(prompt, n, on_token=seen.append)
            assert out == setup.expected(prompt, n), f"prompt of {len(prompt)} tokens"
            assert seen == out
            s = drafter.stats
            assert 1 <= s.steps <= n
            assert s.accepted <= s.drafted <= draft_max * s.steps
            # every step yields its accepted drafts plus the target's own token
            assert s.accepted + s.steps == n
            per_call.add(s)
        assert (drafter.total.drafted, drafter.total.accepted, drafter.total.steps) == (
            per_call.drafted,
            per_call.accepted,
            per_call.steps,
        )
        acceptance = drafter.total.acceptance
        print(f"agreement={setup.agreement} draft_max={draft_max}: "
              f"acceptance {acceptance:.3f} ({drafter.total})")
        if setup.agreement == 1.0:
            assert acceptance >= 0.9
        elif setup.agreement == 0.0:
            assert acceptance <= 0.1
    finally:
        drafter.close()


def test_p_min_one_drafts_nothing(setup) -> None:
    drafter = MTPDrafter(setup.tgt, setup.dft, draft_max=3, p_min=1.0)
    try:
        for prompt, n in REQUESTS[:2]:
            assert drafter.generate(prompt, n) == setup.expected(prompt, n)
            assert drafter.stats.drafted == 0 and drafter.stats.accepted == 0
            assert drafter.stats.steps == n
            assert drafter.stats.acceptance == 0.0
    finally:
        drafter.close()


def test_p_min_below_the_heads_confidence_changes_nothing(tmp_path_factory) -> None:
    # the agreement model's head puts ~0.994 on its choice: p_min=0.9 passes every draft
    s = Setup(_model_path(tmp_path_factory, 1.0))
    try:
        plain = MTPDrafter(s.tgt, s.dft, draft_max=3)
        out = plain.generate(SHORT_PROMPT, 20)
        stats = plain.stats
        plain.close()
        gated = MTPDrafter(s.tgt, s.dft, draft_max=3, p_min=0.9)
        assert gated.generate(SHORT_PROMPT, 20) == out == s.expected(SHORT_PROMPT, 20)
        assert gated.stats == stats and stats.acceptance == 1.0
        gated.close()
    finally:
        s.close()


def test_generate_zero_tokens_and_exact_lengths(setup) -> None:
    drafter = MTPDrafter(setup.tgt, setup.dft, draft_max=3)
    try:
        assert drafter.generate(SHORT_PROMPT, 0) == []
        assert drafter.stats == DraftStats()
        for n in (1, 2, 5):  # n smaller than a full step: drafts are cut to fit
            assert drafter.generate(SHORT_PROMPT, n) == setup.expected(SHORT_PROMPT, n)
        # the whole context: the last new token is never decoded, so n_ctx - len(prompt) + 1
        n = N_CTX - len(SHORT_PROMPT)
        out = drafter.generate(SHORT_PROMPT, n + 1)
        assert len(out) == n + 1 and out[:n] == setup.expected(SHORT_PROMPT, n)
    finally:
        drafter.close()


# --------------------------------------------------------------------------------------------
# the draft sees the right (token, hidden row) pairs


def _decode(ctx, tokens: Sequence[int], pos0: int, *, rows=None, outputs: bool) -> None:
    n = len(tokens)
    batch = llama_cpp.llama_batch_init(n, 0, 1)
    buf = None
    try:
        for i, tok in enumerate(tokens):
            batch.token[i] = int(tok)
            batch.pos[i] = pos0 + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1 if (outputs or i == n - 1) else 0
        batch.n_tokens = n
        if rows is not None:
            rows = np.ascontiguousarray(rows, dtype=np.float32)
            buf = (ctypes.c_float * rows.size).from_buffer_copy(rows.tobytes())
            batch.embd = ctypes.cast(buf, ctypes.POINTER(ctypes.c_float))
        assert llama_cpp.llama_decode(ctx.ctx, batch) == 0
    finally:
        batch.embd = ctypes.cast(None, ctypes.POINTER(ctypes.c_float))
        llama_cpp.llama_batch_free(batch)


def _argmax(ctx, i: int) -> int:
    return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx.ctx, i),
                                               shape=(N_VOCAB,))))


def _hidden(ctx, i: int) -> np.ndarray:
    ptr = llx.llama_get_embeddings_nextn_ith(ctx.ctx, i)
    return np.ctypeslib.as_array(ptr, shape=(N_EMBD,)).copy()


def _reference_drafts(
    s: Setup, sequence: Sequence[int], n_prompt: int, steps: Sequence[Tuple[int, List[int]]]
) -> List[Tuple[int, List[int]]]:
    """What the MTP head drafts at each recorded step, computed one token at a time on fresh
    contexts: the history pairs token x_p with the target's hidden row h_{p-1} (zeros for
    p = 0); a chain starts from (x_p0, h_{p0-1}) and goes on from each draft token and the
    head's own hidden row, one position further each time."""
    tgt = s.context(n_batch=64, n_rs_seq=1)
    dft = s.context(n_batch=64, mtp=True)
    want = {p: len(d) for p, d in steps}
    mem = llama_cpp.llama_get_memory(dft.ctx)
    try:
        llx.llama_set_embeddings_nextn(tgt.ctx, True, False)
        llx.llama_set_embeddings_nextn(dft.ctx, True, True)
        h_prev = np.zeros(N_EMBD, np.float32)
        out = []
        for p in range(len(sequence)):
            x = sequence[p]
            _decode(dft, [x], p, rows=h_prev[None, :], outputs=True)
            if p >= n_prompt - 1 and want.get(p):
                chain = [_argmax(dft, 0)]
                row = _hidden(dft, 0)
                while len(chain) < want[p]:
                    _decode(dft, [chain[-1]], p + len(chain), rows=row[None, :], outputs=True)
                    chain.append(_argmax(dft, 0))
                    row = _hidden(dft, 0)
                assert llama_cpp.llama_memory_seq_rm(mem, 0, p + 1, -1)
                out.append((p, chain))
            _decode(tgt, [x], p, outputs=True)
            h_prev = _hidden(tgt, 0)
        return out
    finally:
        dft.close()
        tgt.close()


@pytest.mark.parametrize("draft_max", [1, 3])
def test_drafts_are_the_heads_chain(tmp_path_factory, draft_max) -> None:
    # the random model's eh_proj reads the hidden half: a wrong row pairing, a wrong position
    # or a wrong chained row changes the drafts (most are rejected, so chains are long)
    s = Setup(_model_path(tmp_path_factory, None))
    try:
        drafter = MTPDrafter(s.tgt, s.dft, draft_max=draft_max)
        for prompt, n in REQUESTS[:2]:
            steps: List[Tuple[int, List[int]]] = []
            out = drafter.generate(prompt, n, on_draft=lambda p, d: steps.append((p, d)))
            assert sum(len(d) for _, d in steps) == drafter.stats.drafted > 0
            expected = _reference_drafts(s, list(prompt) + out[:-1], len(prompt), steps)
            assert [st for st in steps if st[1]] == expected
        drafter.close()
    finally:
        s.close()


# --------------------------------------------------------------------------------------------
# arguments and errors


def test_bad_arguments_are_value_errors(setup) -> None:
    tgt, dft = setup.tgt, setup.dft
    for kw in ({"draft_max": 0}, {"draft_max": -1}, {"draft_max": 1.5}, {"p_min": -0.1},
               {"p_min": 1.5}, {"p_min": float("nan")}, {"seq_id": -1}, {"seq_id": 1}):
        with pytest.raises(ValueError):
            MTPDrafter(tgt, dft, **kw)
    with pytest.raises(ValueError, match="MTP"):
        MTPDrafter(tgt, setup.ref)  # a default context as the draft
    with pytest.raises(ValueError):
        MTPDrafter(dft, dft)
    with pytest.raises(ValueError, match="n_rs_seq"):
        MTPDrafter(tgt, dft, draft_max=4)  # the target rolls back at most 3 tokens
    with pytest.raises(ValueError, match="n_batch"):
        MTPDrafter(setup.ref, dft, draft_max=N_BATCH)  # the verify batch outgrows the draft's

    drafter = MTPDrafter(tgt, dft)
    try:
        with pytest.raises(ValueError):
            drafter.generate([], 4)
        with pytest.raises(ValueError):
            drafter.generate(SHORT_PROMPT, -1)
        with pytest.raises(ValueError):
            drafter.generate([N_VOCAB], 4)
        with pytest.raises(ValueError, match="n_ctx"):
            drafter.generate(SHORT_PROMPT, N_CTX)
        # the contexts still work after the refusals
        assert drafter.generate(SHORT_PROMPT, 6) == setup.expected(SHORT_PROMPT, 6)
    finally:
        drafter.close()


def test_decode_errors_name_the_context_and_phase(setup, monkeypatch) -> None:
    drafter = MTPDrafter(setup.tgt, setup.dft, draft_max=2)
    real = llama_cpp.llama_decode
    try:
        monkeypatch.setattr(llama_cpp, "llama_decode", lambda ctx, batch: 1)
        with pytest.raises(RuntimeError, match=r"target context returned 1 during prompt"):
            drafter.generate(SHORT_PROMPT, 4)

        def draft_fails(ctx, batch):
            if _same(ctx, setup.dft.ctx):
                return -3
            return real(ctx, batch)

        monkeypatch.setattr(llama_cpp, "llama_decode", draft_fails)
        with pytest.raises(RuntimeError, match=r"draft context returned -3 during prompt"):
            drafter.generate(SHORT_PROMPT, 4)
        with pytest.raises(RuntimeError, match=r"draft context returned -3 during drafting"):
            drafter.generate(ONE_TOKEN_PROMPT, 4)  # no prompt prefill: the first decode drafts

        monkeypatch.setattr(llama_cpp, "llama_decode", real)
        assert drafter.generate(LONG_PROMPT, 7) == setup.expected(LONG_PROMPT, 7)
    finally:
        monkeypatch.setattr(llama_cpp, "llama_decode", real)
        drafter.close()


def _same(a, b) -> bool:
    def addr(p):
        return ctypes.cast(p, ctypes.c_void_p).value
    return addr(a) == addr(b)
