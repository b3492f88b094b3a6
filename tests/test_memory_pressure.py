"""The workspace under memory pressure: a device that stays out of memory, scheduler rebuilds,
and the meta backend's reduction scratch.

``inject_alloc_failure(n, count=, min_size=)`` stands in for a device whose memory runs out:
from the n-th following backend buffer allocation on, the next ``count`` allocations of at least
``min_size`` bytes fail (``count=-1``: until ``inject_alloc_failure(0)``). With ``min_size``
between the decode-sized and the prompt-sized entries, prompt-sized buffers do not fit while
decode-sized ones do: a prompt request must fail with a Python exception, a request that stays
within the decode size must go on, and once memory is back the outputs must equal the fault-free
run (llama.h, ggml-alloc.h: a failed reserve withdraws the role's requirements, so the entries
fall back to what the decode phase needs).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import llama_cpp

from llama_metaws.engine.contexts import greedy_tokens, load_model, new_context
from llama_metaws.engine.batch import Batch

from engines import Greedy
from llama_metaws.engine.workspace import Workspace, context_info, inject_alloc_failure

N_CTX = 256
PAIR = dict(n_ctx=N_CTX, n_batch=96, n_ubatch=32)
DRAFT_MAX = 3
N_DECODE = DRAFT_MAX + 1
N_GEN = 8
TINY = [9, 4, 17]                              # within the decode size: no prompt-sized batch
LONG = [(5 * i + 1) % 128 for i in range(70)]  # prompt-sized batches (ubatches of 32)

SPLITS = {
    "none": dict(devices=None, split_mode="none"),
    "tensor": dict(devices=["CPU", "CPU"], split_mode="tensor"),
}


@pytest.fixture(scope="module")
def mtp_path(models_dir):
    from llama_metaws_dev.testing import make_tiny_mtp_model

    return make_tiny_mtp_model(models_dir / "pressure-mtp.gguf", seed=7, agreement=0.75)


@pytest.fixture(scope="module", params=sorted(SPLITS))
def split(request, mtp_path):
    """(split name, the model loaded with its MTP layers, greedy references)."""
    model = load_model(mtp_path, load_mtp=True, **SPLITS[request.param])
    ctx = new_context(model, n_ctx=N_CTX, n_batch=128, n_ubatch=32, n_rs_seq=1)
    try:
        ref = {"tiny": greedy_tokens(ctx, TINY, N_GEN), "long": greedy_tokens(ctx, LONG, N_GEN)}
    finally:
        ctx.close()
    yield request.param, model, ref
    model.close()


@pytest.fixture
def disarm():
    yield
    inject_alloc_failure(0)


def _pair(model):
    target = new_context(model, **PAIR, n_rs_seq=DRAFT_MAX)
    draft = new_context(model, **PAIR, mtp=True)
    return target, draft


def _figures(ws):
    return [(e.buffer_type, e.shared, e.alias, e.allocated, e.owner_need, e.borrower_need)
            for e in ws.stats()]


def _shared(ws):
    return [e for e in ws.stats() if e.shared]


def test_inject_alloc_failure_checks_its_arguments():
    for bad in (dict(n=-1), dict(n=1, count=0), dict(n=1, count=-2), dict(n=1, min_size=-1)):
        with pytest.raises(ValueError):
            inject_alloc_failure(**bad)
    with pytest.raises(TypeError):
        inject_alloc_failure(1, count=1.5)
    with pytest.raises(TypeError):
        inject_alloc_failure("1")
    inject_alloc_failure(0)


def test_while_prompt_sized_buffers_do_not_fit_prompts_fail_and_short_requests_go_on(split, disarm):
    name, model, ref = split
    target, draft = _pair(model)
    ws = Workspace(target, draft, n_decode_tokens=N_DECODE)
    drafter = Greedy(target, draft, draft_max=DRAFT_MAX)
    try:
        prompt_sizes = [e.allocated for e in _shared(ws)]  # the attach reserves prompt-sized
        assert drafter.generate(TINY, N_GEN) == ref["tiny"]
        decode = _figures(ws)
        decode_sizes = [e.allocated for e in _shared(ws)]
        assert drafter.generate(LONG, N_GEN) == ref["long"]
        long_figures = _figures(ws)
        # out of memory for anything as large as the smallest prompt-sized entry that is
        # larger than every decode-sized one
        min_size = min(s for s in prompt_sizes if s > max(decode_sizes))
        assert max(decode_sizes) < min_size

        inject_alloc_failure(1, count=-1, min_size=min_size)
        for _ in range(3):
            with pytest.raises(RuntimeError, match="returned -2"):
                drafter.generate(LONG, N_GEN)
            # the failed grow is not kept: the entries fall back to what decoding needs
            assert drafter.generate(TINY, N_GEN) == ref["tiny"]
            assert _figures(ws) == decode
        inject_alloc_failure(0)

        assert drafter.generate(LONG, N_GEN) == ref["long"]  # memory is back
        assert _figures(ws) == long_figures
        assert drafter.generate(TINY, N_GEN) == ref["tiny"]
        assert _figures(ws) == decode
        if name == "tensor":
            assert any(e.alias for e in _shared(ws))
    finally:
        for o in (drafter, ws, draft, target):
            o.close()


def test_one_failed_prompt_grow_does_not_pin_the_entry_at_the_prompt_size(split, disarm):
    """A transient failure: the request after it is decode-sized, not prompt-sized."""
    _, model, ref = split
    target, draft = _pair(model)
    ws = Workspace(target, draft, n_decode_tokens=N_DECODE)
    drafter = Greedy(target, draft, draft_max=DRAFT_MAX)
    try:
        assert drafter.generate(TINY, N_GEN) == ref["tiny"]
        decode = _figures(ws)
        inject_alloc_failure(1)  # the prompt's grow fails, once
        with pytest.raises(RuntimeError, match="returned -2"):
            drafter.generate(LONG, N_GEN)
        inject_alloc_failure(0)
        assert drafter.generate(TINY, N_GEN) == ref["tiny"]
        assert _figures(ws) == decode
    finally:
        for o in (drafter, ws, draft, target):
            o.close()


def _decode(ctx, batch, tokens, pos, rows=None):
    batch.clear()
    batch.add(tokens, pos, 0, True, rows)
    return llama_cpp.llama_decode(ctx.ctx, batch.batch)


def _clear(drafter, target, draft):
    """Sequence 0 of both contexts emptied, as the engine's slot 0 knows."""
    for ctx in (target, draft):
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx.ctx), 0, -1, -1)
    drafter.slots[0].forget()


