"""Tensor split at the shapes where the meta backend aborted: each a tiny family model, under
``split_mode="tensor"`` over two or three devices, gives the greedy tokens and logits rows of one
device, a prompt of one token and one of seven one at a time, then both in one batch.

The shapes (bench/sweep_tensor_split.py sweeps many more):

* one delta-net group (K head), one V head: a per-head bias of one element wrote past a device's
  empty slice at load (patch 0034); the L2 norm of the single K head, split along dim 0 (0035),
  and the delta net itself (0039), held whole by one device, aborted at the first token;
* qwen3next, one group: beta and alpha, a view of part of each slice, found no axis (0040);
* qwen3next, V heads twice the K heads: V was cut at other heads than K (0036);
* qwen3.5, three groups over three devices (0, 2 and 1 heads): the final states behind the delta
  net's outputs took a split ratio that does not divide (0037);
* qwen3.5, six query heads over two K/V heads: the gated Q was cut at one K/V head, K and V at
  two (0038);
* mimo2, one K/V head: the K/V rows written to the cache, held whole by one device along the
  head dimension, hit set_rows' rule (0041).
"""

import dataclasses

import numpy as np
import pytest

from llama_metaws import Llama
from llama_metaws_dev.testing import split_devices
from llama_metaws_dev.testing.families import FAMILIES, family_layout
from llama_metaws.tools.layouts.layout import materialize, write
from drafting_runs import greedy_rows

KW = dict(n_ctx=256, n_batch=64, n_ubatch=64, n_seq_max=2, verbose=False)
PROMPTS = [[5], [1, 2, 3, 4, 5, 6, 7]]
N_TOKENS = 6
# measured (logits up to ~3): 0 where one device holds a layer whole, up to 1.2e-4 where three
# devices hold 0, 2 and 1 delta-net heads (partial sums in another order, the f16 K/V cache) against
# one CPU device with flash attention, as a tensor split runs it; as tests/test_family_paths.py.
# A GPU listed twice takes other kernels for the halves (tests/test_tensor_split.py)
CPU_LOGIT_TOLERANCE = 1e-3
GPU_LOGIT_TOLERANCE = 2e-2

SHAPES = {
    "qwen35-one-group": ("qwen35", dict(ssm_groups=1, ssm_heads=1), 2),
    "qwen35moe-one-group-two-v": ("qwen35moe", dict(ssm_groups=1, ssm_heads=2), 2),
    "qwen3next-one-group": ("qwen3next", dict(ssm_groups=1, ssm_heads=1), 2),
    "qwen3next-v-twice-k": ("qwen3next", dict(ssm_groups=2, ssm_heads=4), 2),
    "qwen35-three-groups-three-devices": ("qwen35", dict(ssm_groups=3, ssm_heads=3), 3),
    "qwen35-six-q-two-kv": ("qwen35", dict(n_head=6, n_head_kv=2), 2),
    "mimo2-one-kv-head": ("mimo2", dict(n_head=2, n_head_kv=1), 2),
}


def make_shape(arch, over, path, seed=0):
    """``arch``'s tiny family model with the dimensions ``over`` in place of its own."""
    dims = dataclasses.replace(FAMILIES[arch].dims, **over)
    layout = family_layout(arch, dims)
    return str(write(layout, path, materialize(layout, np.random.default_rng(seed), None)))


def runs(llm):
    """The prompts one at a time, then together in one batch."""
    return [greedy_rows(llm, [p], N_TOKENS)[0] for p in PROMPTS] + greedy_rows(llm, PROMPTS, N_TOKENS)


@pytest.mark.parametrize("name", list(SHAPES))
def test_tensor_split_at_the_shape_equals_one_device(tmp_path, name):
    arch, over, n_devices = SHAPES[name]
    path = make_shape(arch, over, tmp_path / f"{name}.gguf")
    with Llama(path, flash_attn=True, **KW) as llm:
        want = runs(llm)
    devices = split_devices(n_devices)
    with Llama(path, split_mode="tensor", devices=devices, **KW) as llm:
        got = runs(llm)
    tolerance = CPU_LOGIT_TOLERANCE if all(d == "CPU" for d in devices) else GPU_LOGIT_TOLERANCE
    for (want_tokens, want_rows), (got_tokens, got_rows) in zip(want, got):
        assert got_tokens == want_tokens
        assert np.abs(got_rows - want_rows).max() <= tolerance
