"""The GPU run kit's real-shape step (``llama_metaws_dev.sidebyside``): its shapes, its layer
choice, its rows on the CPU at the small shape, llama-server's command and log, its table.

llama-server's rows run where ``llama-metaws build --tools`` has built it (the kit's dry run,
``make gpu-kit-dry-run``, runs every row from the kit alone).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llama_metaws_dev import tools_build
from llama_metaws_dev.sidebyside import report, server, shapes, step

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20
#: Smaller than the dry run's (whose width lets two devices split it): for what loads no model.
TINY = shapes.Shape("tiny", n_vocab=512, n_embd=256, n_ff=256, max_layers=4)


def test_the_real_shape_is_the_seeds_family_at_qwen36_27bs_width_ffn_and_vocabulary():
    cfg = json.loads((ROOT / "bench" / "qwen3.6-27b-config.json").read_text())["text_config"]
    real = shapes.REAL
    assert (real.n_embd, real.n_ff, real.n_vocab, real.max_layers) == (
        cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"])
    assert all(n % 4 == 0 for n in shapes.LADDER)  # make_mtp_model's layer pattern


def test_the_estimate_is_the_written_file_within_its_metadata(tmp_path):
    for dtype in ("q8_0", "f16"):
        path = shapes.write_model(tmp_path, TINY, 4, dtype)
        assert path.parent == tmp_path / "models"
        size = path.stat().st_size
        est = shapes.estimated_bytes(TINY, 4, dtype)
        assert abs(size - est) / size < 0.02, (dtype, size, est)
    # a second write with the same arguments is the cached file, not written again
    before = path.stat().st_mtime_ns
    again = shapes.write_model(tmp_path, TINY, 4, "f16")
    assert again == path and again.stat().st_mtime_ns == before
    # and at the real shape, 4 layers: the two vocabulary matrices dominate
    assert 4.3e9 < shapes.estimated_bytes(shapes.REAL, 4) < 5.0e9
    assert 27e9 < shapes.estimated_bytes(shapes.REAL, 64) < 30e9  # a 27B model at q8_0


def test_the_layer_count_follows_the_budget_the_memory_and_the_disk():
    real, tokens = shapes.REAL, 3 * 128
    many = shapes.choose_layers(real, 10_000, n_configs=6, tokens=tokens)
    assert many["n_layer"] == 64 and not many["why"]
    fewer = shapes.choose_layers(real, 250, n_configs=6, tokens=tokens)
    assert 4 <= fewer["n_layer"] < 64 and fewer["estimate_s"] <= 0.6 * 250
    assert shapes.choose_layers(real, 1000, n_configs=6, tokens=tokens)["n_layer"] >= fewer["n_layer"]
    # a smaller GPU: the weights with room to spare
    gpu = shapes.choose_layers(real, 10_000, n_configs=6, tokens=tokens, free_bytes=20 * 2**30)
    assert gpu["bytes"] * 1.25 + 4 * 2**30 <= 20 * 2**30 and gpu["n_layer"] < 64
    assert "GiB free" in gpu["why"][0]
    disk = shapes.choose_layers(real, 10_000, n_configs=6, tokens=tokens, free_disk=12 * 2**30)
    assert disk["bytes"] * 1.1 <= 12 * 2**30 and "on disk" in disk["why"][0]
    # not even the smallest fits the time: the smallest anyway, said to be over the budget
    over = shapes.choose_layers(real, 10, n_configs=6, tokens=tokens)
    assert over["n_layer"] == 4 and over["over_budget"]
    # nothing fits the memory: none
    assert shapes.choose_layers(real, 10_000, n_configs=6, tokens=tokens, free_bytes=2**30)["n_layer"] == 0


LOG = """\
llama_context: constructing llama_context
sched_reserve: Meta(CUDA0,CUDA0) compute buffer size =   100.00 MiB
sched_reserve:  CUDA_Host compute buffer size =    20.00 MiB
sched_reserve: Meta(CUDA0,CUDA0) compute buffer size =   130.50 MiB
sched_reserve:  CUDA_Host compute buffer size =    28.00 MiB
llama_context: constructing llama_context
sched_reserve: Meta(CUDA0,CUDA0) compute buffer size =   130.50 MiB
sched_reserve:  CUDA_Host compute buffer size =    28.00 MiB
"""


def test_llama_servers_compute_is_each_contexts_last_reservation_on_every_device():
    got = server.compute_from_log(LOG, ["CUDA0", "CUDA0"])
    per = int(round(130.5 * MiB))
    assert got == {"CUDA00": 2 * per, "CUDA01": 2 * per, "CUDA_Host": 2 * 28 * MiB}
    # two GPUs: each gets the meta buffer's size
    two = server.compute_from_log(LOG.replace("CUDA0,CUDA0", "CUDA0,CUDA1"), ["CUDA0", "CUDA1"])
    assert two["CUDA0"] == two["CUDA1"] == 2 * per
    assert server.compute_from_log("no reservation here\n", ["CUDA0"]) == {}


def test_llama_servers_command_matches_ours():
    kw = dict(model="m.gguf", port=8080, n_ctx=16384, n_batch=512, n_ubatch=512, n_parallel=2, draft_max=3)
    mtp = server.ServerConfiguration("s", draft=True)
    cmd = server.server_command("llama-server", mtp, devices=["CUDA0", "CUDA0"], synth_len=3.25, **kw)
    text = " ".join(cmd)
    for part in ("--device CUDA0,CUDA0", "-sm tensor", "-ngl 999", "--spec-type draft-mtp", "--spec-draft-n-max 3",
                 "--spec-synth-len 3.25", "-c 16384", "-ub 512", "-np 2", "-fa on", "--fit off"):
        assert part in text, part
    plain = server.server_command("llama-server", server.ServerConfiguration("p", draft=False),
                                  devices=["CUDA0", "CUDA1"], synth_len=None, **kw)
    assert "--spec-type" not in plain and "--spec-synth-len" not in plain
    cpu = server.server_command("llama-server", mtp, devices=["CPU", "CPU"], synth_len=3.25, **kw)
    assert "--device" not in cpu and cpu[cpu.index("-ngl") + 1] == "0"  # llama-server refuses CPU devices


def test_the_synthetic_acceptance_length_accepts_the_seeds_share_of_each_draft():
    from llama_metaws.engine import synthetic

    s = step.Settings(work=Path("."), out=Path("x.json"), devices=["CPU"], shape=shapes.SMALL)
    assert s.acceptance == 0.75 and s.synth_len == pytest.approx(3.25)
    rates = synthetic.resolve(None, s.synth_len, s.draft_max)
    assert sum(rates) / s.draft_max == pytest.approx(0.75, abs=1e-6)  # expected accepted per drafted


def _settings(tmp_path, **kw):
    base = dict(work=tmp_path / "work", out=tmp_path / "out" / "realshape.json", devices=["CPU", "CPU"],
                shape=shapes.SMALL, n_layer=4, n_predict=32, requests=1, warmup=1, n_ctx=512, n_ubatch=64)
    base.update(kw)
    return step.Settings(**base)


def test_our_rows_run_side_by_side_on_the_cpu(tmp_path):
    s = _settings(tmp_path, rows=["alias (tensor)", "no drafting (tensor)", "llama-server draft-mtp (tensor)"],
                  server=tmp_path / "no-such-llama-server")
    lines = []
    doc = step.run_step(s, lines.append)
    assert json.loads(s.out.read_text())["records"] == json.loads(json.dumps(doc["records"]))
    alias, plain, srv = doc["records"]
    assert alias["result"] == plain["result"] == "ok", (alias["message"], plain["message"])
    assert alias["tokens_per_s"] > 0 and plain["tokens_per_s"] > 0
    assert 0.0 < alias["draft_acceptance"] <= 1.0 and plain["draft_acceptance"] is None
    assert set(alias["compute"]) >= {"CPU0", "CPU1"} and alias["compute"]["CPU0"] > 0
    assert "timeline" not in alias
    # a llama-server that does not start is that row's error; the step goes on and says so
    assert srv["result"] == "error" and "did not start" in srv["message"]
    assert doc["ok"] is False and doc["model"]["bytes"] > 0
    assert "alias (tensor)" in doc["table"] and "ours, draft-mtp (alias) / no drafting" in doc["table"]


def test_rows_past_the_deadline_are_cut_and_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(step, "MIN_ROW_S", 1e9)  # no row has enough time left
    s = _settings(tmp_path, budget_s=60, shape=TINY)
    doc = step.run_step(s, lambda line: None)
    assert [r["result"] for r in doc["records"]] == ["cut"] * len(step.ROWS)
    assert doc["cut"] == [r.name for r in step.ROWS] and not doc["ok"]
    assert "cut: " in doc["table"] and json.loads(s.out.read_text())["cut"] == doc["cut"]


@pytest.mark.skipif(tools_build.find_tools() is None, reason="no llama-server built (llama-metaws build --tools); "
                    "make gpu-kit-dry-run runs it from the kit")
def test_llama_servers_rows_run_at_the_same_synthetic_acceptance(tmp_path):
    s = _settings(tmp_path, rows=["llama-server draft-mtp (tensor)", "llama-server no drafting (tensor)"])
    doc = step.run_step(s, lambda line: None)
    mtp, plain = doc["records"]
    assert mtp["result"] == plain["result"] == "ok", (mtp["message"], plain["message"])
    assert 0.0 < mtp["draft_acceptance"] <= 1.0 and plain["draft_acceptance"] is None
    assert "--spec-synth-len" in mtp["command"] and mtp["compute"] and mtp["peak"]["rss"] > 0


def test_the_findings_set_each_ratio_beside_the_seeds():
    def rec(name, tps, compute, nvml=None):
        peak = {"rss": 1}
        peak.update(nvml or {})
        return {"name": name, "result": "ok", "tokens_per_s": tps, "draft_acceptance": 0.75 if "no" not in name else None,
                "compute": compute, "peak": peak, "seconds": 1.0}

    doc = {"records": [
        rec("alias (tensor)", 96.0, {"CUDA00": 300 * MiB, "CUDA01": 300 * MiB}, {"nvml:0": 9000 * MiB}),
        rec("private-meta (tensor)", 95.0, {"CUDA00": 430 * MiB, "CUDA01": 430 * MiB}, {"nvml:0": 9260 * MiB}),
        rec("no drafting (tensor)", 60.0, {"CUDA00": 150 * MiB, "CUDA01": 150 * MiB}),
        rec("llama-server draft-mtp (tensor)", 90.0, {"CUDA00": 430 * MiB, "CUDA01": 430 * MiB}),
        rec("llama-server no drafting (tensor)", 62.0, {"CUDA00": 150 * MiB, "CUDA01": 150 * MiB}),
        rec("alias (layer)", 88.0, {"CUDA0": 400 * MiB}),
    ], "shape": {"name": "qwen3.6-27b", "n_vocab": 248320, "n_embd": 5120, "n_ff": 17408}, "n_layer": 16,
        "dtype": "q8_0", "devices": ["CUDA0", "CUDA0"], "synth_len": 3.25, "acceptance": 0.75, "budget_s": 200,
        "settings": {"n_ctx": 16384, "n_ubatch": 512, "n_parallel": 2, "draft_max": 3, "warmup": 1, "requests": 2,
                     "prompt_tokens": 64, "n_predict": 128}, "model": {"bytes": 9 * 2**30, "seconds": 12.0}}
    found = "\n".join(report.findings(doc))
    assert "CUDA00 130.0 MiB, CUDA01 130.0 MiB; NVML peak: nvml:0 260 MiB (the seed: 130 MiB per GPU, docs/gpu-kit.md" in found
    assert "alias / private meta buffers: 1.011 (the seed: 1.015)" in found
    assert "layer split / tensor split (alias): 0.917 (the seed: 0.915)" in found
    assert "ours, draft-mtp (alias) / no drafting: 1.600" in found
    assert "llama-server, draft-mtp / no drafting: 1.452" in found
    assert "draft-mtp, ours (alias) / llama-server: 1.067" in found
    assert "all devices: ours (alias) 600.0 MiB, llama-server 860.0 MiB" in found
    assert "llama-server's less ours: CUDA00 130.0 MiB, CUDA01 130.0 MiB." in found
    md = report.format_markdown(doc)
    assert "| alias (tensor) | ok | 96.0 | 75.0% | 300.0 | 300.0 | - | 9,000.0 | 0.0 | 1 |" in md
    assert "16 layers + 1 NextN" in md and "--spec-synth-len 3.25 (75% acceptance)" in md


def test_the_step_refuses_bad_arguments():
    for bad in (["--layers", "6"], ["--acceptance", "1.5"], ["-n", "0"]):
        res = subprocess.run([sys.executable, "-m", "llama_metaws_dev.sidebyside", "--work", "w", "--out", "o.json",
                              "-dev", "CPU,CPU", *bad], capture_output=True, text=True)
        assert res.returncode == 2 and "sidebyside:" in res.stderr, (bad, res.stderr)
