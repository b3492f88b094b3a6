"""Output rows as llama-server reserves them (patch 0025 and engine.limits): a context holds the
logits rows that are read, and a batch asking for more is an error, never an abort."""

import subprocess
import sys
import textwrap

import pytest

from llama_metaws.tools.children import child_env

DECODE_TOO_MANY = textwrap.dedent("""
    import sys
    import llama_metaws
    from llama_metaws.native.binding import _internals, llama_cpp
    from llama_metaws.native.params import set_fields
    from llama_metaws.engine.contexts import load_model

    model = load_model(sys.argv[1], verbose=True)  # llama.cpp's log: its error message
    params = llama_cpp.llama_context_default_params()
    set_fields(params, dict(n_ctx=128, n_batch=32, n_ubatch=32, n_outputs_max=2, n_outputs_max_per_seq=2))
    ctx = _internals.LlamaContext(model=model, params=params, verbose=True)
    batch = _internals.LlamaBatch(n_tokens=32, embd=0, n_seq_max=1)
    tokens = [int(sys.argv[3]) % 64 + i for i in range(int(sys.argv[2]))]
    batch.set_batch(tokens, n_past=0, logits_all=True)
    rc = llama_cpp.llama_decode(ctx.ctx, batch.batch)
    print("rc", rc, flush=True)
    batch.set_batch(tokens[:2], n_past=0, logits_all=True)  # within the limit: the context still works
    print("rc", llama_cpp.llama_decode(ctx.ctx, batch.batch), flush=True)
""")


@pytest.mark.parametrize("n_tokens", [3, 32])
def test_a_batch_asking_for_more_rows_than_n_outputs_max_is_an_error_not_an_abort(tiny_model, n_tokens):
    res = subprocess.run([sys.executable, "-c", DECODE_TOO_MANY, str(tiny_model), str(n_tokens), "1"],
                         capture_output=True, text=True, timeout=120, env=child_env())
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["rc", "-1", "rc", "0"], res.stdout
    assert f"the batch asks for {n_tokens} outputs, more than n_outputs_max = 2" in res.stderr
    assert "GGML_ASSERT" not in res.stderr


def test_a_batch_longer_than_n_batch_is_an_error_not_an_abort(tiny_model):
    code = DECODE_TOO_MANY.replace("n_tokens=32", "n_tokens=40")
    res = subprocess.run([sys.executable, "-c", code, str(tiny_model), "40", "1"],
                         capture_output=True, text=True, timeout=120, env=child_env())
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[:2] == ["rc", "-1"], res.stdout
    assert "the batch has 40 tokens, more than n_batch = 32" in res.stderr