def _rebuild(ctx):
    """A scheduler rebuild at the next decode (set_adapters_lora and set_sampler do the same)."""
    n_embd = llama_cpp.llama_model_n_embd(llama_cpp.llama_get_model(ctx.ctx))
    assert llama_cpp.llama_set_adapter_cvec(ctx.ctx, None, 0, n_embd, 0, 0) == 0


def test_a_rebuilt_draft_scheduler_fences_the_target_and_shares_at_once(split, disarm):
    """The draft's scheduler is rebuilt while the target has work in flight. The rebuild must
    synchronize the target before the old scheduler lets go of the shared entry, and the new
    scheduler must reserve in the shared entry (which fits) rather than in private prompt-sized
    buffers next to it: with every allocation failing, the draft's decode still succeeds."""
    _, model, ref = split
    target, draft = _pair(model)
    ws = Workspace(target, draft, n_decode_tokens=N_DECODE)
    drafter = Greedy(target, draft, draft_max=DRAFT_MAX)
    n_embd = drafter.n_embd
    tb, db = Batch(64), Batch(8, n_embd)
    try:
        assert drafter.generate(LONG, N_GEN) == ref["long"]  # warm: every buffer at its size
        _clear(drafter, target, draft)
        assert _decode(target, tb, LONG[:32], 0) == 0        # prompt-sized, left in flight
        _rebuild(draft)
        syncs = context_info(draft).n_handoff_syncs
        inject_alloc_failure(1, count=-1)
        rc = _decode(draft, db, [5], 0, rows=np.zeros((1, n_embd), np.float32))
        inject_alloc_failure(0)
        assert rc == 0, "the rebuilt draft scheduler needed memory of its own"
        assert context_info(draft).n_handoff_syncs == syncs + 1  # the target was fenced
        assert context_info(draft).paired and [e for e in ws.stats() if e.shared]
        assert drafter.generate(LONG, N_GEN) == ref["long"]
        assert drafter.generate(TINY, N_GEN) == ref["tiny"]
    finally:
        for o in (drafter, ws, draft, target):
            o.close()


