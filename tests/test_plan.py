"""The memory planner: llama.cpp's no_alloc figures equal what a loaded model allocates."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llama_metaws.tools import vram
from llama_metaws.tools.plan import PlanError, format_plan, plan, write_gguf_from_hf_config
from llama_metaws_dev.testing import make_tiny_mtp_model

ROOT = Path(__file__).resolve().parent.parent
CONFIG_27B = ROOT / "bench" / "qwen3.6-27b-config.json"
N_CTX, N_BATCH, N_UBATCH, NP = 512, 128, 64, 2


@pytest.fixture(scope="module")
def mtp_path(models_dir):
    return str(make_tiny_mtp_model(models_dir / "plan-mtp.gguf", agreement=0.8))


CASES = {
    # (devices, split mode): the harness's configurations, and the planner mode each one is
    (("CPU", "CPU"), "tensor"): [("no workspace (tensor)", "off"), ("private-meta (tensor)", "private-meta"),
                                 ("alias (tensor)", "alias")],
    (("CPU", "CPU"), "layer"): [("off (layer)", "off"), ("alias (layer)", "alias")],
    (("CPU",), "layer"): [("off (one device)", "off"), ("alias (one device)", "alias")],
}


@pytest.mark.parametrize("devices,split", list(CASES), ids=["tensor", "layer", "one-device"])
def test_compute_per_device_equals_the_harness_byte_for_byte(mtp_path, devices, split):
    configs = [vram.Configuration(name, split, mode if mode != "private-meta" else "private-meta")
               for name, mode in CASES[(devices, split)]]
    records = vram.run_configurations(configs, model=mtp_path, devices=devices, n_seq_max=NP, n_ctx=N_CTX,
                                      n_ubatch=N_UBATCH, n_batch=N_BATCH, n_predict=8, requests=1,
                                      progress=None)
    # our Llama leaves flash attention off unless the split is by tensor
    p = plan(mtp_path, devices=len(devices), split_mode=split, n_ctx=N_CTX, n_batch=N_BATCH,
             n_ubatch=N_UBATCH, n_seq_max=NP, flash_attn="auto" if split == "tensor" else "off")
    planned = {d.name for d in p.devices}
    for r, (_, mode) in zip(records, CASES[(devices, split)]):
        assert r["result"] == "ok", r["message"]
        measured = {k: v for k, v in r["peak"].items() if k not in ("weights", "kv", "rss")}
        assert set(measured) == planned, (r["name"], measured, planned)
        for key, peak in measured.items():
            assert p.device(key).compute[mode] == peak, (r["name"], key, p.device(key).compute, peak)
    if split == "tensor":  # the alias shares the meta buffer: the draft's meta compute is saved
        for key in ("CPU0", "CPU1"):
            d = p.device(key)
            assert d.compute["private-meta"] - d.compute["alias"] == d.draft_compute > 0


def test_kv_and_recurrent_add_up_to_the_loaded_contexts(mtp_path):
    """KV scales with -c, the recurrent state with -np; together what llama.cpp reports."""
    a = plan(mtp_path, n_ctx=512, n_seq_max=2, n_ubatch=64, n_batch=64)
    b = plan(mtp_path, n_ctx=1024, n_seq_max=2, n_ubatch=64, n_batch=64)
    c = plan(mtp_path, n_ctx=512, n_seq_max=1, n_ubatch=64, n_batch=64)
    da, db, dc = a.device("CPU"), b.device("CPU"), c.device("CPU")
    assert da.recurrent > 0 and db.recurrent == da.recurrent
    assert db.kv == 2 * da.kv  # cells double; nothing else in the KV cache
    assert dc.recurrent * 2 == da.recurrent  # one sequence's rows instead of two
    # tiny model: one attention layer of 2 KV heads x 128, f16 K and V, target + draft (nextn layer)
    assert da.kv == 2 * (512 * 2 * 128 * 2 * 2)
    no_mtp = plan(mtp_path, n_ctx=512, n_seq_max=2, n_ubatch=64, n_batch=64, mtp=False)
    d = no_mtp.device("CPU")
    assert d.draft_compute == 0 and d.compute["off"] == d.compute["alias"] == d.target_compute


def test_cache_types_and_no_kv_offload_reach_llama_cpp(mtp_path):
    f16 = plan(mtp_path, devices=2, split_mode="tensor", n_ctx=512, n_seq_max=2, n_ubatch=64, n_batch=64)
    q8 = plan(mtp_path, devices=2, split_mode="tensor", n_ctx=512, n_seq_max=2, n_ubatch=64, n_batch=64,
              cache_type_k="q8_0", cache_type_v="q8_0")
    assert 0 < q8.device("CPU0").kv < f16.device("CPU0").kv
    host = plan(mtp_path, devices=2, split_mode="tensor", n_ctx=512, n_seq_max=2, n_ubatch=64, n_batch=64,
                no_kv_offload=True)
    assert host.device("CPU").kv > 0 and host.device("CPU0").kv == 0
    # the KV caches in host memory, the recurrent state on the meta device (patches 0014-0016)
    assert host.device("CPU").kv == f16.device("CPU0").kv + f16.device("CPU1").kv
    assert host.device("CPU").recurrent == 0 and host.device("CPU0").recurrent == f16.device("CPU0").recurrent > 0


def _small_config(**text):
    cfg = json.loads(CONFIG_27B.read_text())
    cfg["text_config"].update(text)
    return cfg


def test_a_config_it_cannot_map_names_the_field(tmp_path):
    cfg = _small_config()
    del cfg["text_config"]["linear_num_value_heads"]
    with pytest.raises(PlanError, match="linear_num_value_heads"):
        plan(hf_config=cfg)
    cfg = _small_config(model_type="llama")
    with pytest.raises(PlanError, match="model_type 'llama'"):
        plan(hf_config=cfg)
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not a readable JSON config"):
        plan(hf_config=bad)


def test_the_cli_prints_a_table_and_json(mtp_path):
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "llama_metaws", "plan", "-m", mtp_path, "--devices", "2", "-sm", "tensor",
           "-ts", "0.55,0.45", "-c", "512", "-ub", "64", "-np", "2"]
    out = subprocess.run(cmd + ["--json"], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    names = [d["name"] for d in doc["devices"]]
    assert names == ["CPU0", "CPU1", "CPU"]
    for d in doc["devices"]:
        assert set(d["compute"]) == {"off", "private-meta", "alias"}
        assert all(isinstance(d[k], int) for k in ("weights", "kv", "recurrent"))
    assert doc["devices"][0]["weights"] > doc["devices"][1]["weights"]  # -ts 0.55,0.45
    table = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert table.returncode == 0 and "compute alias" in table.stdout and "CPU1" in table.stdout
    bad = subprocess.run(cmd[:6] + ["--devices", "1", "-sm", "tensor"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert bad.returncode == 2 and "--devices 2 or more" in bad.stderr


_CHILD = r"""
import json, resource, sys
def rchar():
    with open("/proc/self/io") as f:
        return int(next(l for l in f if l.startswith("rchar:")).split()[1])
