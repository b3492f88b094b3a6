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


# ---------------------------------------------------------------------------------------------
# held compute against llama.cpp's own reservation with llama-server's limits

from llama_metaws import Llama  # noqa: E402
from llama_metaws.engine.buffers import compute_buffers  # noqa: E402
from llama_metaws.engine.limits import output_limits  # noqa: E402
from llama_metaws_dev.testing import make_tiny_mtp_model, split_devices  # noqa: E402
from llama_metaws.tools.reservation import llama_server_reservation, server_limits  # noqa: E402

KW = dict(n_ctx=256, n_batch=64, n_ubatch=64, verbose=False)


@pytest.fixture(scope="module")
def mtp_path(models_dir):
    return str(make_tiny_mtp_model(models_dir / "limits-mtp.gguf", seed=5, agreement=0.8))


def _by_type(ctx):
    out, seen = {}, set()
    for b in compute_buffers(ctx):
        if b.buft not in seen:
            seen.add(b.buft)
            out[b.buffer_type] = out.get(b.buffer_type, 0) + b.size
    return out


def test_our_limits_are_llama_servers():
    for n, k, n_batch in [(1, 3, 64), (2, 3, 512), (4, 6, 16), (3, 0, 512), (2, 3, 4)]:
        ours, theirs = output_limits(n, k, n_batch), server_limits(n, k, n_batch)
        assert ours.target.fields() == {f: theirs.target[f] for f in ("n_outputs_max", "n_outputs_max_per_seq")}
        assert ours.draft.fields() == {f: theirs.draft[f] for f in ("n_outputs_max", "n_outputs_max_per_seq")}
    assert output_limits(2, 3, 64, logits_all=True).target.fields() == {"n_outputs_max": 0,
                                                                         "n_outputs_max_per_seq": 0}


@pytest.mark.parametrize("n_seq_max", [1, 2, 4])
@pytest.mark.parametrize("split", ["one-device", "tensor"])
@pytest.mark.parametrize("drafting", ["off", "private", "alias"])
def test_compute_held_after_load_is_what_llama_cpp_reserves_with_llama_servers_limits(
        mtp_path, n_seq_max, split, drafting):
    kw = dict(KW, n_seq_max=n_seq_max)
    if split == "tensor":
        kw.update(devices=split_devices(2), split_mode="tensor")
    if drafting != "off":
        kw.update(draft="mtp", draft_max=3, phase_aware_workspace=drafting == "alias", workspace_mode="alias")
    with Llama(mtp_path, **kw) as llm:
        ref = llama_server_reservation(llm)
        assert ref.target and all(v > 0 for v in ref.target.values())
        if drafting == "off":
            assert _by_type(llm._ctx) == ref.target
        elif drafting == "private":  # both private: each context holds llama.cpp's own figure
            assert _by_type(llm._ctx) == ref.target
            assert _by_type(llm._draft_ctx) == ref.draft
        else:  # one shared entry per buffer type, sized to the larger of the two
            held = {e.buffer_type: e.allocated for e in llm.workspace_stats()}
            want = {t: max(ref.target.get(t, 0), ref.draft.get(t, 0)) for t in set(ref.target) | set(ref.draft)}
            assert held == want
            assert sum(held.values()) < ref.held  # llama-server holds the sum


def test_the_limits_change_what_is_held(mtp_path):
    """Without the limits (every row of a batch) the same Llama holds more: the test above can fail."""
    with Llama(mtp_path, draft="mtp", draft_max=3, phase_aware_workspace=False, **KW) as llm:
        ref = llama_server_reservation(llm)
        every_row = llama_server_reservation(llm, n_draft=KW["n_batch"])  # limits at n_batch
        assert sum(every_row.target.values()) > sum(ref.target.values()) == sum(_by_type(llm._ctx).values())


LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 10  # past n_batch


@pytest.mark.parametrize("echo", [False, True])
def test_logprobs_with_logits_all_past_n_batch_equal_the_bindings(mtp_path, echo):
    import numpy as np
    import llama_cpp

    kw = dict(max_tokens=24, temperature=0.0, logprobs=3, echo=echo)
    binding = llama_cpp.Llama(mtp_path, logits_all=True, **KW)
    try:
        assert len(binding.tokenize(LONG_PROMPT.encode())) > KW["n_batch"]
        want = binding.create_completion(LONG_PROMPT, **kw)["choices"][0]
    finally:
        binding.close()
    with Llama(mtp_path, draft="mtp", logits_all=True, n_seq_max=2, **KW) as llm:
        got = llm.create_completion(LONG_PROMPT, **kw)["choices"][0]
        assert llm.draft_stats.last.drafted > 0
    assert got["text"] == want["text"]
    a, b = got["logprobs"], want["logprobs"]
    assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
    np.testing.assert_allclose(np.array([x if x is not None else 0.0 for x in a["token_logprobs"]]),
                               np.array([x if x is not None else 0.0 for x in b["token_logprobs"]]), atol=1e-4)
    assert [None if t is None else sorted(t) for t in a["top_logprobs"]] == \
        [None if t is None else sorted(t) for t in b["top_logprobs"]]


LOW_LEVEL_EVAL = textwrap.dedent("""
    import sys
    import llama_metaws
    from llama_metaws import Llama
    llm = Llama(sys.argv[1], draft="mtp", draft_max=3, n_seq_max=1, n_ctx=256, n_batch=64, verbose=True)
    tokens = list(range(1, 9))
    llm._batch.set_batch(tokens, n_past=0, logits_all=True)  # 8 rows; the target reserves 1 + 3
    try:
        llm._ctx.decode(llm._batch)
    except RuntimeError as e:
        print("raised:", e, flush=True)
    out = llm.create_completion("the quick brown fox", max_tokens=4, temperature=0.0)
    print("then:", len(out["choices"][0]["text"]) > 0, flush=True)
""")


def test_a_low_level_eval_asking_for_more_rows_than_the_limit_is_an_exception(mtp_path):
    res = subprocess.run([sys.executable, "-c", LOW_LEVEL_EVAL, mtp_path], capture_output=True, text=True,
                         timeout=120, env=child_env())
    assert res.returncode == 0, res.stderr[-2000:]
    assert "raised: llama_decode returned -1" in res.stdout
    assert "then: True" in res.stdout
    assert "the batch asks for 8 outputs, more than n_outputs_max = 4" in res.stderr
