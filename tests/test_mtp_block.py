"""Patches 0022 and 0023 at llama level: with masked NextN rows (what a draft context sets)
the NextN rows qwen35's MTP block gives are the outputs' own (0022), and the block runs past its
attention on the output rows only (0023).

A node observer (the context's ``cb_eval``, which the scheduler asks about every node before it
computes it) reads the rows of the block's FFN output (``mtp_ffn_out``); the rows and logits of a
masked context are checked against an unmasked one over the same batch.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import llama_metaws  # noqa: F401  (points llama_cpp at the patched build: import it first)
import llama_cpp

from llama_metaws.engine import contexts as loading
from llama_metaws.native.binding import _internals, llama_ext
from llama_metaws.engine.batch import Batch
from llama_metaws.native.params import set_fields
from llama_metaws.native.runtime import require_build
from llama_metaws_dev.testing import N_VOCAB, make_tiny_mtp_model

TOKENS = [(7 * i + 3) % N_VOCAB for i in range(6)]
OUTPUTS = [2, 5]  # not the batch's first rows


@pytest.fixture(scope="module")
def model(models_dir):
    llama_cpp.llama_backend_init()
    m = loading.load_model(make_tiny_mtp_model(models_dir / "mtp-block.gguf", seed=51), load_mtp=True)
    yield m
    m.close()


@pytest.fixture(scope="module")
def ggml():
    lib = ctypes.CDLL(str(require_build().lib_dir / "libggml-base.so"))
    lib.ggml_get_name.argtypes, lib.ggml_get_name.restype = [ctypes.c_void_p], ctypes.c_char_p
    lib.ggml_nrows.argtypes, lib.ggml_nrows.restype = [ctypes.c_void_p], ctypes.c_int64
    return lib


class Draft:
    """An MTP context over ``model`` with NextN rows ``masked`` (or not), its FFN rows observed."""

    def __init__(self, model, ggml, masked: bool):
        self.ffn_rows = []

        def observe(t, ask, _):
            if ask and ggml.ggml_get_name(t).decode().startswith("mtp_ffn_out"):
                self.ffn_rows.append(int(ggml.ggml_nrows(t)))
            return False  # nothing to look at after: the graph runs as it would

        self._observe = llama_cpp.ggml_backend_sched_eval_callback(observe)  # kept alive here
        params = llama_cpp.llama_context_default_params()
        set_fields(params, dict(n_ctx=64, n_batch=16, n_ubatch=16, n_rs_seq=0, n_threads=1,
                                n_threads_batch=1, ctx_type=llama_cpp.LLAMA_CONTEXT_TYPE_MTP,
                                cb_eval=self._observe))
        self.ctx = _internals.LlamaContext(model=model, params=params, verbose=False)
        llama_ext.llama_set_embeddings_nextn(self.ctx.ctx, True, masked)
        self.n_embd = int(llama_cpp.llama_model_n_embd_out(model.model))
        self.batch = Batch(16, self.n_embd)

    def decode(self, tokens, rows, outputs):
        self.ffn_rows.clear()
        self.batch.clear()
        self.batch.add(tokens, 0, 0, [1 if i in outputs else 0 for i in range(len(tokens))], rows)
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx.ctx), True)
        assert llama_cpp.llama_decode(self.ctx.ctx, self.batch.batch) == 0

    def row(self, i):
        ptr = llama_ext.llama_get_embeddings_nextn_ith(self.ctx.ctx, i)
        assert ptr, f"no NextN row for batch index {i}"
        return np.ctypeslib.as_array(ptr, shape=(self.n_embd,)).copy()

    def logits(self, i):
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx.ctx, i), shape=(N_VOCAB,)).copy()

    def close(self):
        self.ctx.close()


@pytest.fixture
def contexts(model, ggml):
    made = []

    def make(masked):
        made.append(Draft(model, ggml, masked))
        return made[-1]

    yield make
    for d in made:
        d.close()


def _rows(n_embd, n=len(TOKENS)):
    return np.random.default_rng(5).standard_normal((n, n_embd)).astype(np.float32)


@pytest.mark.parametrize("outputs", [[], [5], OUTPUTS], ids=["none", "last", "two"])
def test_a_masked_draft_context_runs_its_ffn_on_the_output_rows_only(contexts, outputs):
    masked, unmasked = contexts(True), contexts(False)
    rows = _rows(masked.n_embd)
    masked.decode(TOKENS, rows, outputs)
    unmasked.decode(TOKENS, rows, outputs)
    # a prompt batch the draft follows (no outputs) stops after the block's attention
    assert masked.ffn_rows == [len(outputs)]
    assert unmasked.ffn_rows == [len(TOKENS)]


def test_masked_nextn_rows_and_logits_are_the_outputs_own(contexts):
    masked, unmasked = contexts(True), contexts(False)
    rows = _rows(masked.n_embd)
    masked.decode(TOKENS, rows, OUTPUTS)
    unmasked.decode(TOKENS, rows, OUTPUTS)
    for i in OUTPUTS:
        np.testing.assert_allclose(masked.row(i), unmasked.row(i), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(masked.logits(i), unmasked.logits(i), rtol=1e-4, atol=1e-4)
    # and they differ from row to row (a check that could not pass on a row of another output)
    assert not np.allclose(masked.row(OUTPUTS[0]), masked.row(OUTPUTS[1]), atol=1e-3)
