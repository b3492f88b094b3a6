"""Every MTP family on the user's path: ``Llama(draft="mtp")`` on one device, over a layer split
and over a tensor split of two CPU devices, and ``serve -np 2 --spec-type draft-mtp``.

Each family's tiny model (llama_metaws_dev.testing.families) carries the agreement design, so the
head's drafts are accepted about as often as designed: greedy output must equal no drafting,
drafts must be made and accepted, and the target and the draft must share the workspace (under
tensor split through the meta-buffer alias). Where llama.cpp has no tensor split for a family,
``Llama`` refuses before the weights load; where it has no MTP graph (nemotron_h), ``Llama``
refuses ``draft="mtp"``. tests/test_families.py keeps those lists equal to the vendored source;
the last tests here check them against what llama.cpp does.
"""

import subprocess
import sys
import threading

import numpy as np
import pytest

from llama_metaws import Llama
from llama_metaws.native.archs import NO_TENSOR_SPLIT_ARCHS
from llama_metaws_dev.testing import split_devices
from llama_metaws_dev.testing.families import FAMILIES, MTP_FAMILIES, make_family_model
from drafting_runs import MODES, greedy_rows
from serving import Server

KW = dict(n_ctx=256, n_batch=64, n_ubatch=64, verbose=False)
PROMPT = "1 2 3 4"
N_TOKENS = 12
AGREEMENT = 0.8

@pytest.fixture(scope="module")
def family_model(tmp_path_factory):
    out, made = tmp_path_factory.mktemp("family-paths"), {}

    def get(arch):
        if arch not in made:
            made[arch] = str(make_family_model(arch, out / f"{arch}.gguf", seed=7, agreement=AGREEMENT))
        return made[arch]
    return get


def _text(llm, prompt=PROMPT, n=N_TOKENS):
    return llm.create_completion(prompt, max_tokens=n, temperature=0.0)["choices"][0]["text"]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", MTP_FAMILIES)
def test_drafting_is_lossless_accepted_and_shares_the_workspace(family_model, arch, mode):
    path, split = family_model(arch), MODES[mode]
    if mode == "tensor" and arch in NO_TENSOR_SPLIT_ARCHS:
        # refused before anything loads, naming the arch and what works instead
        for draft in (None, "mtp"):
            with pytest.raises(ValueError, match=rf"no tensor split for architecture '{arch}'.*'layer'"):
                Llama(path, draft=draft, **KW, **split)
        return
    with Llama(path, **KW, **split) as plain:
        want = [_text(plain), _text(plain, "7")]
    with Llama(path, draft="mtp", **KW, **split) as llm:
        assert [_text(llm), _text(llm, "7")] == want
        total = llm.draft_stats.total
        assert total.drafted > 0 and total.accepted > 0, total
        entries = llm.workspace_stats()
        assert any(e.shared and e.allocated > 0 for e in entries), entries
        if mode == "tensor":
            assert any(e.alias for e in entries), entries


def test_a_family_without_an_mtp_graph_is_refused_when_opened(family_model, tmp_path):
    path = make_family_model("nemotron_h", tmp_path / "nemotron_h.gguf", seed=7, agreement=AGREEMENT)
    with pytest.raises(ValueError, match=r"no MTP graph for architecture 'nemotron_h'.*nemotron_h_moe"):
        Llama(str(path), draft="mtp", **KW)
    with Llama(str(path), **KW) as llm:  # its trunk runs
        assert len(_text(llm)) > 0


def _serve_pair(server):
    """Two requests at once, and each alone: (together, alone)."""
    client = server.client()
    prompts = [PROMPT, "9 8 7"]

    def one(p):
        return client.completions.create(model="tiny", prompt=p, max_tokens=N_TOKENS, temperature=0).choices[0].text

    alone = [one(p) for p in prompts]
    together, errors = [None, None], []

    def run(i):
        try:
            together[i] = one(prompts[i])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return together, alone


