"""Fault injection: a backend buffer allocation fails at each point where the workspace allocates.

``inject_alloc_failure(n)`` makes the n-th following ``ggml_backend_buft_alloc_buffer`` fail
(ggml logs ``injected failure allocating <size> bytes of <buffer type>``, which tells which
allocation was hit, and whether the n-th one came at all). Each test walks n = 1, 2, ... over
one operation until the operation no longer reaches the n-th allocation, so no allocation number
is hard-coded. At every failure: a clear Python exception (never a crash), the workspace fails
closed (llama.h, ggml-alloc.h: the entry stays empty, the requirements stay published, a later
reserve retries), a retry succeeds with the fault-free output, and nothing leaks: ggml's
accounting of the pair at a given phase is what it was before the fault, and the process heap
(glibc's in-use bytes) does not grow over a second pass of the whole walk.

The grow of the target's entry on split_mode="none" is tested in test_workspace.py; here:
the attach's first reserve, the target's grow and the shrink after it (both split modes, the
meta buffer and its per-device buffers under tensor split), the draft's own grow, and the
borrower alias. The alias itself (``ggml_backend_meta_buffer_alias``) allocates no backend
buffer: it is made right after the entry's meta buffer, so what can fail on the way to it is
the meta buffer (its own allocation, then one per device); each of those must leave no alias
and no meta buffer behind.
"""

import contextlib
import ctypes
import gc
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import llama_cpp
from llama_cpp import _logger

from llama_metaws.engine.contexts import greedy_tokens, load_model, new_context
from llama_metaws.engine.batch import Batch
from llama_metaws.engine.devices import list_devices
from llama_metaws_dev.testing import split_devices
from llama_metaws.engine.workspace import Workspace, context_info, inject_alloc_failure, private_bytes

from engines import Greedy, generate

N_CTX = 256
PAIR = dict(n_ctx=N_CTX, n_batch=96, n_ubatch=32)
# prompt-sized reservations of 128 tokens: the draft's own prompt then needs more than the
# target's decode-sized entry, so the draft alone grows the shared entry
BIG_UBATCH = dict(n_ctx=N_CTX, n_batch=128, n_ubatch=128)
DRAFT_MAX = 3
N_DECODE = DRAFT_MAX + 1
N_GEN = 8
SHORT = [9, 4, 17, 33, 2, 61, 8, 100, 27, 5]
LONG = [(5 * i + 1) % 128 for i in range(70)]      # several ubatches of 32
DRAFT_PROMPT = [(3 * i + 2) % 128 for i in range(120)]
MAX_ALLOCATIONS = 40  # far more than any operation here allocates
# what the heap may drift over a pass of a walk without leaking (measured: < 2 KiB); the
# smallest buffer a failure could lose here is a shrunk entry of ~10 KiB
HEAP_TOLERANCE = 8 * 1024
MEASURED_PASSES = 3  # see _walk

SPLITS = {
    "none": dict(devices=None, split_mode="none"),
    "tensor": dict(devices=split_devices(2), split_mode="tensor"),  # LLAMA_METAWS_TEST_DEVICES
}
_INJECTED = re.compile(r"injected failure allocating (\d+) bytes of (.+?)\s*$")


@pytest.fixture(scope="module")
def mtp_path(models_dir):
    from llama_metaws_dev.testing import make_tiny_mtp_model

    return make_tiny_mtp_model(models_dir / "faults-mtp.gguf", seed=7, agreement=0.75)


@pytest.fixture(scope="module", params=sorted(SPLITS))
def split(request, mtp_path):
    """(split name, the model loaded with its MTP layers, greedy references)."""
    model = load_model(mtp_path, load_mtp=True, **SPLITS[request.param])
    ctx = new_context(model, n_ctx=N_CTX, n_batch=128, n_ubatch=32, n_rs_seq=1)
    try:
        ref = {"short": greedy_tokens(ctx, SHORT, N_GEN), "long": greedy_tokens(ctx, LONG, N_GEN)}
    finally:
        ctx.close()
    yield request.param, model, ref
    model.close()


