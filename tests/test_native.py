"""The cffi shim: devices, compute buffers, and check_error's exceptions."""

import pytest

from llama_metaws.native.shim import check_error, ffi, lib
from llama_metaws.engine.buffers import compute_buffers
from llama_metaws.engine.devices import DeviceList, find_device, list_devices
from llama_metaws.engine.contexts import load_model, new_context


def test_the_cpu_device_is_listed():
    devices = list_devices()
    cpu = [d for d in devices if d.name == "CPU"]
    assert len(cpu) == 1
    assert cpu[0].type == "cpu"
    assert cpu[0].memory_total > 0
    assert cpu[0].description


def test_an_unknown_device_lists_the_ones_there_are():
    with pytest.raises(ValueError, match=r"unknown device 'CUDA7'.*CPU"):
        find_device("CUDA7")


def test_the_same_device_twice_makes_a_two_device_list():
    dl = DeviceList(["CPU", "cpu"])
    assert len(dl) == 2 and dl.devices[0] == dl.devices[1]


def test_check_error_raises_the_shims_message():
    n = ffi.new("int *")
    with pytest.raises(ValueError, match="NULL context"):
        check_error(lib.lmws_n_compute_buffers(ffi.NULL, n))
    assert check_error(0) == 0


def test_compute_buffers_of_a_context(tiny_mtp_model):
    model = load_model(tiny_mtp_model, load_mtp=True)
    ctx = new_context(model, n_ctx=128, n_batch=32, n_rs_seq=1)
    try:
        bufs = compute_buffers(ctx)
        assert bufs, "a context has at least the CPU backend"
        assert all(b.size > 0 for b in bufs)
        assert bufs[0].buffer_type == "CPU"
        # an index past the end comes back as IndexError through check_error
        c = ffi.cast("struct llama_context *", ctx.ctx)
        info = ffi.new("struct lmws_compute_buffer *")
        with pytest.raises(IndexError, match="out of range"):
            check_error(lib.lmws_get_compute_buffer(c, len(bufs), info))
    finally:
        ctx.close()
        model.close()


def test_a_larger_ubatch_needs_a_larger_compute_buffer(tiny_mtp_model):
    model = load_model(tiny_mtp_model, load_mtp=True)
    sizes = []
    try:
        for n_batch in (16, 128):
            ctx = new_context(model, n_ctx=256, n_batch=n_batch, n_rs_seq=1)
            sizes.append(sum(b.size for b in compute_buffers(ctx)))
            ctx.close()
    finally:
        model.close()
    assert sizes[1] > sizes[0]


def test_an_mtp_draft_context_has_its_own_compute_buffers(tiny_mtp_model):
    model = load_model(tiny_mtp_model, load_mtp=True)
    target = new_context(model, n_ctx=128, n_batch=32, n_rs_seq=1)
    draft = new_context(model, n_ctx=128, n_batch=32, mtp=True)
    try:
        t = compute_buffers(target)
        d = compute_buffers(draft)
        assert sum(b.size for b in d) > 0
        # the draft's graph is the nextn layer only: smaller than the target's
        assert sum(b.size for b in d) < sum(b.size for b in t)
    finally:
        draft.close()
        target.close()
        model.close()


def test_a_closed_context_is_an_error_not_a_crash(tiny_mtp_model):
    model = load_model(tiny_mtp_model, load_mtp=True)
    ctx = new_context(model, n_ctx=128, n_batch=32, n_rs_seq=1)
    ctx.close()
    try:
        with pytest.raises(ValueError, match="NULL"):
            compute_buffers(ctx)
    finally:
        model.close()


def test_two_cpu_devices_with_layer_split_generate_like_one(tiny_mtp_model):
    from llama_metaws.engine.contexts import greedy_tokens

    outs = []
    for devices in (None, ["CPU", "CPU"]):
        model = load_model(tiny_mtp_model, devices=devices, split_mode="layer", load_mtp=True)
        ctx = new_context(model, n_ctx=128, n_batch=32, n_rs_seq=1)
        try:
            outs.append(greedy_tokens(ctx, [1, 2, 3, 4], 12))
        finally:
            ctx.close()
            model.close()
    assert outs[0] == outs[1]