import llama_metaws
from llama_metaws.tools.plan import plan
before = rchar()
p = plan(sys.argv[1], devices=2, split_mode="tensor", n_ctx=512, n_ubatch=64, n_seq_max=1, mtp=False)
print(json.dumps({"read": rchar() - before, "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "weights": p.model["size"]}))
"""


def test_a_20_gb_gguf_is_planned_without_reading_its_data(tmp_path):
    # a 16-layer cut of the 27B config in f16, grown to 20 GB: a header, then a hole
    path = write_gguf_from_hf_config(_small_config(num_hidden_layers=16, mtp_num_hidden_layers=0),
                                     tmp_path / "big.gguf", weight_type="f16")
    with open(path, "r+b") as f:
        f.truncate(20 * 2**30)
    assert os.path.getsize(path) == 20 * 2**30
    assert os.stat(path).st_blocks * 512 < 64 * 2**20  # sparse: the data was never written
    out = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["weights"] > 15 * 2**30  # llama.cpp saw the tensors of a big model
    assert r["read"] < 200 * 2**20, r  # ... and read the header only (vocab and tensor infos)
    assert r["maxrss"] < 2 * 2**30, r


def test_format_plan_shows_every_device_and_the_saving(mtp_path):
    p = plan(mtp_path, devices=["CUDA0", "CUDA1"], split_mode="tensor", n_ctx=512, n_ubatch=64, n_seq_max=2)
    text = format_plan(p)
    assert [d.name for d in p.devices] == ["CUDA0", "CUDA1", "CPU"]
    assert p.params["stand_in"] is True and any("stand-ins" in n for n in p.notes)
    assert "alias saves vs private-meta" in text and "CUDA1" in text


def test_a_qwen35_moe_config_with_mtp_is_planned():
    cfg = {"model_type": "qwen3_5_moe", "text_config": {
        "model_type": "qwen3_5_moe_text", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 2,
        "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 256, "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "mtp_num_hidden_layers": 1, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
        "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]}}}
    p = plan(hf_config=cfg, devices=2, split_mode="tensor", n_ctx=512, n_ubatch=64, n_seq_max=2, weight_type="f16")
    d = p.device("CPU0")
    assert d.draft_compute > 0 and d.recurrent > 0 and d.compute["alias"] < d.compute["off"]
    # 4 experts x (gate, up, down) of 256 x 256 in f16 per layer, 5 layers: most of the weights
    assert p.model["size"] > 5 * 4 * 3 * 256 * 256 * 2
    del cfg["text_config"]["num_experts_per_tok"]
    with pytest.raises(PlanError, match="num_experts_per_tok"):
        plan(hf_config=cfg)


CONFIGS = sorted((ROOT / "bench" / "configs").glob("*.json"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_each_family_config_is_planned_with_its_draft_and_the_workspace_saving(config):
    from llama_metaws.native.archs import NO_TENSOR_SPLIT_ARCHS
    from llama_metaws.tools.hf_config import hf_layout

    doc = json.loads(config.read_text())
    assert doc["_source"]["model"] and doc["_source"]["values"]  # where every value came from
    arch = hf_layout(doc).arch
    tensor = arch not in NO_TENSOR_SPLIT_ARCHS
    p = plan(hf_config=config, devices=2, split_mode="tensor" if tensor else "layer", n_ctx=4096, n_ubatch=512,
             n_seq_max=2)
    assert p.model["size"] > 10 * 2**30  # a real model's weights, none read
    d = p.device("CPU0" if tensor else "CPU")
    # the config's NextN block is loaded: the draft computes, and the workspace holds
    # max(target, draft) where two private schedulers hold the sum
    assert d.draft_compute > 0 and d.target_compute > 0
    assert d.compute["alias"] == max(d.target_compute, d.draft_compute) < d.compute["off"]
    assert d.compute["off"] == d.target_compute + d.draft_compute
    if tensor:  # the alias shares the meta compute buffer that private-meta keeps apart
        assert d.compute["private-meta"] == d.compute["off"]
    else:
        with pytest.raises(PlanError, match=f"no tensor split for architecture '{arch}'"):
            plan(hf_config=config, devices=2, split_mode="tensor")