@pytest.mark.slow
@pytest.mark.parametrize("arch", MTP_FAMILIES)
def test_serve_two_slots_draft_and_equal_their_solo_outputs(family_model, tmp_path, arch):
    srv = Server(family_model(arch), "--spec-type", "draft-mtp", "--spec-draft-n-max", "3", "-np", "2",
                 "-c", "512", "-b", "64", "-ub", "64", "--metrics", "-a", "tiny", log_path=tmp_path / "serve.log")
    for server in srv.running():
        together, alone = _serve_pair(server)
        assert together == alone
        m = server.metrics()
        assert m["llamacpp:spec_decode_num_draft_tokens_total"] > 0
        assert m["llamacpp:spec_decode_num_accepted_tokens_total"] > 0


# ----------------------------------------------------------------------------------------------
# two sequences in one batch under tensor split (patch 0032): a small recurrent layer puts all its
# channels on one device, and the meta backend's rules took two tensors held whole by the same
# device along different axes for unequal splits and aborted (the conv state's concat with two
# one-token inputs, qwen35moe's alpha plus its bias, a one-row state table's get_rows)

TENSOR_SPLIT_MTP = [a for a in MTP_FAMILIES if a not in NO_TENSOR_SPLIT_ARCHS]
PAIR = [PROMPT, "9 8 7"]
# measured (logits up to ~10): up to 1.9e-4 between one CPU device and the tensor split (mimo2;
# the split's partial sums add up in another order), as much with two sequences as with one
LOGIT_TOLERANCE = 1e-3


def _greedy_rows(llm, prompts, n=N_TOKENS):
    """greedy_rows of text prompts."""
    return greedy_rows(llm, [llm.tokenize(p.encode()) for p in prompts], n)


@pytest.fixture(scope="module")
def one_device_rows(family_model):
    """Each arch's PAIR, one at a time on one device, no drafting."""
    made = {}

    def get(arch):
        if arch not in made:
            with Llama(family_model(arch), **KW) as llm:
                made[arch] = [_greedy_rows(llm, [p])[0] for p in PAIR]
        return made[arch]
    return get


def test_the_tensor_split_mtp_families_are_those_llama_cpp_splits():
    assert sorted(TENSOR_SPLIT_MTP) == sorted(["qwen35", "qwen35moe", "qwen3next", "glm4moe", "deepseek4", "mimo2",
                                               "step35", "hy_v3", "cohere2moe"])


@pytest.mark.parametrize("draft", [None, "mtp"], ids=["plain", "mtp"])
@pytest.mark.parametrize("arch", TENSOR_SPLIT_MTP)
def test_two_sequences_in_a_batch_under_tensor_split_equal_one_device(family_model, one_device_rows, arch, draft):
    want = one_device_rows(arch)
    with Llama(family_model(arch), n_seq_max=2, draft=draft, **KW, **MODES["tensor"]) as llm:
        got = _greedy_rows(llm, PAIR)
        assert llm.engine_stats()["slots_busy_max"] == 2  # the two were in one batch
        if draft:
            total = llm.draft_stats.total
            assert total.drafted > 0 and total.accepted > 0, total
    for (toks, rows), (want_toks, want_rows) in zip(got, want):
        assert toks == want_toks and len(toks) == N_TOKENS
        assert np.all(np.isfinite(rows)) and np.abs(rows - want_rows).max() < LOGIT_TOLERANCE


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe"])
def test_serve_two_slots_under_tensor_split_draft_and_equal_one_device(family_model, tmp_path, arch):
    srv = Server(family_model(arch), "--spec-type", "draft-mtp", "--spec-draft-n-max", "3", "-np", "2",
                 "-sm", "tensor", "--device", ",".join(split_devices(2)), "-c", "512", "-b", "64", "-ub", "64",
                 "--metrics", "-a", "tiny", log_path=tmp_path / "serve.log")
    for server in srv.running():
        together, alone = _serve_pair(server)
        with Llama(family_model(arch), **KW) as one:
            want = [_text(one, p) for p in PAIR]
        assert together == alone == want
        m = server.metrics()
        assert m["llamacpp:spec_decode_num_draft_tokens_total"] > 0
        assert m["llamacpp:spec_decode_num_accepted_tokens_total"] > 0


