"""A draft model of its own file: ``Llama(draft_model=PATH)`` and ``serve -md PATH --spec-type
draft-mtp``, as llama-server loads ``-md`` (a second model, an MTP context on it, ``ctx_other`` the
target's context).

* An MTP head split from its model (``split_mtp_model``: convert_hf_to_gguf.py's ``--no-mtp`` target
  and ``--mtp`` head) drafts exactly as the whole model drafts with its own head: the same greedy
  output as no drafting, the same drafts made and accepted, the head's compute in the target's
  workspace (under tensor split through the meta-buffer alias: the head is another model, with a
  meta device of its own), on one device, over a layer split, over a tensor split, and for two
  slots at once.
* A Gemma 4 assistant reads the target's KV cache (llama.cpp's is_mem_shared): never fed, its
  drafts all at the draft's first position.
* What does not go together is a ValueError before anything loads.
"""

import os
import subprocess
import sys
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest

from drafting_runs import KW, MAX_TOKENS, MODES, PROMPTS, concurrently, shares_workspace, tokens
from llama_metaws import Llama
from llama_metaws.engine.draft_file import ASSISTANT, NEXTN_HEAD, read_draft_file
from llama_metaws_dev.testing import make_tiny_mtp_model, split_devices
from llama_metaws_dev.testing.draft_files import split_mtp_model
from llama_metaws_dev.testing.families import MTP_FAMILIES, FamilyModelError, family_layout, make_family_model
from llama_metaws.tools.layouts.layout import materialize, write
from llama_metaws_dev.testing.families.gemma4 import gemma4_plan, make_gemma4_pair
from serving import Server

AGREEMENT = 0.75


@pytest.fixture(scope="module")
def qwen_files(tmp_path_factory):
    """The qwen35 agreement model, and its trunk and MTP head in files of their own."""
    out = tmp_path_factory.mktemp("draft-file")
    full = make_tiny_mtp_model(out / "qwen35.gguf", seed=5, agreement=AGREEMENT)
    target, head = split_mtp_model(full, out / "qwen35-trunk.gguf", out / "mtp-qwen35.gguf")
    return str(full), str(target), str(head)


@pytest.fixture(scope="module")
def gemma_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma4")
    target, assistant = make_gemma4_pair(out / "gemma4.gguf", out / "gemma4-assistant.gguf", seed=5,
                                         agreement=AGREEMENT)
    return str(target), str(assistant)


