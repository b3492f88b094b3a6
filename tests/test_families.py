"""The tiny models of every MTP family (llama_metaws_dev.testing.families), and what the vendored
llama.cpp says about the families (llama_metaws.native.archs), read from its source."""

import hashlib
import re

import numpy as np
import pytest

from llama_metaws.native import archs
from llama_metaws.native.runtime import require_build
from llama_metaws_dev.testing.families import (FAMILIES, MTP_FAMILIES, FamilyModelError, check_model, check_models,
                                           family_layout, family_plan, make_family_model)
from llama_metaws.tools.layouts.layout import materialize, write

BUILT = [a for a, f in FAMILIES.items() if f.tiny is None]


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def family_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("families")
    return {(a, agreement): make_family_model(a, out / f"{a}-{agreement}.gguf", seed=3, agreement=agreement)
            for a in FAMILIES for agreement in (None, 0.75)}


def test_llama_cpp_loads_every_family_and_builds_its_mtp_graph(family_files):
    # one child for the MTP families (an MTP context each: its graph is built there), one for the
    # others; a refusal raises FamilyModelError with llama.cpp's own words
    check_models([p for (a, _), p in family_files.items() if FAMILIES[a].mtp_graph])
    check_models([p for (a, _), p in family_files.items() if not FAMILIES[a].mtp_graph], draft=False)


def test_a_file_llama_cpp_refuses_is_reported_in_its_words(tmp_path):
    layout = family_layout("glm4moe")
    layout.tensors = [t for t in layout.tensors if t.name != "blk.1.attn_output.weight"]
    path = write(layout, tmp_path / "broken.gguf", materialize(layout, np.random.default_rng(0), None))
    with pytest.raises(FamilyModelError, match=r"tensor 'blk\.1\.attn_output\.weight' not found"):
        check_model(path)
    # a tensor the loader does not create: llama.cpp counts the file's tensors
    layout = family_layout("glm4moe")
    layout.add("blk.0.ffn_norm.weight", layout.dims.n_embd)
    path = write(layout, tmp_path / "extra.gguf", materialize(layout, np.random.default_rng(0), None))
    with pytest.raises(FamilyModelError, match="wrong number of tensors"):
        check_model(path)


@pytest.mark.parametrize("arch", BUILT)
def test_the_same_seed_writes_the_same_bytes(tmp_path, family_files, arch):
    again = make_family_model(arch, tmp_path / "again.gguf", seed=3, agreement=0.75)
    assert _sha(again) == _sha(family_files[(arch, 0.75)])
    other = make_family_model(arch, tmp_path / "other.gguf", seed=4, agreement=0.75)
    assert _sha(other) != _sha(again)
    # the random and the agreement design hold the same tensors, with other values
    assert _sha(family_files[(arch, None)]) != _sha(again)


def test_each_head_has_its_own_rate_in_the_plan():
    plan = family_plan("step35", [1.0, 0.0, 0.5], seed=5)
    succ, cycle = plan["succ"], plan["cycle"]
    first, never, half = plan["heads_draft"]
    assert (first[cycle] == succ[cycle]).all()  # head 0 always drafts the target's next token
    assert (never[cycle] == succ[succ[cycle]]).all()  # head 1 two ahead: always wrong
    assert abs((half[cycle] == succ[cycle]).mean() - 0.5) < 0.02
    with pytest.raises(ValueError, match="3 NextN heads"):
        family_plan("step35", [1.0, 0.0], seed=5)
    # one rate applies to every head; the plan is the file's (same draws)
    plan = family_plan("mimo2", 0.75, seed=3)
    assert all((d == plan["draft"]).all() for d in plan["heads_draft"])


def test_every_mtp_family_llama_cpp_has_is_in_the_registry():
    assert set(MTP_FAMILIES) == archs.MTP_GRAPH_ARCHS
    assert not FAMILIES["nemotron_h"].mtp_graph and FAMILIES["nemotron_h"].n_nextn == 1
    assert {a for a, f in FAMILIES.items() if f.chained_heads} == {"mimo2", "step35"}


# ----------------------------------------------------------------------------------------------
# llama.cpp's facts, read from the build's vendored tree


@pytest.fixture(scope="module")
def vendored():
    src = require_build().src_dir / "src"
    arch_cpp = (src / "llama-arch.cpp").read_text()
    names = dict(re.findall(r'\{\s*(LLM_ARCH_\w+),\s*"([^"]+)"\s*\}', arch_cpp))
    classes = dict(re.findall(r"case (LLM_ARCH_\w+):\s*return new llama_model_(\w+)\(",
                              (src / "llama-model.cpp").read_text()))
    return src, arch_cpp, names, {cls: names[a] for a, cls in classes.items()}


def _switch(source: str, function: str):
    body = source[source.index(f"bool {function}("):]
    return re.findall(r"case (LLM_ARCH_\w+):", body[:body.index("\n}\n")])


def test_the_mtp_graph_list_is_the_vendored_one(vendored):
    # an architecture has an MTP graph where its build_arch_graph makes a graph_mtp
    src, _, _, arch_of_class = vendored
    found = set()
    for f in (src / "models").glob("*.cpp"):
        text = f.read_text()
        for cls, body in re.findall(r"llama_model_(\w+)::build_arch_graph\([^)]*\) const \{(.*?)\n\}", text, re.S):
            if "make_unique<graph_mtp>" in body:
                found.add(arch_of_class[cls])
    assert found == archs.MTP_GRAPH_ARCHS
    assert "nemotron_h" not in found and "glm5-next" not in found  # NextN layers, no graph


def test_the_no_tensor_split_list_is_the_vendored_one(vendored):
    _, arch_cpp, names, _ = vendored
    assert {names[a] for a in _switch(arch_cpp, "llm_arch_supports_sm_tensor")} == archs.NO_TENSOR_SPLIT_ARCHS


def test_the_recurrent_families_are_llama_cpps_hybrid_ones(vendored):
    _, arch_cpp, names, _ = vendored
    hybrid = {names[a] for a in _switch(arch_cpp, "llm_arch_is_hybrid") + _switch(arch_cpp, "llm_arch_is_recurrent")}
    assert {a for a, f in FAMILIES.items() if f.recurrent} == hybrid & set(FAMILIES)