# ----------------------------------------------------------------------------------------------
# the lists against llama.cpp itself, in a child (the binding's own load: no refusal of ours)

_CHILD = r"""
import sys
import llama_metaws
from llama_metaws.engine.contexts import load_model, new_context, greedy_tokens
from llama_metaws_dev.testing import split_devices
for path in sys.argv[1:]:
    for mtp in (False, True):
        try:
            model = load_model(path, devices=split_devices(2), split_mode="tensor", load_mtp=mtp, verbose=True)
        except ValueError as e:
            print(f"REFUSED {path} mtp={mtp}", flush=True)
            continue
        ctx = new_context(model, n_ctx=128, n_batch=16)
        greedy_tokens(ctx, [1, 2, 3], 2)
        ctx.close()
        model.close()
        print(f"LOADED {path} mtp={mtp}", flush=True)
"""


def test_tensor_split_works_for_every_family_but_the_listed_ones(family_model, tmp_path):
    """Listed archs fail in llama.cpp under tensor split; the others load and decode, with and
    without their NextN layers (step35 without them aborted before patch 0029)."""
    paths = {a: family_model(a) if a in MTP_FAMILIES else
             str(make_family_model(a, tmp_path / f"{a}.gguf", seed=7)) for a in FAMILIES}
    res = subprocess.run([sys.executable, "-c", _CHILD, *paths.values()], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    for arch, path in paths.items():
        want = "REFUSED" if arch in NO_TENSOR_SPLIT_ARCHS else "LOADED"
        for mtp in (False, True):
            assert f"{want} {path} mtp={mtp}" in res.stdout, (arch, res.stdout)
    # llama.cpp's own words for the refusal
    assert "LLAMA_SPLIT_MODE_TENSOR not implemented for architecture 'deepseek2'" in res.stderr


# ----------------------------------------------------------------------------------------------
# patch 0030: a device without a slice of an FFN joins the AllReduce with zeros, whatever its
# compute buffer held before

_POISON_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>
#include <stdlib.h>
/* every block of 4 KiB or more that posix_memalign hands out (ggml's buffers) is filled with
   0xff bytes, a float NaN: memory nothing wrote reads as NaN, in every run */
int posix_memalign(void ** p, size_t alignment, size_t size) {
    static int (*real)(void **, size_t, size_t);
    if (!real) real = (int (*)(void **, size_t, size_t)) dlsym(RTLD_NEXT, "posix_memalign");
    int rc = real(p, alignment, size);
    if (rc == 0 && size >= 4096) memset(*p, 0xff, size);
    return rc;
}
"""

_POISONED_CHILD = r"""
import sys
from llama_metaws import Llama
from llama_metaws_dev.testing import split_devices
out = []
for kw in (dict(split_mode="none"), dict(split_mode="tensor", devices=split_devices(2))):
    with Llama(sys.argv[1], n_ctx=256, n_batch=64, n_ubatch=64, verbose=False, **kw) as llm:
        out.append(llm.create_completion("1 2 3", max_tokens=8, temperature=0.0)["choices"][0]["text"])
print("TEXTS", out[0], out[1])
"""


def test_a_device_without_a_slice_joins_the_allreduce_with_zeros(family_model, tmp_path):
    """glm4moe's tiny experts (64 rows) are narrower than the FFN split granularity (128): one CPU
    device holds none of them and computes nothing there. Its partial comes from memory nothing
    wrote, here NaN on purpose; zeroed by a scale of 0 (before patch 0030) the logits were NaN."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler to build the allocation poisoner (the native build needs one too)")
    src, lib = tmp_path / "poison.c", tmp_path / "poison.so"
    src.write_text(_POISON_C)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src), "-ldl"], check=True)
    import os

    env = dict(os.environ, LD_PRELOAD=str(lib))
    res = subprocess.run([sys.executable, "-c", _POISONED_CHILD, family_model("glm4moe")], capture_output=True,
                         text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    one, split = res.stdout.split("TEXTS ", 1)[1].split()
    assert one == split  # finite logits, the same greedy text as one device
