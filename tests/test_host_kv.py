"""Host-resident KV under tensor split (``offload_kqv=False``, llama.cpp's ``-nkvo``; patches 0014-0016).

The target's and the MTP draft's KV caches stay in host memory, each device of the split works on
its own KV heads of them in place, the recurrent state stays on the meta device. Every run that
could abort is a child process; a child reports JSON on its last stdout line.
"""

import json
import subprocess
import sys
import types

import pytest

from llama_metaws.tools.children import child_env
from llama_metaws.engine.devices import check_tensor_split
from llama_metaws_dev.testing import EOS_TOKEN, make_tiny_mtp_model, split_devices

N_CTX, N_UBATCH, N_PREDICT = 256, 16, 12
# several requests in a row: shorter than n_ubatch, across several ubatches, between
PROMPTS = [[5, 9, 3, 77], [(7 * i + 3) % EOS_TOKEN for i in range(45)], [(11 * i + 5) % EOS_TOKEN for i in range(20)]]

CHILD = r"""
import json, sys
import llama_metaws
from llama_metaws import Llama
from llama_metaws.tools.plan import memory_breakdown

a = json.loads(sys.argv[1])

def run(devices, draft, **kw):
    extra = dict(draft="mtp", draft_max=3, workspace_mode=a["mode"]) if draft else {}
    llm = Llama(a["model"], devices=devices, n_ctx=a["n_ctx"], n_batch=64, n_ubatch=a["n_ubatch"],
                use_mmap=a["mmap"], verbose=False, **extra, **kw)
    try:
        out = {"greedy": [llm.create_completion(p, max_tokens=a["n"], temperature=0.0)["choices"][0]["text"]
                          for p in a["prompts"]]}
        if draft:
            out["sampled"] = llm.create_completion(a["prompts"][1], max_tokens=a["n"], temperature=1.0, top_k=0,
                                                   top_p=1.0, min_p=0.0, seed=1234)["choices"][0]["text"]
            out["drafted"] = [llm.draft_stats.total.drafted, llm.draft_stats.total.accepted]
        if len(devices) > 1:
            mem = memory_breakdown(llm._ctx).values()
            out["kv_host"] = sum(e["context"] for e in mem if e["host"])
            out["recurrent_meta"] = sum(e["context"] for e in mem if e["meta"] and not e["host"])
            if draft:
                out["draft_kv_host"] = sum(e["context"] for e in memory_breakdown(llm._draft_ctx).values() if e["host"])
        return out
    finally:
        llm.close()

split = ["CPU"] * a["n_devices"]
res = {"one": run(["CPU"], True),
       "split": run(split, True, split_mode="tensor", offload_kqv=False),
       "split_plain": run(split, False, split_mode="tensor", offload_kqv=False)}
print(json.dumps(res))
"""

TEARDOWN_CHILD = r"""
import json, sys
import llama_metaws
from llama_metaws.engine.contexts import greedy_tokens, load_model, new_context
from llama_metaws.engine.core import Engine
from llama_metaws.engine.workspace import Workspace

a = json.loads(sys.argv[1])
prompt = a["prompts"][1]
one = load_model(a["model"], load_mtp=True)
ref_ctx = new_context(one, n_ctx=256, n_batch=64, n_ubatch=16, n_rs_seq=1)
ref = greedy_tokens(ref_ctx, prompt, 12)
ref_ctx.close()
model = load_model(a["model"], devices=["CPU", "CPU"], split_mode="tensor", load_mtp=True)
target = new_context(model, n_ctx=256, n_batch=64, n_ubatch=16, n_rs_seq=3, offload_kqv=False)
draft = new_context(model, n_ctx=256, n_batch=64, n_ubatch=16, mtp=True, offload_kqv=False)
ws = Workspace(target, draft, n_decode_tokens=4)
drafted = Engine(target, draft, draft_max=3).complete(prompt, 12, stop_at_eog=False)
(target if a["first"] == "target" else draft).close()
ws.close()
survivor = draft if a["first"] == "target" else target
again = greedy_tokens(target, prompt, 12) if survivor is target else None
survivor.close()
model.close()
one.close()
print(json.dumps({"ref": ref, "drafted": drafted, "again": again}))
"""


def _child(script: str, args: dict, timeout: float = 240) -> dict:
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(args)], capture_output=True, text=True,
                          timeout=timeout, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def agreement_model(models_dir):
    return make_tiny_mtp_model(models_dir / "host-kv-agreement.gguf", agreement=0.75)


@pytest.mark.parametrize("n_devices,mode,mmap", [(2, "alias", True), (3, "alias", False),
                                                 (2, "private-meta", False), (3, "private-meta", True)])
