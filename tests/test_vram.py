"""The memory harness: the sampler on CPU (exact ggml figures), on a fake NVML, and the table."""

import argparse
import json
import os
import sys
import threading
import time
import types

import pytest

from llama_metaws.tools import vram
from llama_metaws_dev.testing import make_tiny_mtp_model

PROMPT = [(7 * i + 3) % 120 for i in range(40)]


@pytest.fixture(scope="module")
def mtp_path(models_dir):
    return str(make_tiny_mtp_model(models_dir / "vram-mtp.gguf", agreement=0.8))


# --------------------------------------------------------------------------------------------
# CPU, in this process: the sampler's figures are ggml's


def _direct(llm):
    """Compute bytes per device read straight from ggml (a meta buffer on both CPU devices)."""
    from llama_metaws.engine.buffers import compute_buffers

    out = {}

    def add(device, size):
        for k in (["CPU0", "CPU1"] if device.startswith("Meta(") else [device]):
            out[k] = out.get(k, 0) + size

    if llm._workspace is None:
        for ctx in (llm._ctx, llm._draft_ctx):
            for b in compute_buffers(ctx):
                add(b.device, b.size)
    else:
        for e in llm.workspace_stats():  # a shared buffer is listed once
            add(e.device, e.allocated)
    return out


def _dedup(seq):
    out = []
    for x in seq:
        if not out or out[-1] != x:
            out.append(x)
    return out


@pytest.mark.parametrize("mode", ["off", "alias"])
def test_sampler_figures_are_ggml_accounting_at_every_decode(mtp_path, monkeypatch, mode):
    import llama_cpp
    import llama_cpp.llama_cpp as low

    from llama_metaws.api.llama import Llama

    # our own reading after every llama_decode, under the sampler's hook (installed later)
    readings, holder = [], {}
    for module in (low, llama_cpp):
        def decode(ctx, batch, _orig=module.llama_decode):
            rc = _orig(ctx, batch)
            if "llm" in holder:
                readings.append(_direct(holder["llm"]))
            return rc
        monkeypatch.setattr(module, "llama_decode", decode)

    llm = Llama(mtp_path, draft="mtp", devices=["CPU", "CPU"], split_mode="tensor", n_seq_max=2,
                n_ctx=256, n_batch=128, n_ubatch=64, phase_aware_workspace=mode != "off",
                workspace_mode="alias", verbose=False)
    # a fast background thread decoding alongside: it must not touch ggml's buffers
    sampler = vram.Sampler(interval=0.005).start()
    try:
        sampler.watch(llm)
        at_load = _direct(llm)
        holder["llm"] = llm
        for n in (24, 12):
            with sampler.phase("request"):
                gen = llm.generate(PROMPT, temp=0.0)
                for i, _ in enumerate(gen):
                    if i + 1 >= n:
                        break
                gen.close()
        assert len(readings) > 20
        del holder["llm"]
    finally:
        llm.close()  # unwatches by itself before the contexts go
    assert llama_cpp.llama_decode.__name__ == "decode"  # the sampler's wrapper is gone
    report = sampler.stop()

    keys = sorted(at_load)
    assert keys == ["CPU", "CPU0", "CPU1"]
    ggml = [{k: v[k] for k in keys} for _, v in report.timeline if "CPU0" in v]
    # the sampler's ggml states, in order, are exactly our readings at load and after each
    # decode (then zero once the Llama is closed; the thread may tick once more after that)
    closed = ggml.index({k: 0 for k in keys})
    assert all(g == {k: 0 for k in keys} for g in ggml[closed:])
    assert _dedup(ggml[:closed]) == _dedup([at_load] + readings)
    for k in keys:
        assert report.peak[k] == max(r[k] for r in [at_load] + readings)
    assert report.peak["weights"] > 0 and report.peak["kv"] > 0 and report.peak["rss"] > 0
    assert report.timer_samples >= 5
    assert [p["name"] for p in report.phases] == ["request", "request"]
    assert all(p["end"] > p["start"] for p in report.phases)


# --------------------------------------------------------------------------------------------
# the configurations, each in its subprocess, through the command


@pytest.fixture(scope="module")
def cli_run(mtp_path):
    p = vram.add_arguments(argparse.ArgumentParser())
    args = p.parse_args(["--json", "--model", mtp_path, "--interval", "0.05", "-n", "24"])
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = vram.run_from_args(args)
    return rc, json.loads(out.getvalue()), err.getvalue()