@pytest.fixture
def injections():
    """The injected failures ggml logs (WARN: the binding's logger drops them when not verbose)."""
    lines = []

    @llama_cpp.llama_log_callback
    def record(level, text, user_data):
        line = text.decode("utf-8", "replace")
        if "injected failure" in line:
            lines.append(line.strip())

    llama_cpp.llama_log_set(record, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        inject_alloc_failure(0)
        llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


@contextlib.contextmanager
def failing_allocation(n, log):
    """The n-th backend buffer allocation in the block fails; afterwards ``failed`` holds
    (size, buffer type) of the allocation that failed, or None when there was no n-th one."""
    del log[:]
    result = {"failed": None}
    inject_alloc_failure(n)
    try:
        yield result
    finally:
        inject_alloc_failure(0)  # no stray failure for whatever runs next
        assert len(log) <= 1, log
        if log:
            m = _INJECTED.search(log[0])
            assert m, log[0]
            result["failed"] = (int(m.group(1)), m.group(2))


# the devices are registered once, at the library's load: looked up once, not at every reading
_GPU_BUILD = any(d.type != "cpu" for d in list_devices())


def _heap_in_use():
    """glibc's bytes in use (heap + mmapped chunks), where ggml's CPU buffers come from; None
    where that cannot be read, under ASan (its allocator is not glibc's), or in a build with a
    GPU backend: there the buffers are the device's, and the driver's own threads allocate and
    free host memory while a pass runs (on an H200, 2026-12-04, a 16 KiB malloc kept on every
    pass went unseen), so ggml's accounting alone is the leak check."""
    if "asan" in os.environ.get("LD_PRELOAD", "") or _GPU_BUILD:
        return None
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    fn.restype = MallInfo2
    info = fn()
    return info.uordblks + info.hblkhd


def _pair(model, params=PAIR):
    target = new_context(model, **params, n_rs_seq=DRAFT_MAX)
    draft = new_context(model, **params, mtp=True)
    return target, draft


def _figures(ws):
    """ggml's accounting of the pair: per entry, what is allocated and what each role needs."""
    return [(e.buffer_type, e.shared, e.alias, e.allocated, e.owner_need, e.borrower_need)
            for e in ws.stats()]


def _meta(ws):
    return [e for e in ws.stats() if e.buffer_type.startswith("Meta")]


def _close(*objs):
    for o in objs:
        if o is not None:
            o.close()


def _walk(one_pass, tolerance=HEAP_TOLERANCE, checks=MEASURED_PASSES):
    """Run ``one_pass`` (which walks n until its operation has no n-th allocation): the first
    pass warms up, a later one must leave the heap where it found it (``tolerance``: None for no
    heap check). A leak grows the heap by the same bytes on every pass; the allocator's own drift
    (a Python list or dict resized past pymalloc's 512 bytes, a thread's arena) comes on one pass
    and not the next. So a pass that grew the heap past ``tolerance`` is followed by another, up
    to ``checks`` measured passes, and the walk fails only when every one of them grew it."""
    records = one_pass()
    if tolerance is None or _heap_in_use() is None:
        return records
    grown = []
    for _ in range(checks):
        gc.collect()  # an exception kept with its traceback holds frames, drafters, batches
        before = _heap_in_use()
        records = one_pass()
        gc.collect()
        grown.append(_heap_in_use() - before)
        if grown[-1] < tolerance:
            return records
    pytest.fail(f"the process heap grew by {grown} bytes over {checks} passes of injected failures")


def test_the_heap_check_fails_on_a_leak_on_every_pass_and_not_on_a_drift_on_one():
    """``_walk``'s check itself: 16 KiB kept on every pass fails it; 16 KiB kept once passes."""
    if _heap_in_use() is None:
        pytest.skip("glibc's mallinfo2 cannot be read here, or is no measure (ASan, a GPU build)")
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    kept = []

    def leaking():
        kept.append(libc.malloc(2 * HEAP_TOLERANCE))
        return []

    def drifting():
        if len(kept) < 2:  # the warm-up and the first measured pass
            kept.append(libc.malloc(2 * HEAP_TOLERANCE))
        return []

    try:
        with pytest.raises(pytest.fail.Exception, match="heap grew by"):
            _walk(leaking)
        assert len(kept) == 1 + MEASURED_PASSES
        for p in kept:
            libc.free(p)
        del kept[:]
        assert _walk(drifting) == [] and len(kept) == 2
    finally:
        for p in kept:
            libc.free(p)


def test_a_failed_first_reserve_fails_the_attach_and_both_contexts_stay_private(split, injections):
    name, model, ref = split
    target, draft = _pair(model)
    try:
        private = (private_bytes(target), private_bytes(draft))
        fault_free = {}

        def one_pass():
            records = []
            for n in range(1, MAX_ALLOCATIONS):
                error = None
                with failing_allocation(n, injections) as result:
                    try:
                        ws = Workspace(target, draft, n_decode_tokens=N_DECODE)
                    except MemoryError as e:
                        ws, error = None, e
                if result["failed"] is None:  # the attach needs fewer than n allocations
                    assert ws is not None and ws.shared
                    ws.close()
                    # back to private buffers, reserved again at the next decode: make that
                    # decode now, so that the next pass's injection meets the attach's own
                    # allocations (a failure in that pending re-reserve aborts: see
                    # test_a_failed_private_re_reserve_after_a_detach_is_an_exception below)
                    generate(target, draft, SHORT, N_GEN, draft_max=DRAFT_MAX)
                    return records
                assert ws is None, f"allocation {n} of the attach failed, yet it reported success"
                assert "could not be allocated" in str(error) and "private" in str(error)
                assert not context_info(target).paired and not context_info(draft).paired

                # both private and usable; the buffers given up at the attach come back at the
                # next decode, as large as they were before it (nothing kept, nothing lost)
                with Greedy(target, draft, draft_max=DRAFT_MAX) as drafter:
                    assert drafter.generate(LONG, N_GEN) == ref["long"]
                    assert (private_bytes(target), private_bytes(draft)) == private

                    # a retry attaches, and shares exactly what a fault-free attach shares
                    with Workspace(target, draft, n_decode_tokens=N_DECODE) as ws2:
                        assert ws2.shared
                        assert drafter.generate(LONG, N_GEN) == ref["long"]
                        assert drafter.generate(SHORT, N_GEN) == ref["short"]
                        assert _figures(ws2) == fault_free.setdefault("decode", _figures(ws2))
                        if name == "tensor":
                            assert _meta(ws2)[0].alias
                    assert drafter.generate(SHORT, N_GEN) == ref["short"]  # private again
                records.append((n,) + result["failed"])
            pytest.fail(f"the attach kept allocating past {MAX_ALLOCATIONS} buffers")

        # Under tensor split the heap drifts by up to ~2 MB between fault-free detach/attach
        # cycles (measured: a sawtooth, the allocator's caches; the meta backend's state is
        # rebuilt with each new scheduler), more than the buffers a failure could lose: there
        # ggml's accounting above is the leak check. On one device the drift is ~1 KB.
        records = _walk(one_pass, HEAP_TOLERANCE if name == "none" else None)
        assert records, "no allocation of the attach failed"
        if name == "tensor":
            # the owner's first reserve makes the meta buffer (and the borrower's alias of it):
            # its own allocation failed, and then each of its per-device buffers (as large)
            meta_sizes = {size for _, size, buft in records if buft.startswith("Meta")}
            per_device = [r for r in records if not r[2].startswith("Meta") and r[1] in meta_sizes]
            assert len(meta_sizes) == 1 and len(per_device) == len(SPLITS["tensor"]["devices"]), records
    finally:
        _close(draft, target)


def test_a_failed_resize_during_a_request_raises_and_a_retry_restores_the_workspace(split, injections):
    """Every allocation of a long request after a short one: the target's grow (prompt) and
    the shrink after it (once the draft republished), and, under tensor split, the meta
    buffers and the meta backend's reduction scratch buffers."""
    name, model, ref = split
    target, draft = _pair(model)
    ws = Workspace(target, draft, n_decode_tokens=N_DECODE)
    drafter = Greedy(target, draft, draft_max=DRAFT_MAX)
    try:
        assert drafter.generate(SHORT, N_GEN) == ref["short"]
        decode_figures = _figures(ws)
        assert drafter.generate(LONG, N_GEN) == ref["long"]
        long_figures = _figures(ws)

        def one_pass():
            records = []
            for n in range(1, MAX_ALLOCATIONS):
                # the same starting point each time: the decode phase of a short request
                assert drafter.generate(SHORT, N_GEN) == ref["short"]
                assert _figures(ws) == decode_figures  # nothing held on from the last fault
                error = out = None
                with failing_allocation(n, injections) as result:
                    try:
                        out = drafter.generate(LONG, N_GEN)
                    except RuntimeError as e:
                        error = e
                if result["failed"] is None:
                    assert out == ref["long"]
                    return records
                size, buft = result["failed"]
                if error is None:
                    # not a workspace buffer: the meta backend's scratch buffer for a reduction,
                    # which it allocates again when it is next used
                    assert name == "tensor" and out == ref["long"], result
                    records.append((n, size, buft, "tolerated", None))
                else:
                    assert "returned -2" in str(error), error
                    entries = ws.stats()
                    empty = [e for e in entries if e.shared and e.allocated == 0]
                    assert len(empty) == 1, entries  # fail-closed: that entry stays empty...
                    (entry,) = empty
                    assert max(entry.owner_need, entry.borrower_need) > 0  # ...needs published
                    assert not entry.alias  # no alias of memory that is gone
                    assert all(e.allocated >= max(e.owner_need, e.borrower_need)
                               for e in entries if e.shared and e is not entry)
                    phase = "grow" if "during prompt" in str(error) else "shrink"
                    records.append((n, size, buft, phase, entry.buffer_type))
                # the retry succeeds, and the workspace is what a fault-free request leaves
                assert drafter.generate(LONG, N_GEN) == ref["long"]
                assert _figures(ws) == long_figures
                if name == "tensor":
                    assert _meta(ws)[0].alias  # the alias is made again
            pytest.fail(f"a request kept allocating past {MAX_ALLOCATIONS} buffers")

        records = _walk(one_pass)
        phases = {r[3] for r in records}
        assert {"grow", "shrink"} <= phases, records
        if name == "tensor":
            # the meta entry failed at its own allocation and at a per-device one, growing and
            # shrinking: each time before its alias could be made, and none was left behind
            meta = {(r[3], r[2].startswith("Meta")) for r in records if r[4] and r[4].startswith("Meta")}
            assert meta == {("grow", True), ("grow", False), ("shrink", True), ("shrink", False)}, records
    finally:
        _close(drafter, ws, draft, target)


def test_a_failed_grow_of_the_draft_alone_and_its_retry(split, injections):
    """The borrower grows the shared entry on its own prompt (with 128-token reservations it
    needs more than the target's decode-sized entry): its failure is the draft's -2, the
    target's requirement stays, and the next request grows the entry again."""
    name, model, ref = split
    target, draft = _pair(model, BIG_UBATCH)
    ws = Workspace(target, draft, n_decode_tokens=N_DECODE)
    drafter = Greedy(target, draft, draft_max=DRAFT_MAX)
    n_embd = drafter.n_embd
    rows = np.zeros((len(DRAFT_PROMPT), n_embd), dtype=np.float32)
    batch = Batch(len(DRAFT_PROMPT), n_embd)

    def draft_prompt():  # a prompt on the draft context alone: its own grow
        mem = llama_cpp.llama_get_memory(draft.ctx)
        llama_cpp.llama_memory_seq_rm(mem, 0, -1, -1)
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(target.ctx), 0, -1, -1)
        drafter.slots[0].forget()
        batch.clear()
        batch.add(DRAFT_PROMPT, 0, 0, False, rows)
        rc = llama_cpp.llama_decode(draft.ctx, batch.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode on the draft context returned {rc} during prompt processing")

    try:
        assert drafter.generate(SHORT, N_GEN) == ref["short"]
        decode_figures = _figures(ws)
        draft_prompt()
        grown = {e.buffer_type: e for e in ws.stats()}
        assert any(e.borrower_need > e.owner_need and e.n_grow > 0 for e in grown.values()), grown
        assert drafter.generate(SHORT, N_GEN) == ref["short"]
        assert _figures(ws) == decode_figures

        def one_pass():
            records = []
            for n in range(1, MAX_ALLOCATIONS):
                assert drafter.generate(SHORT, N_GEN) == ref["short"]
                assert _figures(ws) == decode_figures
                error = None
                with failing_allocation(n, injections) as result:
                    try:
                        draft_prompt()
                    except RuntimeError as e:
                        error = e
                if result["failed"] is None:
                    assert error is None
                    return records
                assert error is not None and "draft context returned -2" in str(error), error
                (entry,) = [e for e in ws.stats() if e.shared and e.allocated == 0]
                assert entry.owner_need > 0 and not entry.alias  # the target's need stays
                records.append((n,) + result["failed"] + (entry.buffer_type,))
                # the next request grows the entry again, from the target's side this time
                assert drafter.generate(LONG, N_GEN) == ref["long"]
            pytest.fail(f"the draft's prompt kept allocating past {MAX_ALLOCATIONS} buffers")

        records = _walk(one_pass)
        assert records
        if name == "tensor":
            # the draft's grow makes the meta buffer and then its own alias of it
            assert {r[2].startswith("Meta") for r in records if r[3].startswith("Meta")} == {True, False}
    finally:
        _close(drafter, ws, draft, target)


def test_zero_disarms_a_pending_failure(split, injections):
    """inject_alloc_failure(0) disarms a pending failure: nothing fails afterwards."""
    _, model, ref = split
    target, draft = _pair(model)
    try:
        inject_alloc_failure(1)
        inject_alloc_failure(0)
        with Workspace(target, draft, n_decode_tokens=N_DECODE) as ws:
            assert ws.shared
            assert generate(target, draft, LONG, N_GEN, draft_max=DRAFT_MAX) == ref["long"]
        assert not injections
        with pytest.raises(ValueError):
            inject_alloc_failure(-1)
    finally:
        _close(draft, target)


# A detach (Workspace.close, or the peer closed) sends both contexts back to private buffers that
# are reserved again at the next decode or attach (llama_context::sched_reserve). When that
# allocation fails, sched_reserve throws std::runtime_error("failed to allocate compute pp
# buffers") through llama_decode / llama_attach_shared_workspace, which catch nothing, and the
# process aborts (std::terminate) instead of the decode returning an error or the attach -1.
# Each case runs in a child process; while that abort is there the test is an expected failure
# (matched on its exact message, anything else fails), and once it is fixed it must pass.
_CHILD = r"""
import json, sys
import llama_metaws
from llama_metaws.engine.contexts import greedy_tokens, load_model, new_context
from llama_metaws.engine.core import Engine
from llama_metaws.engine.workspace import Workspace, inject_alloc_failure

path, case = sys.argv[1], sys.argv[2]
short, n = json.loads(sys.argv[3]), int(sys.argv[4])
model = load_model(path, load_mtp=True)
ref = new_context(model, n_ctx=256, n_batch=96, n_ubatch=32, n_rs_seq=1)
expected = greedy_tokens(ref, short, n)
ref.close()
target = new_context(model, n_ctx=256, n_batch=96, n_ubatch=32, n_rs_seq=3)
draft = new_context(model, n_ctx=256, n_batch=96, n_ubatch=32, mtp=True)
ws = Workspace(target, draft, n_decode_tokens=4)
drafter = Engine(target, draft, draft_max=3)
drafter.generate = lambda prompt, n: drafter.complete(prompt, n, stop_at_eog=False, cache_prompt=False)
assert drafter.generate(short, n) == expected

if case == "decode after the peer closed":
    draft.close()
    run = lambda: greedy_tokens(target, short, n)
    retry = run
else:
    ws.close()
    run = (lambda: Workspace(target, draft, n_decode_tokens=4)) if case == "attach after a detach" \
        else (lambda: drafter.generate(short, n))
    retry = lambda: (Workspace(target, draft, n_decode_tokens=4), drafter.generate(short, n))[1]
inject_alloc_failure(1)
try:
    run()
    error = None
except Exception as e:
    error = e
finally:
    inject_alloc_failure(0)
kind = None if error is None else "RuntimeError" if isinstance(error, RuntimeError) else type(error).__name__
print(json.dumps({"exception": kind, "message": str(error),
                  "retry": retry() == expected}))
"""


@pytest.mark.parametrize("case", ["attach after a detach", "decode after a detach",
                                  "decode after the peer closed"])
def test_a_failed_private_re_reserve_after_a_detach_is_an_exception(mtp_path, case):
    # no gdb backtrace from ggml's abort handler: slow, and very slow under ASan
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    res = subprocess.run([sys.executable, "-c", _CHILD, str(mtp_path), case, json.dumps(SHORT), str(N_GEN)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    expected = "MemoryError" if case.startswith("attach") else "RuntimeError"
    assert result["exception"] == expected, result
    assert result["retry"], result