def test_host_kv_under_tensor_split_equals_one_device(agreement_model, n_devices, mode, mmap):
    res = _child(CHILD, dict(model=str(agreement_model), n_devices=n_devices, mode=mode, mmap=mmap,
                             prompts=PROMPTS, n=N_PREDICT, n_ctx=N_CTX, n_ubatch=N_UBATCH))
    one, split, plain = res["one"], res["split"], res["split_plain"]
    assert all(len(t) > 0 for t in one["greedy"])
    assert split["greedy"] == one["greedy"]          # with MTP drafting, the workspace in `mode`
    assert plain["greedy"] == one["greedy"]          # without drafting
    assert split["sampled"] == one["sampled"]        # a seeded sampled request
    # the draft head computes on its host KV as on one device: the same drafts, the same verdicts
    assert split["drafted"] == one["drafted"] and one["drafted"][1] > 0
    # the configuration is the one under test: the KV caches in host memory, the state on Meta
    kv = 2 * N_CTX * 256 * 2  # K and V of one attention layer: n_ctx x (2 heads x 128) in f16
    assert split["kv_host"] == plain["kv_host"] == kv
    assert split["draft_kv_host"] == kv              # the nextn layer's
    assert split["recurrent_meta"] > 0 and plain["recurrent_meta"] > 0


@pytest.mark.parametrize("first", ["target", "draft"])
def test_host_kv_teardown_in_either_order(agreement_model, first):
    res = _child(TEARDOWN_CHILD, dict(model=str(agreement_model), prompts=PROMPTS, first=first))
    assert res["drafted"] == res["ref"]
    if first == "draft":
        assert res["again"] == res["ref"]  # the target goes on alone


def test_the_host_kv_table_from_the_vram_command(agreement_model, capsys):
    from llama_metaws.tools.vram.command import main

    n_ctx, n_predict = 256, 16
    rc = main(["--host-kv", "--json", "-m", str(agreement_model), "-dev", ",".join(split_devices(2)),
               "-c", str(n_ctx), "-n", str(n_predict), "-ub", "32", "-np", "1"])
    record = json.loads(capsys.readouterr().out)
    assert rc == 0 and record["result"] == "ok", record
    kv = 2 * n_ctx * 256 * 2  # ggml's accounting equals the K and V tensors' bytes, per buffer type
    assert record["memory"]["target KV"] == {"CPU_Meta_Host": kv}
    assert record["memory"]["draft KV"] == {"CPU_Meta_Host": kv}
    ((buft, recurrent),) = record["memory"]["recurrent state"].items()
    assert buft.startswith("Meta") and recurrent > 0
    short, near, follow = record["requests"]
    assert near["prompt_tokens"] > n_ctx - n_predict - 8 and short["prompt_tokens"] < near["prompt_tokens"]
    for r in (short, near, follow):
        assert r["result"] == "ok" and r["completion_tokens"] == n_predict
        assert r["tokens_per_s"] > 0 and r["prompt_tokens_per_s"] > 0 and 0 < r["draft_acceptance"] <= 1


def _devices(*types_):
    return types.SimpleNamespace(devices=[types.SimpleNamespace(name=f"DEV{i}", type=t) for i, t in enumerate(types_)])


def test_host_kv_on_devices_that_cannot_use_host_memory_is_refused():
    for devs in (_devices("gpu", "gpu"), _devices("cpu", "gpu")):
        with pytest.raises(ValueError, match="offload_kqv=True.*split_mode='layer'"):
            check_tensor_split(devs, {"offload_kqv": False})
        kw = {}
        check_tensor_split(devs, kw)  # the KV on the devices is fine
        assert kw["flash_attn"] is True
    check_tensor_split(_devices("cpu", "cpu"), {"offload_kqv": False})


def test_no_kv_offload_flag_is_offload_kqv_false():
    import argparse

    from llama_metaws.cli.flags import add_model_flags, llama_kwargs

    p = argparse.ArgumentParser()
    add_model_flags(p)
    assert llama_kwargs(p.parse_args(["-m", "x.gguf"]))["offload_kqv"] is True
    for flag in ("-nkvo", "--no-kv-offload"):
        assert llama_kwargs(p.parse_args(["-m", "x.gguf", flag]))["offload_kqv"] is False


def test_generate_with_no_kv_offload_under_tensor_split(agreement_model):
    base = [sys.executable, "-m", "llama_metaws", "generate", "-m", str(agreement_model), "--device", "CPU,CPU",
            "-sm", "tensor", "--spec-type", "draft-mtp", "--phase-aware-workspace", "-c", "256", "-ub", "16",
            "-p", "1f 2a 3b 4c", "-n", "16"]
    outs = []
    for extra in ([], ["-nkvo"]):
        res = subprocess.run(base + extra, capture_output=True, text=True, timeout=240, env=child_env())
        assert res.returncode == 0, res.stderr[-2000:]
        outs.append(res.stdout.strip())
    assert outs[0] and outs[1] == outs[0]
