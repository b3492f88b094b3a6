"""The phase-aware workspace on one CPU device: identity, exact memory, fail-closed, teardown."""

import subprocess

import pytest

from llama_metaws.native import runtime
from llama_metaws.engine.contexts import greedy_tokens, load_model, new_context
from llama_metaws.engine.workspace import (
    Workspace,
    WorkspaceWarning,
    context_info,
    inject_alloc_failure,
    private_bytes,
)

N_CTX = 256
N_UBATCH = 32
DRAFT_MAX = 3
N_DECODE = DRAFT_MAX + 1
SHORT = [3, 14, 15, 92, 65]
LONG = [(7 * i + 3) % 128 for i in range(80)]  # longer than n_ubatch: several ubatches


from engines import Greedy
from engines import generate as _engine_generate


@pytest.fixture(scope="module")
def mtp_model(models_dir):
    from llama_metaws_dev.testing import make_tiny_mtp_model

    model = load_model(make_tiny_mtp_model(models_dir / "ws-mtp.gguf", seed=3, agreement=0.75),
                       load_mtp=True)
    yield model
    model.close()


def _pair(model):
    target = new_context(model, n_ctx=N_CTX, n_batch=128, n_ubatch=N_UBATCH, n_rs_seq=DRAFT_MAX + 1)
    draft = new_context(model, n_ctx=N_CTX, n_batch=128, n_ubatch=N_UBATCH, mtp=True)
    return target, draft


@pytest.fixture(scope="module")
def reference(mtp_model):
    """Greedy output of the target alone, no drafting, no workspace."""
    ctx = new_context(mtp_model, n_ctx=N_CTX, n_batch=128, n_ubatch=N_UBATCH, n_rs_seq=1)
    try:
        return {name: greedy_tokens(ctx, p, 24) for name, p in (("short", SHORT), ("long", LONG))}
    finally:
        ctx.close()


def _compute_entry(ws):
    """The shared entry of the device that computes the model: the one shared entry on the CPU
    test bed; on a GPU the pinned host buffer type (``CUDA_Host``, the CPU's compute buffer
    there) is shared too, and the GPU's entry is the one these tests follow."""
    shared = [e for e in ws.stats() if e.shared]
    on_gpu = [e for e in shared if e.device != "CPU" and not e.buffer_type.endswith("_Host")]
    (entry,) = on_gpu or shared
    return entry


def _generate(target, draft, prompt, n=24):
    return _engine_generate(target, draft, prompt, n, draft_max=DRAFT_MAX)


def test_shared_output_is_token_identical_over_several_requests(mtp_model, reference):
    target, draft = _pair(mtp_model)
    try:
        with Workspace(target, draft, n_decode_tokens=N_DECODE) as ws:
            assert ws.shared
            drafter = Greedy(target, draft, draft_max=DRAFT_MAX)
            for name in ("short", "long", "short", "long"):
                prompt = SHORT if name == "short" else LONG
                assert drafter.generate(prompt, 24) == reference[name], name
            assert drafter.total.drafted > 0 and drafter.total.accepted > 0
    finally:
        draft.close()
        target.close()


def test_shared_holds_the_maximum_private_holds_the_sum(mtp_model):
    sizes = {}
    for mode in ("off", "alias"):
        target, draft = _pair(mtp_model)
        try:
            ws = Workspace(target, draft, mode=mode, n_decode_tokens=N_DECODE)
            _generate(target, draft, LONG, 4)  # prompt phase, both contexts
            entries = ws.stats()
            if mode == "alias":
                entry = _compute_entry(ws)
                assert entry.allocated == max(entry.owner_need, entry.borrower_need) > 0
                assert entry.owner_need > 0 and entry.borrower_need > 0
                sizes[mode] = (entry.allocated, entry.owner_need, entry.borrower_need)
            else:
                assert not any(e.shared for e in entries)
                assert ws.allocated() == private_bytes(target) + private_bytes(draft)
                sizes[mode] = ws.allocated()
            ws.close()
        finally:
            draft.close()
            target.close()
    allocated, owner, borrower = sizes["alias"]
    assert allocated < sizes["off"]  # the point of sharing: less than target + draft


