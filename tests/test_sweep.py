"""A SQLite-style sweep of allocation failures over whole requests.

For each configuration (one device; tensor split with the alias; tensor split with private meta
buffers) a child process runs the same scenario (a short request, a long one, a short one) on a
fresh pair of contexts with a shared workspace, once fault-free and then once for every
allocation index n it reaches: the n-th backend buffer allocation fails (``count=1``: a
transient failure), or every allocation from the n-th on fails (``count=-1``: memory stays out
until the scenario ends). The walk ends at the first n the scenario never reaches.
``LLAMA_METAWS_SWEEP_STRIDE=k`` (``make sanitize``: under the sanitizers every index of the
tensor-split cases would outrun CI's budget) samples the indices deterministically instead: every
k-th from the first, then a bisection of the gap to the last one reached; the persistent failures
take the same indices. At every n:

- the process does not abort (the child would die, the parent sees it);
- each request either gives the fault-free output or raises a ``RuntimeError`` (llama_decode
  returned -2, or the output buffers could not be allocated); a failure that is absorbed (the meta backend's reduction scratch, allocated
  again when next used) must leave the output unchanged;
- with memory back, the scenario again gives the fault-free outputs and leaves ggml's
  accounting of the workspace (per entry: bytes allocated, each role's requirement) exactly
  where the fault-free run left it after each request: nothing leaked, nothing held on;
- under AddressSanitizer, LeakSanitizer finds no unreachable block once every pair is closed.
"""

import json
import os
import subprocess
import sys

import pytest

from llama_metaws.native import build as native_build
from llama_metaws.native import runtime

_CHILD = r"""
import ctypes, json, sys
import llama_metaws
import llama_cpp
from llama_metaws.engine.contexts import greedy_tokens, load_model, new_context
from llama_metaws.engine.core import Engine
from llama_metaws.engine.workspace import Workspace, inject_alloc_failure

path, split, mode = sys.argv[1], sys.argv[2], sys.argv[3]
stride, leak_check = int(sys.argv[4]), sys.argv[5] == "1"
SHORT = [9, 4, 17, 33, 2, 61, 8, 100, 27, 5]
LONG = [(5 * i + 1) % 128 for i in range(70)]
SCENARIO = [SHORT, LONG, SHORT]
N_GEN = 4
devices = dict(devices=["CPU", "CPU"], split_mode="tensor") if split == "tensor" else {}
model = load_model(path, load_mtp=True, **devices)

injected = []
@llama_cpp.llama_log_callback
def record(level, text, user_data):
    if b"injected failure" in text:
        injected.append(text.decode().strip())
llama_cpp.llama_log_set(record, ctypes.c_void_p(0))

def pair():
    target = new_context(model, n_ctx=256, n_batch=96, n_ubatch=32, n_rs_seq=3)
    draft = new_context(model, n_ctx=256, n_batch=96, n_ubatch=32, mtp=True)
    ws = Workspace(target, draft, mode=mode, n_decode_tokens=4)
    assert ws.shared
    engine = Engine(target, draft, draft_max=3)
    engine.generate = lambda prompt, n: engine.complete(prompt, n, stop_at_eog=False, cache_prompt=False)
    return target, draft, ws, engine

def figures(ws):
    return [[e.buffer_type, e.shared, e.alias, e.allocated, e.owner_need, e.borrower_need]
            for e in ws.stats()]

objs = pair()
ref = []
for prompt in SCENARIO:
    ref.append((objs[3].generate(prompt, N_GEN), figures(objs[2])))
for o in reversed(objs):
    o.close()

report = {"runs": [], "problems": [], "misses": []}
messages = set()

def fail_at(count, n):
    # the scenario with the n-th allocation failing (count=-1: and every one after it): reached?
    objs = pair()
    target, draft, ws, drafter = objs
    del injected[:]
    outcome = []
    inject_alloc_failure(n, count=count)
    for i, prompt in enumerate(SCENARIO):
        try:
            out = drafter.generate(prompt, N_GEN)
            outcome.append("ok" if out == ref[i][0] else "WRONG OUTPUT")
        except RuntimeError as e:  # -2 from a resize, or the output buffers not allocated
            outcome.append("exception")
            messages.add(str(e).split(" (")[0])
        except Exception as e:
            outcome.append("UNEXPECTED: %s: %s" % (type(e).__name__, e))
    inject_alloc_failure(0)
    hit = len(injected)
    if hit:
        for i, prompt in enumerate(SCENARIO):
            out = drafter.generate(prompt, N_GEN)
            if out != ref[i][0]:
                report["problems"].append([count, n, i, "retry output differs"])
            if figures(ws) != ref[i][1]:
                report["problems"].append([count, n, i, "accounting differs", figures(ws), ref[i][1]])
        report["runs"].append([count, n, hit, outcome])
        report["problems"] += [[count, n, o] for o in outcome if o not in ("ok", "exception")]
    else:
        report["misses"].append([count, n])
    for o in reversed(objs):
        o.close()
    return hit > 0

# The first n-1 allocations of a run are the fault-free run's, so the n-th is reached exactly when
# n <= last, the fault-free run's allocation count. Transient failures (count=1): every stride-th
# index from 1 until one is not reached, then a bisection of the gap finds the last one
# (stride 1: every index). Persistent ones (count=-1): the indices the first walk reached.
reached, n = [], 1
while n < 200 and fail_at(1, n):
    reached.append(n)
    n += stride
if n >= 200:
    report["problems"].append([1, "the scenario kept allocating"])
lo, hi = (reached or [0])[-1], n
while hi - lo > 1:
    mid = (lo + hi) // 2
    if fail_at(1, mid):
        reached.append(mid)
        lo = mid
    else:
        hi = mid
report["last"] = lo
for n in sorted(reached):
    if not fail_at(-1, n):
        report["problems"].append([-1, n, "reached once, not when every allocation from it fails"])
report["messages"] = sorted(messages)
if leak_check:  # LeakSanitizer, now that every pair is closed: a leaked block is unreachable
    import gc
    gc.collect()
    lsan = ctypes.CDLL(None)
    # the model is still open, its pointer held in a Python int (which LeakSanitizer cannot read):
    # a root, and what it reaches is not leaked
    lsan.__lsan_ignore_object(ctypes.c_void_p(model.model))
    # this module's frame object: made when a frame of a call from here outlived the call (a
    # request's exception kept its traceback until the engine was collected); the interpreter's
    # frame stack, which points to it, is mmap'd memory that LeakSanitizer does not scan
    lsan.__lsan_ignore_object(ctypes.c_void_p(id(sys._getframe())))
    report["lsan"] = lsan.__lsan_do_recoverable_leak_check()
print(json.dumps(report))
"""