def _run(path, **kw):
    """Greedy completions of PROMPTS, the draft totals, the workspace's entries and the engine's head."""
    with Llama(path, **KW, **kw) as llm:
        out = [tokens(llm, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
        total = llm.draft_stats.total if llm.drafting else None
        assert llm.workspace_mode == ("alias" if llm.drafting else None)
        return out, total, llm.workspace_stats(), llm._engine.head


# ----------------------------------------------------------------------------------------------
# the files


def test_the_split_files_are_what_the_converter_writes(qwen_files):
    full, target, head = qwen_files
    t, h = gguf.GGUFReader(target), gguf.GGUFReader(head)
    assert t.fields["qwen35.block_count"].contents() == 2 and "qwen35.nextn_predict_layers" not in t.fields
    assert not [x.name for x in t.tensors if x.name.startswith("blk.2.")]
    assert h.fields["qwen35.block_count"].contents() == 3 and h.fields["qwen35.nextn_predict_layers"].contents() == 1
    names = {x.name for x in h.tensors}
    assert {"token_embd.weight", "output_norm.weight", "output.weight", "blk.2.nextn.eh_proj.weight"} <= names
    assert all(n.startswith("blk.2.") for n in names - {"token_embd.weight", "output_norm.weight", "output.weight"})
    d = read_draft_file(head)
    assert (d.kind, d.arch, d.n_nextn, d.has_trunk, d.n_embd_in, d.n_vocab) == (NEXTN_HEAD, "qwen35", 1, False, 256, 128)
    assert read_draft_file(full).has_trunk  # a whole MTP model given as a draft model is a head too


def test_a_head_llama_cpp_refuses_is_reported_in_its_words(qwen_files, tmp_path):
    full, _, _ = qwen_files
    broken = tmp_path / "full-no-norm.gguf"
    r = gguf.GGUFReader(full)
    w = gguf.GGUFWriter(str(broken), "qwen35")
    for key, field in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            vt = field.types[0]
            w.add_key_value(key, field.contents(), vt, sub_type=field.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    for x in r.tensors:
        if x.name != "output_norm.weight":
            w.add_tensor(x.name, x.data, raw_dtype=x.tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(FamilyModelError, match=r"output_norm\.weight"):
        split_mtp_model(broken, tmp_path / "t.gguf", tmp_path / "h.gguf")


# ----------------------------------------------------------------------------------------------
# an MTP head of its own file


@pytest.mark.parametrize("mode", list(MODES))
def test_a_head_file_drafts_as_the_models_own_head_in_the_workspace(qwen_files, mode):
    full, target, head = qwen_files
    split = MODES[mode]
    plain, _, _, _ = _run(target, **split)
    own, own_total, _, _ = _run(full, draft="mtp", **split)
    got, total, entries, _ = _run(target, draft="mtp", draft_model=head, **split)
    assert got == plain == own
    # the same drafts, made and accepted as the model's own head made them
    assert total.drafted > 0 and total.accepted > 0
    assert (total.drafted, total.accepted) == (own_total.drafted, own_total.accepted)
    assert any(e.shared and e.borrower_need > 0 for e in entries), entries
    if mode == "tensor":  # the head's meta compute buffer is an alias of the target's
        meta = [e for e in entries if e.buffer_type.startswith("Meta")]
        assert meta and all(e.shared and e.alias for e in meta), entries
        assert len(entries) == len({(e.buffer_type, e.device) for e in entries}), entries  # each listed once


@pytest.mark.parametrize("mode", ["one-device", "tensor"])
def test_a_head_file_drafts_for_two_slots_at_once(qwen_files, mode):
    _, target, head = qwen_files
    with Llama(target, **KW, **MODES[mode]) as plain:
        want = [tokens(plain, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    with Llama(target, draft_model=head, n_seq_max=2, **KW, **MODES[mode]) as llm:  # draft="mtp" inferred
        assert concurrently(llm) == want
        assert llm.draft_stats.total.accepted > 0 and shares_workspace(llm)
        assert llm.engine_stats()["slots_busy_max"] == 2


@pytest.mark.parametrize("arch", [a for a in MTP_FAMILIES if a != "qwen35"])
def test_every_families_head_drafts_from_its_own_file(tmp_path, arch):
    full = make_family_model(arch, tmp_path / f"{arch}.gguf", seed=7, agreement=0.8)
    target, head = split_mtp_model(full, tmp_path / "trunk.gguf", tmp_path / f"mtp-{arch}.gguf")
    # (the model's own head drafts losslessly: tests/test_family_paths.py)
    own, own_total, _, _ = _run(str(full), draft="mtp")
    got, total, entries, _ = _run(str(target), draft_model=str(head))
    assert got == own
    assert (total.drafted, total.accepted) == (own_total.drafted, own_total.accepted) and total.accepted > 0
    assert any(e.shared and e.borrower_need > 0 for e in entries), entries


# ----------------------------------------------------------------------------------------------
# Gemma 4's assistant


def test_the_assistant_file_is_read_as_one(gemma_files):
    _, assistant = gemma_files
    d = read_draft_file(assistant)
    assert (d.kind, d.arch, d.n_nextn, d.n_embd_in, d.shares_memory, d.chained_heads) == \
        (ASSISTANT, "gemma4-assistant", 2, 128, True, False)


@pytest.mark.parametrize("mode", ["one-device", "layer"])
def test_the_gemma4_assistant_drafts_over_the_targets_memory(gemma_files, mode):
    target, assistant = gemma_files
    split = MODES[mode]
    plain, _, _, _ = _run(target, **split)
    got, total, entries, head = _run(target, draft="mtp", draft_model=assistant, **split)
    assert got == plain
    assert total.drafted > 0 and total.accepted > 0
    assert any(e.shared and e.borrower_need > 0 for e in entries), entries
    assert head.shares_memory and not head.chained  # fed nothing, its two blocks in one graph


_ABORT = r"""
import sys
sys.path.insert(0, sys.argv[3])
from llama_metaws import Llama
from drafting_runs import KW, PROMPTS, MAX_TOKENS, tokens
from llama_metaws.engine import draft_file
real = draft_file.check_pair
draft_file.check_pair = lambda t, d, tensor_split=False: real(t, d)  # what llama.cpp itself does
with Llama(sys.argv[1], draft_model=sys.argv[2], split_mode="tensor", devices=["CPU", "CPU"],
           phase_aware_workspace=False, **KW) as llm:
    for p, n in zip(PROMPTS, MAX_TOKENS):
        tokens(llm, p, n)
print("no abort")
"""


def test_the_assistant_under_tensor_split_is_refused_for_llama_cpps_abort(gemma_files, tmp_path):
    target, assistant = gemma_files
    with pytest.raises(ValueError, match=r"Gemma 4 assistant under split_mode='tensor'.*'layer'"):
        Llama(target, draft_model=assistant, split_mode="tensor", devices=split_devices(2), **KW)
    # why: past the refusal, with no workspace at all, llama.cpp aborts in the target's KV write
    res = subprocess.run([sys.executable, "-c", _ABORT, target, assistant, str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=300, env=dict(os.environ, GGML_NO_BACKTRACE="1"))
    assert res.returncode != 0 and "no abort" not in res.stdout
    assert "GGML_ASSERT(i1 >= 0 && i1 < ne1)" in res.stderr, res.stderr[-2000:]


def test_the_assistants_drafts_follow_its_design(gemma_files):
    target, assistant = gemma_files
    plan = gemma4_plan(AGREEMENT, seed=5)
    with Llama(target, draft_model=assistant, draft_max=1, **KW) as llm:
        out = tokens(llm, [int(plan["cycle"][0])], 64)
        t = llm.timings()
    succ, draft = plan["succ"], plan["draft"]
    assert all(succ[a] == b for a, b in zip([int(plan["cycle"][0])] + out, out))  # the target's cycle
    # one-token drafts from the token just sampled (the prompt's first), accepted exactly where the
    # design has the assistant agree; the last token comes from a plain step
    x, n, drafted, accepted = int(plan["cycle"][0]), 0, 0, 0
    while n < 64:
        if n == 63:
            break
        drafted += 1
        ok = draft[x] == succ[x]
        accepted += ok
        n, x = (n + 2, succ[succ[x]]) if ok else (n + 1, succ[x])
    assert (t["draft_n"], t["draft_n_accepted"]) == (drafted, accepted), t
    assert drafted > accepted > 0


def test_the_assistant_drafts_for_two_slots_at_once(gemma_files):
    target, assistant = gemma_files
    with Llama(target, **KW) as plain:
        want = [tokens(plain, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    with Llama(target, draft_model=assistant, n_seq_max=2, **KW) as llm:
        assert concurrently(llm) == want
        assert llm.draft_stats.total.accepted > 0 and shares_workspace(llm)


def test_the_fit_measures_the_draft_file_beside_the_target(qwen_files, gemma_files, capfd):
    from llama_metaws.engine import contexts, fit
    from llama_metaws.native.binding import set_verbose

    _, target, head = qwen_files
    t, d = contexts.context_fields(n_seq_max=1, draft_max=3, n_batch=64)
    for draft_path in (None, head):
        capfd.readouterr()
        set_verbose(True)  # llama's log (the loader's lines) through the binding's logger
        try:
            f = fit.fit(target, model_fields={}, context_fields=dict(n_ctx=0, **t), draft_fields=d,
                        draft_path=draft_path, verbose=True)
        finally:
            set_verbose(False)
        log = capfd.readouterr().err
        assert f.status == 0 and f.n_ctx == 256
        # llama-server's fit of -md loads the draft's own file (its NextN blocks) beside the target
        assert (f"from {head}" in log) == (draft_path is not None), log[-3000:]
    # serve's default -ngl auto runs that fit with a draft file, the assistant's too
    g_target, assistant = gemma_files
    for t_path, d_path in ((target, head), (g_target, assistant)):
        with Llama(t_path, draft_model=d_path, n_gpu_layers="auto", **KW) as llm:
            assert llm.fitted is not None and llm.fitted.status == 0
            assert tokens(llm, [1, 2, 3], 4)


# ----------------------------------------------------------------------------------------------
# what does not go together: a ValueError before anything loads


def test_what_does_not_go_together_is_refused_before_loading(qwen_files, gemma_files, tmp_path):
    full, target, head = qwen_files
    g_target, assistant = gemma_files
    with pytest.raises(ValueError, match="does not exist"):
        Llama(target, draft_model=str(tmp_path / "nowhere.gguf"), **KW)
    with pytest.raises(ValueError, match="neither an MTP head"):
        Llama(target, draft_model=target, **KW)  # a plain model: draft-simple is not implemented
    with pytest.raises(ValueError, match="a Gemma 4 assistant drafts for a 'gemma4' target"):
        Llama(target, draft_model=assistant, **KW)
    with pytest.raises(ValueError, match="'qwen35' model and the target a 'gemma4' one"):
        Llama(g_target, draft_model=head, **KW)
    # another architecture, another width, another vocabulary
    moe = make_family_model("qwen35moe", tmp_path / "qwen35moe.gguf", seed=1)
    _, moe_head = split_mtp_model(moe, tmp_path / "moe-trunk.gguf", tmp_path / "mtp-moe.gguf", check=False)
    layout = family_layout("qwen35")  # the family's qwen35 at width 128, the tiny one's is 256
    narrow = write(layout, tmp_path / "narrow.gguf", materialize(layout, np.random.default_rng(1), None))
    _, narrow_head = split_mtp_model(narrow, tmp_path / "narrow-trunk.gguf", tmp_path / "mtp-narrow.gguf",
                                     check=False)
    small = make_tiny_mtp_model(tmp_path / "v100.gguf", seed=1, n_vocab=100)
    _, small_head = split_mtp_model(small, tmp_path / "v100-trunk.gguf", tmp_path / "mtp-v100.gguf", check=False)
    with pytest.raises(ValueError, match="'qwen35moe' model and the target a 'qwen35' one"):
        Llama(target, draft_model=str(moe_head), **KW)
    with pytest.raises(ValueError, match="hidden rows of width 128, the target's are 256 wide"):
        Llama(target, draft_model=str(narrow_head), **KW)
    with pytest.raises(ValueError, match="the draft has 100 tokens, the target 128"):
        Llama(target, draft_model=str(small_head), **KW)
    # a family llama.cpp has no MTP graph for (its NextN layers load, an MTP context cannot decode)
    nemo = make_family_model("nemotron_h", tmp_path / "nemotron_h.gguf", seed=1)
    n_target, n_head = split_mtp_model(nemo, tmp_path / "nemo-trunk.gguf", tmp_path / "mtp-nemo.gguf", check=False)
    with pytest.raises(ValueError, match="no MTP graph for architecture 'nemotron_h'"):
        Llama(str(n_target), draft_model=str(n_head), **KW)
    # and a draft model file is one draft: not with the binding's draft objects (it is one of them)
    with pytest.raises(ValueError, match="does not exist"):
        Llama(target, draft="mtp", draft_model=str(tmp_path / "x.gguf"), **KW)


# ----------------------------------------------------------------------------------------------
# serve -md


@pytest.mark.parametrize("which", ["qwen35-head", "gemma4-assistant"])
def test_serve_md_draft_mtp_two_slots(qwen_files, gemma_files, tmp_path, which):
    # the head's draft-mtp inferred from the file, as llama-server infers it; the assistant's named
    target, draft = (qwen_files[1], qwen_files[2]) if which == "qwen35-head" else gemma_files
    spec = [] if which == "qwen35-head" else ["--spec-type", "draft-mtp"]
    srv = Server(target, "-md", draft, *spec, "--spec-draft-n-max", "3", "-np", "2",
                 "-c", "512", "-b", "64", "-ub", "64", "--metrics", "-a", "tiny", log_path=tmp_path / "serve.log")
    for server in srv.running():
        client = server.client()
        prompts = ["1 2 3 4", "9 8 7"]

        def one(p):
            return client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text
        alone = [one(p) for p in prompts]
        together = [None, None]
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, one(prompts[i]))) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert together == alone
        m = server.metrics()
        assert m["llamacpp:spec_decode_num_draft_tokens_total"] > 0
        assert m["llamacpp:spec_decode_num_accepted_tokens_total"] > 0
