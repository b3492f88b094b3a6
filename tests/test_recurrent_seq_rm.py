"""A recurrent memory's rollback snapshots (n_rs_seq) at llama level: patch 0011, which makes
``llama_memory_seq_rm`` answer truthfully (llama.cpp issue 26695), and patch 0024, which reads a
state a few positions back out of them (``llama_state_seq_get_data_back``).

The gated delta net writes snapshot groups 0 .. n-1 for a ubatch of n tokens: a rollback by
r < n (and r <= n_rs_seq) is exact and answers true; anything else (the whole last decode, past
n_rs_seq, after a restored state, a range inside the state) answers false and leaves the state
as it was, so the next decode continues exactly where it stood. The same groups give the state
as it stood r positions back, byte for byte what a checkpoint taken there would hold.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import llama_metaws  # noqa: F401  (points llama_cpp at the patched build: import it first)
import llama_cpp

from llama_metaws.engine import contexts as loading
from llama_metaws.engine.checkpoints import PARTIAL, state_back
from llama_metaws_dev.testing import N_VOCAB, make_tiny_model, make_tiny_mtp_model

PROMPT = [(5 * i + 2) % N_VOCAB for i in range(8)]
A, B, C, D, Y = 17, 42, 99, 3, 64
TOL = 1e-4


@pytest.fixture(scope="module")
def model(models_dir):
    llama_cpp.llama_backend_init()
    path = make_tiny_mtp_model(models_dir / "seq-rm-random.gguf", seed=41)  # seeded random weights
    m = loading.load_model(path, load_mtp=True)
    yield m
    m.close()


class Ctx:
    """A hybrid target context with n_rs_seq=3 and a one-sequence batch."""

    def __init__(self, model, n_rs_seq=3):
        self.ctx = loading.new_context(model, n_ctx=64, n_batch=16, n_rs_seq=n_rs_seq)
        llama_cpp.llama_set_n_threads(self.ctx.ctx, 1, 1)
        self.mem = llama_cpp.llama_get_memory(self.ctx.ctx)
        self.batch = llama_cpp.llama_batch_init(16, 0, 1)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(model.vocab)

    def decode(self, tokens, pos0):
        b = self.batch
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos0 + i, 1, 0
            b.seq_id[i][0] = 0
        b.logits[len(tokens) - 1] = 1
        b.n_tokens = len(tokens)
        assert llama_cpp.llama_decode(self.ctx.ctx, b) == 0
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx.ctx, -1),
                                     shape=(self.n_vocab,)).copy()

    def rm(self, p0, p1=-1):
        return bool(llama_cpp.llama_memory_seq_rm(self.mem, 0, p0, p1))

    def pos_max(self):
        return int(llama_cpp.llama_memory_seq_pos_max(self.mem, 0))

    def close(self):
        llama_cpp.llama_batch_free(self.batch)
        self.ctx.close()


@pytest.fixture
def ctx(model):
    c = Ctx(model)
    yield c
    c.close()


def _reference(model, steps):
    """Logits after decoding each of ``steps`` (lists of tokens, consecutive) on a fresh context."""
    c = Ctx(model)
    try:
        pos, out = 0, None
        for toks in steps:
            out = c.decode(toks, pos)
            pos += len(toks)
        return out
    finally:
        c.close()


def test_a_rollback_inside_the_last_decode_is_exact(model, ctx):
    ctx.decode(PROMPT, 0)
    ctx.decode([A, B, C, D], 8)
    assert ctx.rm(9)  # back by 3 of a 4-token decode: groups 0..3 were written
    assert ctx.pos_max() == 8
    got = ctx.decode([Y], 9)
    assert np.allclose(got, _reference(model, [PROMPT, [A], [Y]]), atol=TOL)


def test_rolling_back_a_whole_one_token_decode_is_refused(model, ctx):
    # issue 26695: after a one-token decode, group 1 is stale; the unpatched seq_rm said true
    ctx.decode(PROMPT, 0)
    ctx.decode([A], 8)
    assert not ctx.rm(8)
    assert ctx.pos_max() == 8  # nothing moved: the state still holds A
    got = ctx.decode([B], 9)
    assert np.allclose(got, _reference(model, [PROMPT, [A], [B]]), atol=TOL)


def test_rolling_back_a_whole_short_decode_is_refused_a_shorter_rollback_is_not(model, ctx):
    ctx.decode(PROMPT, 0)
    ctx.decode([A, B], 8)  # 2 tokens < 1 + n_rs_seq groups
    assert not ctx.rm(8)   # back by 2: the whole decode
    assert ctx.pos_max() == 9
    assert ctx.rm(9)       # back by 1: exact
    got = ctx.decode([Y], 9)
    assert np.allclose(got, _reference(model, [PROMPT, [A], [Y]]), atol=TOL)


def test_a_rollback_past_n_rs_seq_is_refused(ctx):
    ctx.decode(PROMPT, 0)
    ctx.decode([A, B, C, D, Y], 8)
    assert not ctx.rm(8)   # back by 5 > n_rs_seq = 3
    assert not ctx.rm(9)   # back by 4 > 3
    assert ctx.pos_max() == 12


def test_a_second_rollback_before_a_decode_is_refused(ctx):
    ctx.decode(PROMPT, 0)
    ctx.decode([A, B, C, D], 8)
    assert ctx.rm(11)
    assert not ctx.rm(10)
    assert ctx.pos_max() == 10


def test_a_range_inside_the_state_is_refused_a_range_after_it_is_not(ctx):
    ctx.decode(PROMPT, 0)
    assert not ctx.rm(2, 4)
    assert not ctx.rm(0, 3)
    assert ctx.rm(20)          # nothing there: nothing to remove
    assert ctx.pos_max() == 7
    assert ctx.rm(0)           # the whole sequence
    assert ctx.pos_max() == -1


def test_a_restored_state_has_no_snapshots(model, ctx):
    ctx.decode(PROMPT, 0)
    ctx.decode([A, B, C, D], 8)
    flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
    size = llama_cpp.llama_state_seq_get_size_ext(ctx.ctx.ctx, 0, flags)
    buf = (ctypes.c_uint8 * size)()
    assert llama_cpp.llama_state_seq_get_data_ext(ctx.ctx.ctx, buf, size, 0, flags) > 0
    assert llama_cpp.llama_state_seq_set_data_ext(ctx.ctx.ctx, buf, size, 0, flags) > 0
    assert not ctx.rm(11)      # the snapshots of the decode were not restored with the state
    got = ctx.decode([Y], 12)  # the restored state itself is exact
    assert np.allclose(got, _reference(model, [PROMPT, [A, B, C, D], [Y]]), atol=TOL)


def test_without_snapshots_every_partial_rollback_is_refused(model):
    c = Ctx(model, n_rs_seq=0)
    try:
        c.decode(PROMPT, 0)
        c.decode([A, B], 8)
        assert not c.rm(9)
        assert c.pos_max() == 9
    finally:
        c.close()


# patch 0024: a state read back from the snapshots


def _partial_state(ctx) -> bytes:
    size = llama_cpp.llama_state_seq_get_size_ext(ctx.ctx.ctx, 0, PARTIAL)
    buf = (ctypes.c_uint8 * size)()
    got = llama_cpp.llama_state_seq_get_data_ext(ctx.ctx.ctx, buf, size, 0, PARTIAL)
    assert got > 0
    return bytes(buf)[:got]


@pytest.mark.parametrize("back", [0, 1, 2, 3])
def test_a_state_read_back_from_the_snapshots_is_the_one_saved_there(model, ctx, back):
    ctx.decode(PROMPT, 0)
    got = state_back(ctx.ctx.ctx, back)
    there = Ctx(model)
    try:
        there.decode(PROMPT[: len(PROMPT) - back], 0)
        assert got == _partial_state(there)  # byte for byte: positions and every layer's rows
    finally:
        there.close()
    assert ctx.pos_max() == len(PROMPT) - 1  # the sequence itself did not move


def test_a_state_read_back_restores_and_continues_exactly(model, ctx):
    ctx.decode(PROMPT, 0)
    state = state_back(ctx.ctx.ctx, 3)
    buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
    assert llama_cpp.llama_state_seq_set_data_ext(ctx.ctx.ctx, buf, len(state), 0, PARTIAL) == len(state)
    assert ctx.rm(5)  # the attention KV after it (the recurrent part is at 4 already)
    assert ctx.pos_max() == 4
    got = ctx.decode([Y], 5)
    assert np.allclose(got, _reference(model, [PROMPT[:5], [Y]]), atol=TOL)


def test_reading_a_state_back_leaves_the_rollback_as_it_was(model, ctx):
    ctx.decode(PROMPT, 0)
    ctx.decode([A, B, C, D], 8)
    assert state_back(ctx.ctx.ctx, 2) is not None
    assert ctx.pos_max() == 11
    assert ctx.rm(9)  # the snapshots are still there and nothing is pending
    got = ctx.decode([Y], 9)
    assert np.allclose(got, _reference(model, [PROMPT, [A], [Y]]), atol=TOL)


def test_a_state_the_snapshots_do_not_hold_is_not_read_back(model, ctx):
    ctx.decode(PROMPT, 0)
    assert state_back(ctx.ctx.ctx, 4) is None  # past n_rs_seq = 3
    ctx.decode([A, B], 8)
    assert state_back(ctx.ctx.ctx, 2) is None  # the whole last decode
    assert state_back(ctx.ctx.ctx, 1) is not None
    assert ctx.rm(9)  # a rollback pending: the snapshots no longer read as the last decode's
    assert state_back(ctx.ctx.ctx, 1) is None
    assert ctx.pos_max() == 8
    got = ctx.decode([Y], 9)
    assert np.allclose(got, _reference(model, [PROMPT, [A], [Y]]), atol=TOL)


def test_without_snapshots_or_recurrent_state_nothing_is_read_back(model, models_dir):
    c = Ctx(model, n_rs_seq=0)
    try:
        c.decode(PROMPT, 0)
        assert state_back(c.ctx.ctx, 1) is None
        assert state_back(c.ctx.ctx, 0) == _partial_state(c)  # 0: the state as it stands
    finally:
        c.close()
    plain = loading.load_model(make_tiny_model(models_dir / "seq-rm-llama.gguf", arch="llama"))
    try:
        c = Ctx(plain, n_rs_seq=0)
        try:
            c.decode(PROMPT, 0)
            assert state_back(c.ctx.ctx, 0) is None  # no recurrent part to read
        finally:
            c.close()
    finally:
        plain.close()