FIELDS = {"name", "result", "message", "tokens_per_s", "draft_acceptance", "peak", "timeline", "phases"}


def test_json_has_one_record_per_configuration(cli_run):
    rc, records, progress = cli_run
    assert rc == 0, records
    assert [r["name"] for r in records] == [c.name for c in vram.DEFAULT_CONFIGURATIONS]
    for r in records:
        assert FIELDS <= set(r), r.keys()
        assert r["timeline"] and all(len(s) == 2 and isinstance(s[1], dict) for s in r["timeline"])
        assert r["phases"] and r["phases"][0]["name"] == "load"
        assert "prompt" in {p["name"] for p in r["phases"]}
        if r["name"].startswith("unsafe-shared"):
            assert r["result"] == "assert"
            assert "GGML_ASSERT(tensor) failed" in r["message"]
            assert r["tokens_per_s"] is None
        else:
            assert r["result"] == "ok", r["message"]
            assert r["tokens_per_s"] > 0 and 0 < r["draft_acceptance"] <= 1
            assert {"prompt", "decode"} <= {p["name"] for p in r["phases"]}
        devices = {"CPU"} if "(layer)" in r["name"] else {"CPU", "CPU0", "CPU1"}
        assert devices <= set(r["peak"]) and all(r["peak"][d] > 0 for d in devices)
    assert "[5/5] alias (layer)" in progress
    table = vram.format_table(records)
    assert "unsafe-shared (tensor)" in table and "GGML_ASSERT(tensor)" in table
    assert "peak compute CPU0" in table


def test_alias_saves_exactly_the_drafts_compute_per_device(cli_run):
    _, records, _ = cli_run
    by = {r["name"]: r for r in records}
    off, pm, al = by["no workspace (tensor)"], by["private-meta (tensor)"], by["alias (tensor)"]
    # The draft's meta compute requirement: in "no workspace" the draft keeps a private meta
    # buffer reserved once, for a prompt-sized ubatch, and never resized.
    draft_need = next(b["size"] for b in off["snapshot"]["draft"] if b["device"].startswith("Meta("))
    meta = next(e for e in al["snapshot"]["workspace"] if e["device"].startswith("Meta("))
    assert meta["shared"] and meta["alias"] and meta["borrower_need"] == draft_need
    # private-meta: target and draft each keep a private meta buffer; after load and at every
    # prompt both are prompt-sized at once, so the peak is owner_need + borrower_need at the
    # prompt phase. alias: the draft computes in the target's meta buffer through the alias,
    # sized max(owner, borrower) = the target's prompt requirement. The difference, on each
    # device of the meta device, is the draft's own prompt-phase requirement, to the byte.
    for dev in ("CPU0", "CPU1"):
        assert al["peak"][dev] == meta["owner_need"]
        assert pm["peak"][dev] - al["peak"][dev] == draft_need > 0
    # the host CPU buffer is shared in both modes
    assert pm["peak"]["CPU"] == al["peak"]["CPU"]


# --------------------------------------------------------------------------------------------
# NVIDIA, with a fake pynvml