def test_a_rebuilt_target_scheduler_fences_the_draft_first(split, disarm):
    """The target's rebuild replaces the shared entry: the draft's work in flight is waited for
    before the old entry is freed, even when the new one then cannot be allocated."""
    _, model, ref = split
    target, draft = _pair(model)
    ws = Workspace(target, draft, n_decode_tokens=N_DECODE)
    drafter = Greedy(target, draft, draft_max=DRAFT_MAX)
    n_embd = drafter.n_embd
    tb, db = Batch(8), Batch(8, n_embd)
    try:
        assert drafter.generate(TINY, N_GEN) == ref["tiny"]
        _clear(drafter, target, draft)
        assert _decode(draft, db, [5], 0, rows=np.zeros((1, n_embd), np.float32)) == 0  # in flight
        _rebuild(target)
        syncs = context_info(target).n_handoff_syncs
        inject_alloc_failure(1, count=-1)
        rc = _decode(target, tb, [5], 0)
        inject_alloc_failure(0)
        assert rc == -2  # the new entry could not be allocated: a clean failure
        assert context_info(target).n_handoff_syncs == syncs + 1
        assert drafter.generate(LONG, N_GEN) == ref["long"]  # the retry rebuilds and shares
        assert context_info(target).paired
        assert drafter.generate(TINY, N_GEN) == ref["tiny"]
    finally:
        for o in (drafter, ws, draft, target):
            o.close()


# The meta backend's reduction scratch (tensor split): a failed allocation used to be retried
# once and then ggml_backend_buffer_get_base(NULL) aborted the process. Every allocation of a
# request fails from the n-th on; each n runs in the same child process, which must not die.
_SCRATCH_CHILD = r"""
import json, sys
import llama_metaws
from llama_metaws.engine.contexts import greedy_tokens, load_model, new_context
from llama_metaws.engine.core import Engine
from llama_metaws.engine.workspace import Workspace, inject_alloc_failure

path, long, n_gen = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model = load_model(path, load_mtp=True, devices=["CPU", "CPU"], split_mode="tensor")
ref = new_context(model, n_ctx=256, n_batch=128, n_ubatch=32, n_rs_seq=1)
expected = greedy_tokens(ref, long, n_gen)
ref.close()
out = []
for n in range(1, 40):
    target = new_context(model, n_ctx=256, n_batch=96, n_ubatch=32, n_rs_seq=3)
    draft = new_context(model, n_ctx=256, n_batch=96, n_ubatch=32, mtp=True)
    ws = Workspace(target, draft, n_decode_tokens=4)
    drafter = Engine(target, draft, draft_max=3)
    drafter.generate = lambda prompt, n: drafter.complete(prompt, n, stop_at_eog=False, cache_prompt=False)
    inject_alloc_failure(n, count=-1)
    try:
        drafter.generate(long, n_gen)
        error = None
    except RuntimeError as e:
        error = str(e)
    inject_alloc_failure(0)
    out.append({"n": n, "error": error, "retry": drafter.generate(long, n_gen) == expected})
    for o in (drafter, ws, draft, target):
        o.close()
    if error is None:
        break
print(json.dumps(out))
"""


def test_the_meta_reduction_scratch_fails_closed_when_memory_stays_out(mtp_path):
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    res = subprocess.run([sys.executable, "-c", _SCRATCH_CHILD, str(mtp_path), json.dumps(LONG), "4"],
                         capture_output=True, text=True, timeout=400, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out[-1]["error"] is None, out  # the walk reached past the request's allocations
    assert all(r["error"] is None or "returned -2" in r["error"] for r in out), out
    assert all(r["retry"] for r in out), out
    assert len(out) > 3, out
