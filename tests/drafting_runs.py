"""What the drafting tests of the families run through ``Llama``: greedy completions as token ids,
several at once from threads or with the logits rows they came from, and whether the workspace is
shared."""

import threading

import numpy as np

from llama_metaws_dev.testing import split_devices

#: one thread for every batch: a 2-thread barrier on a loaded 2-core machine costs more than the
#: tiny models' decodes
KW = dict(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1, verbose=False)
PROMPTS = [[1, 2, 3, 4, 5], [9], [(7 * i + 3) % 120 for i in range(70)]]  # the last past n_batch
MAX_TOKENS = [24, 17, 20]
#: where a drafting test runs: one device, a layer split and a tensor split over two devices
MODES = {"one-device": dict(split_mode="none"),
         "layer": dict(split_mode="layer", devices=split_devices(2)),
         "tensor": dict(split_mode="tensor", devices=split_devices(2))}


def tokens(llm, prompt, n):
    """A greedy completion's token ids."""
    out = llm.create_completion(prompt, max_tokens=n, temperature=0.0, logprobs=1)
    return out["choices"][0]["logprobs"]["token_ids"]


def concurrently(llm, prompts=PROMPTS, max_tokens=MAX_TOKENS, timeout=120):
    """:func:`tokens` of each prompt, every one from a thread of its own, all at once: each thread's
    request reaches the engine when every thread has one ready (a barrier in front of the engine's
    ``submit``), so that on a loaded machine the first does not finish before the last starts."""
    got = [None] * len(prompts)
    engine = llm._engine
    barrier = threading.Barrier(len(prompts))
    real_submit = engine.submit

    def submit(request):
        barrier.wait(timeout)
        return real_submit(request)

    def run(i):
        got[i] = tokens(llm, prompts[i], max_tokens[i])

    engine.submit = submit  # this engine only, for this call
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
    finally:
        del engine.submit
    return got


def greedy_rows(llm, prompts, n, cache_prompt=True):
    """Each prompt's (token ids) greedy tokens and the logits row of every one, as (tokens, rows):
    all submitted to the engine at once, so that they share its batches."""
    from llama_metaws.engine.request import Request
    from llama_metaws.engine.samplers import SamplingParams

    reqs = [llm._engine.submit(Request(list(p), SamplingParams(temp=0.0), max_tokens=n, logits_rows=True,
                                       cache_prompt=cache_prompt)) for p in prompts]
    got = []
    for r in reqs:
        toks, rows = [], []
        for out in r.outputs(timeout=300):
            toks += out.tokens
            rows += out.rows or []
        got.append((toks, np.stack(rows)))
    return got


def shares_workspace(llm) -> bool:
    """The draft context computes in a buffer it shares with the target."""
    return any(e.shared and e.borrower_need > 0 for e in llm.workspace_stats())