def test_decode_shrinks_and_the_next_prompt_grows(mtp_model):
    target, draft = _pair(mtp_model)
    try:
        ws = Workspace(target, draft, n_decode_tokens=N_DECODE)
        drafter = Greedy(target, draft, draft_max=DRAFT_MAX)
        drafter.generate(LONG, 16)  # ends in the decode phase
        after_decode = _compute_entry(ws)
        assert after_decode.n_shrink >= 1
        assert after_decode.allocated == max(after_decode.owner_need, after_decode.borrower_need)
        t_info, d_info = ws.info()
        assert t_info.n_phase_tokens == N_DECODE and d_info.n_phase_tokens == N_DECODE

        drafter.generate(LONG, 1)  # a long prompt again: prompt phase
        after_prompt = _compute_entry(ws)
        assert after_prompt.n_grow > after_decode.n_grow
        assert after_prompt.allocated > after_decode.allocated
        assert after_prompt.generation > after_decode.generation
        ws.close()
    finally:
        draft.close()
        target.close()


def test_the_generation_only_grows(mtp_model):
    target, draft = _pair(mtp_model)
    try:
        ws = Workspace(target, draft, n_decode_tokens=N_DECODE)
        drafter = Greedy(target, draft, draft_max=DRAFT_MAX)
        seen = []
        for prompt in (LONG, SHORT, LONG, SHORT):
            drafter.generate(prompt, 8)
            seen.append((context_info(target).generation, context_info(draft).generation))
        assert seen == sorted(seen) and seen[0] < seen[-1]
        assert context_info(target).n_rebuilds > 0  # the draft's resizes forced rebuilds
        ws.close()
    finally:
        draft.close()
        target.close()


def test_the_peer_is_synchronized_only_at_a_handoff_with_work_in_flight(mtp_model):
    import llama_cpp

    from llama_metaws.engine.batch import Batch

    target, draft = _pair(mtp_model)
    n_embd = llama_cpp.llama_model_n_embd_out(mtp_model.model)
    tb, db = Batch(8), Batch(8, n_embd)
    try:
        ws = Workspace(target, draft, n_decode_tokens=N_DECODE)

        def decode(ctx, batch, pos, rows=None):
            batch.clear()
            batch.add([5], pos, 0, True, rows)
            assert llama_cpp.llama_decode(ctx.ctx, batch.batch) == 0

        def syncs():
            return tuple(i.n_handoff_syncs for i in ws.info())

        import numpy as np

        decode(target, tb, 0)                        # target computes, nobody waits for it
        decode(draft, db, 0, rows=np.zeros((1, n_embd), np.float32))
        assert syncs() == (0, 1)                     # the draft's handoff synchronized the target
        llama_cpp.llama_synchronize(draft.ctx)       # the draft's work is done and read
        decode(target, tb, 1)
        assert syncs() == (0, 1)                     # nothing in flight: no synchronization
        decode(target, tb, 2)
        assert syncs() == (0, 1)                     # same context again: no handoff at all
        decode(draft, db, 1, rows=np.zeros((1, n_embd), np.float32))
        assert syncs() == (0, 2)
        ws.close()
    finally:
        draft.close()
        target.close()


def test_an_allocation_failure_during_a_grow_is_an_exception_and_a_retry_works(mtp_model, reference):
    target, draft = _pair(mtp_model)
    try:
        ws = Workspace(target, draft, n_decode_tokens=N_DECODE)
        drafter = Greedy(target, draft, draft_max=DRAFT_MAX)
        drafter.generate(SHORT, 8)  # decode phase: the entry is decode-sized
        inject_alloc_failure(1)     # the prompt phase's grow fails
        try:
            with pytest.raises(RuntimeError, match="returned -2"):
                drafter.generate(LONG, 24)
        finally:
            inject_alloc_failure(0)
        # fail-closed: the entry whose grow failed stays empty (the one shared entry on the CPU
        # test bed; on a GPU the pinned host entry may have grown before the GPU's failed)
        assert min(e.allocated for e in ws.stats() if e.shared) == 0
        assert drafter.generate(LONG, 24) == reference["long"]  # the retry succeeds
        assert drafter.generate(SHORT, 24) == reference["short"]
        ws.close()
    finally:
        draft.close()
        target.close()