class FakeNVML(types.ModuleType):
    """pynvml's calls the sampler makes; device 0's usage climbs, device 1's is flat."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    def __init__(self, n=2, lose=None, drop_after=None):
        super().__init__("pynvml")
        self.n, self.lose, self.drop_after = n, lose, drop_after
        self.reads = {i: [] for i in range(n)}
        self.counts = 0
        self.shut = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        self.counts += 1
        if self.drop_after is not None and self.counts > self.drop_after:
            return self.n - 1
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetName(self, h):
        return b"Fake H200"

    def nvmlDeviceGetMemoryInfo(self, h):
        i = h[1]
        if self.lose is not None and i == self.lose[0] and len(self.reads[i]) >= self.lose[1]:
            raise self.NVMLError("GPU is lost")
        used = (1000 + 100 * min(len(self.reads[i]), 10)) * 2**20 if i == 0 else 5000 * 2**20
        self.reads[i].append(used)
        return types.SimpleNamespace(used=used, total=80000 * 2**20, free=80000 * 2**20 - used)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        if h[1] == 1:
            raise self.NVMLError_NotSupported("not supported")
        return [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=700 * 2**20),
                types.SimpleNamespace(pid=1, usedGpuMemory=123)]


def _wait_for_reads(fake, n, limit_s=60.0):
    """Until the sampling thread has read device 0 ``n`` times (the limit only catches a hang)."""
    deadline = time.monotonic() + limit_s
    while len(fake.reads[0]) < n:
        assert time.monotonic() < deadline, f"the sampler read {len(fake.reads[0])} times, not {n}"
        time.sleep(0.01)


def test_nvml_cadence_and_per_device_peaks(monkeypatch):
    fake = FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    interval = 0.02
    sampler = vram.Sampler(interval=interval, nvidia=True).start()
    sampler.mark("prompt")
    _wait_for_reads(fake, 6)
    sampler.mark("decode")
    _wait_for_reads(fake, 12)  # device 0's usage stops climbing at its 11th read
    report = sampler.stop()
    assert report.timer_samples >= 12
    assert len(fake.reads[0]) == report.timer_samples  # every tick read every device
    assert report.peak["nvml:0"] == max(fake.reads[0]) == 2000 * 2**20
    assert report.peak["nvml:1"] == 5000 * 2**20
    assert report.peak["nvml:0:self"] == 700 * 2**20  # our pid only
    assert "nvml:1:self" not in report.peak
    assert any("GPU1" in n and "per-process" in n for n in report.notes)
    assert report.labels["nvml:0"] == "GPU0 (Fake H200)"
    ts = [t for t, _ in report.timeline]
    assert ts == sorted(ts)
    # the cadence: ticks on a grid of the interval from the start, never ahead of it (a busy machine
    # skips ticks, it never bursts), so the k-th comes at least k intervals after the start
    assert all(t >= k * interval * (1 - 1e-6) for k, t in enumerate(ts)), ts
    assert [p["name"] for p in report.phases] == ["prompt", "decode"]
    assert fake.shut


@pytest.mark.parametrize("how", ["handle error", "count drops"])
def test_a_device_that_disappears_gives_a_clear_error(monkeypatch, how):
    fake = FakeNVML(lose=(1, 3)) if how == "handle error" else FakeNVML(drop_after=4)  # a count at start, 3 reads
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = vram.Sampler(interval=0.01, nvidia=True).start()
    deadline = time.monotonic() + 60  # a hang detector
    while sampler.error is None:
        assert time.monotonic() < deadline, "the lost device was never noticed"
        time.sleep(0.01)
    # the failure ended the sampling thread by itself: stop() finds it gone, it does not wait for it
    for thread in threading.enumerate():
        if thread.name == "llama-metaws-vram":
            thread.join(60)
            assert not thread.is_alive(), "the sampling thread went on after its source failed"
    with pytest.raises(vram.SamplerError) as info:
        sampler.stop()
    msg = str(info.value)
    assert "did not stop" not in msg
    assert "GPU1 (Fake H200)" in msg and "disappeared" in msg
    assert "GPU0" not in msg
    # what came before is kept, and no zero was made up for the lost device
    report = info.value.report
    assert report.timer_samples == 3 and all(v["nvml:1"] == 5000 * 2**20 for _, v in report.timeline)
    with pytest.raises(vram.SamplerError):
        sampler.report()


def test_missing_extras_say_which_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(vram.MissingExtraError, match=r"llama-metaws\[nvidia\]"):
        vram.Sampler(nvidia=True).start()
    assert vram.main(["--nvidia"]) == 2
    assert "nvidia extra" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(vram.MissingExtraError, match=r"llama-metaws\[plot\]"):
        vram.plot([], tmp_path / "x.png")


def test_plot_writes_a_png(cli_run, tmp_path):
    pytest.importorskip("matplotlib")
    path = vram.plot(cli_run[1], tmp_path / "vram.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_configuration_names_and_bad_input():
    assert vram.find_configuration("alias-tensor").name == "alias (tensor)"
    assert vram.find_configuration("unsafe-shared (tensor)").expected == "assert"
    with pytest.raises(ValueError, match="choose from"):
        vram.find_configuration("shared")
    with pytest.raises(ValueError):
        vram.Sampler(interval=0)


def test_rss_and_concurrent_marks():
    assert vram.read_rss() > 1 << 20
    sampler = vram.Sampler(interval=0.005).start()

    def marks():
        for i in range(50):
            sampler.mark(f"p{i}")

    threads = [threading.Thread(target=marks) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report = sampler.stop()
    assert len(report.phases) == 100 and all(p["end"] is not None for p in report.phases)
    assert report.peak["rss"] > 1 << 20
