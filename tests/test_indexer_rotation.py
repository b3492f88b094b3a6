"""A DeepSeek lightning indexer as wide as the attention head (patch 0042).

llama.cpp turns the Hadamard rotation of K on for every KV cache of such a model; the MTP context's
full-attention cache of a deepseek4 model holds no layer (its NextN block is sliding-window), and
sizing its rotation divided by zero (SIGFPE) when the draft context reserved its graph: a model
file ended the process. The family's tiny model keeps its indexer narrower than its heads
(``indexer_dim=128`` against ``head_dim=64``); here the two are equal.
"""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from llama_metaws import Llama
from llama_metaws.tools.layouts.layout import materialize, write
from llama_metaws_dev.testing.families import FAMILIES, family_layout

KW = dict(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1, verbose=False)


@pytest.fixture(scope="module")
def wide_indexer(tmp_path_factory):
    fam = FAMILIES["deepseek4"]
    dims = dataclasses.replace(fam.dims, head_dim=fam.dims.indexer_dim)
    layout = family_layout("deepseek4", dims)
    path = tmp_path_factory.mktemp("indexer") / "deepseek4-wide-indexer.gguf"
    return write(layout, path, materialize(layout, np.random.default_rng(0), None))


def _greedy(llm, n=8):
    return llm.create_completion([1, 2, 3, 4], max_tokens=n, temperature=0.0)["choices"][0]["text"]


def test_an_indexer_as_wide_as_the_head_drafts_and_equals_no_drafting(wide_indexer):
    """In a child first: before the patch the draft context's reserve died of SIGFPE."""
    code = ("import sys, llama_metaws\nfrom llama_metaws import Llama\n"
            f"with Llama({str(wide_indexer)!r}, draft='mtp', **{KW!r}) as llm:\n"
            "    llm.create_completion([1, 2, 3, 4], max_tokens=4, temperature=0.0)\n"
            "print('drafted')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "drafted" in res.stdout, (res.returncode, res.stderr[-2000:])
    with Llama(str(wide_indexer), **KW) as plain:
        want = _greedy(plain)
    with Llama(str(wide_indexer), draft="mtp", **KW) as llm:
        assert _greedy(llm) == want
        assert llm.draft_stats.total.drafted > 0