CONFIGS = [("none", "alias"), ("tensor", "alias"), ("tensor", "private-meta")]
# make sanitize samples the indices (under the sanitizers every index would outrun CI's budget)
STRIDE_ENV = "LLAMA_METAWS_SWEEP_STRIDE"


@pytest.fixture(scope="module")
def mtp_path(models_dir):
    from llama_metaws_dev.testing import make_tiny_mtp_model

    return make_tiny_mtp_model(models_dir / "sweep-mtp.gguf", seed=7, agreement=0.75)


def _stride():
    """Every allocation index (1), or a sample: every stride-th and the last (make sanitize)."""
    value = os.environ.get(STRIDE_ENV, "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{STRIDE_ENV} must be a positive integer, not {value!r}")
    return int(value)


def _child_env():
    """The child's environment; under AddressSanitizer with LeakSanitizer's check on demand (the
    child calls it once its pairs are closed, not at exit) and Python's objects on malloc, where
    LeakSanitizer can follow pointers through them."""
    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    asan = "-fsanitize=address" in native_build.sanitizer_flags(
        runtime.require_build().manifest.get("cmake_args", ()))
    if asan:
        env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "") + ":detect_leaks=1:leak_check_at_exit=0"
        env["PYTHONMALLOC"] = "malloc"
    return env, asan


@pytest.mark.slow
@pytest.mark.parametrize("split,mode", CONFIGS, ids=[f"{s}-{m}" for s, m in CONFIGS])
def test_every_allocation_a_request_reaches_can_fail(mtp_path, split, mode):
    stride = _stride()
    env, leak_check = _child_env()
    res = subprocess.run([sys.executable, "-c", _CHILD, str(mtp_path), split, mode, str(stride),
                          "1" if leak_check else "0"],
                         capture_output=True, text=True, timeout=580, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert not report["problems"], report["problems"][:10]
    if leak_check:
        assert report["lsan"] == 0, res.stderr[-6000:]
    assert any("returned -2" in m for m in report["messages"]), report["messages"]
    last = report["last"]
    assert [1, last + 1] in report["misses"]  # the last index reached was found
    for count in (1, -1):
        runs = [r for r in report["runs"] if r[0] == count]
        indices = [r[1] for r in runs]
        assert len(runs) >= 3 and 1 in indices and last in indices, report["runs"]
        if stride == 1:
            assert sorted(indices) == list(range(1, last + 1))
        # a failure reached every request, and made at least one raise
        assert any("exception" in r[3] for r in runs), runs
    # a transient failure in the long request's grow is survived by the short one after it
    grow = [r[3][2] for r in report["runs"] if r[0] == 1 and r[3][1] == "exception"]
    assert grow and all(o == "ok" for o in grow), report["runs"]