@pytest.mark.parametrize("first", ["target", "draft"])
def test_teardown_in_either_order(mtp_model, reference, first):
    target, draft = _pair(mtp_model)
    ws = Workspace(target, draft, n_decode_tokens=N_DECODE)
    _generate(target, draft, LONG, 8)
    (target if first == "target" else draft).close()
    survivor = draft if first == "target" else target
    assert not context_info(survivor).paired  # back to private buffers
    ws.close()  # harmless once a context is gone

    # the survivor works on its own, and pairs again with a new peer
    if survivor is target:
        assert greedy_tokens(target, SHORT, 24) == reference["short"]
        new_target, draft = target, new_context(mtp_model, n_ctx=N_CTX, n_batch=128, n_ubatch=N_UBATCH, mtp=True)
    else:
        new_target = new_context(mtp_model, n_ctx=N_CTX, n_batch=128, n_ubatch=N_UBATCH, n_rs_seq=DRAFT_MAX + 1)
    with Workspace(new_target, draft, n_decode_tokens=N_DECODE) as ws2:
        assert ws2.shared
        assert _generate(new_target, draft, LONG) == reference["long"]
    draft.close()
    new_target.close()


def test_model_reload_and_attaching_the_draft_to_a_new_target(models_dir, reference):
    from llama_metaws_dev.testing import make_tiny_mtp_model

    path = make_tiny_mtp_model(models_dir / "ws-mtp.gguf", seed=3, agreement=0.75)
    for _ in range(2):  # load, use, free, load again
        model = load_model(path, load_mtp=True)
        target, draft = _pair(model)
        ws = Workspace(target, draft, n_decode_tokens=N_DECODE)
        assert _generate(target, draft, SHORT) == reference["short"]
        ws.close()
        target.close()
        new_target = new_context(model, n_ctx=N_CTX, n_batch=128, n_ubatch=N_UBATCH, n_rs_seq=DRAFT_MAX + 1)
        ws2 = Workspace(new_target, draft, n_decode_tokens=N_DECODE)
        assert ws2.shared
        assert _generate(new_target, draft, LONG) == reference["long"]
        ws2.close()
        draft.close()
        new_target.close()
        model.close()


def test_not_eligible_falls_back_to_private_with_a_warning(mtp_model, reference):
    target, draft = _pair(mtp_model)
    other_target, second_draft = _pair(mtp_model)
    try:
        ws = Workspace(target, draft, n_decode_tokens=N_DECODE)
        with pytest.warns(WorkspaceWarning):
            second = Workspace(target, second_draft, n_decode_tokens=N_DECODE)  # a second borrower
        assert not second.shared
        with pytest.warns(WorkspaceWarning):
            swapped = Workspace(draft, other_target, n_decode_tokens=N_DECODE)  # roles swapped
        assert not swapped.shared
        with pytest.warns(WorkspaceWarning):
            two_targets = Workspace(other_target, target, n_decode_tokens=N_DECODE)
        assert not two_targets.shared
        # the pair that did attach still works
        assert _generate(target, draft, SHORT) == reference["short"]
        ws.close()
    finally:
        for c in (second_draft, other_target, draft, target):
            c.close()


def test_a_closed_or_foreign_handle_is_an_exception(mtp_model):
    target, draft = _pair(mtp_model)
    draft.close()
    with pytest.raises(ValueError, match="draft context is closed"):
        Workspace(target, draft)
    with pytest.raises(ValueError, match="target context is closed or not a llama context"):
        Workspace("not a context", target)
    with pytest.raises(ValueError, match="mode"):
        Workspace(target, target, mode="sometimes")
    target.close()


def test_the_vendored_test_alloc_passes_against_the_patched_ggml(tmp_path):
    """tests/test-alloc.cpp of the patched tree (its new resizable cases included)."""
    b = runtime.require_build()
    exe = tmp_path / "test-alloc"
    subprocess.run(
        ["c++", "-std=c++17", "-O1", f"-I{b.src_dir / 'ggml' / 'include'}", f"-I{b.src_dir / 'ggml' / 'src'}",
         str(b.src_dir / "tests" / "test-alloc.cpp"), f"-L{b.lib_dir}", "-lggml-base", "-lggml",
         f"-Wl,-rpath,{b.lib_dir}", "-o", str(exe)],
        check=True, capture_output=True, text=True,
    )
    res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    for name in ("test_reallocation", "test_resizable_owner_borrower_maximum",
                 "test_resizable_shrink_waits_for_every_role", "test_resizable_fail_closed",
                 "test_resizable_failed_grow_falls_back", "test_resizable_reset_extras_stay_private",
                 "test_resizable_teardown(owner first)", "test_resizable_teardown(borrower first)",
                 "test_resizable_meta_alias", "test_resizable_meta_entry_unused",
                 "test_meta_alias_construction_throws"):
        assert f"{name} PASSED" in res.stdout, name
