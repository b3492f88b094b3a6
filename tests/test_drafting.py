"""The drafting path pays only what llama.cpp pays: no logits row for a prompt but the last, a draft on
every step, the draft context derived from the target's, logprobs as without drafting (and without
logits_all), drafts sized to max_tokens, timings in llama.cpp's phases."""

import numpy as np
import pytest

import llama_cpp

from llama_metaws import Llama
from llama_metaws.engine.drafting import AdaptiveLength, top_probability as _top_probability
from llama_metaws_dev.testing import generate_n, make_tiny_mtp_model

KW = dict(n_ctx=256, n_batch=64, n_ubatch=64, verbose=False)
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 10 # with 60 tokens out: past n_batch


@pytest.fixture(scope="module")
def half_path(models_dir):
    # drafts right about half the time: rejections on most steps
    return str(make_tiny_mtp_model(models_dir / "drafting-half.gguf", seed=31, agreement=0.5))


def _count_outputs(llm):
    """Record, for each target decode of the engine, (tokens in the batch, positions asking for logits)."""
    seen = []
    engine = llm._engine
    decode = engine.decode_target

    def counting(b, *args):
        seen.append((b.n, b.n_outputs))
        return decode(b, *args)

    engine.decode_target = counting
    return seen


def _proposals(llm):
    """Record each draft the MTP head is asked for: (tokens asked, tokens drafted)."""
    calls = []
    head = llm._engine.head
    propose = head.propose

    def counting(starts, *args):
        out = propose(starts, *args)
        calls.extend((n_max, len(out[seq])) for seq, _last, _pos, _row, n_max in starts)
        return out

    head.propose = counting
    return calls


def test_a_prompt_asks_llama_for_no_row_but_where_it_samples(half_path):
    with Llama(half_path, draft="mtp", draft_max=3, **KW) as llm:
        seen = _count_outputs(llm)
        n_prompt = len(llm.tokenize(LONG_PROMPT.encode()))
        assert n_prompt > KW["n_batch"]  # chunked
        llm.create_completion(LONG_PROMPT, max_tokens=12, temperature=0.0)
        # the prompt but its last token comes first (its chunks end at n_batch and at the
        # checkpoints), asking for no logits at all
        k = next(i for i in range(len(seen) + 1) if sum(n for n, _ in seen[:i]) >= n_prompt - 1)
        prompt_decodes = seen[:k]
        assert sum(n for n, _ in prompt_decodes) == n_prompt - 1
        assert all(outputs == 0 for _, outputs in prompt_decodes), prompt_decodes
        # then, as llama.cpp's draft-mtp does: the held-back last token with a draft from it,
        # and the verification batches: every position sampled
        steps = seen[k:]
        assert steps[0][0] == 1 + 3, steps  # draft_max drafts after the last prompt token
        assert all(outputs == n for n, outputs in steps), steps


def test_a_completion_asks_for_the_sampled_rows_only_even_with_logits_all(half_path):
    """logits_all keeps the binding's every-row scores for its low-level eval; a completion's
    logprobs come from the rows sampling reads, so it asks for no more."""
    with Llama(half_path, draft="mtp", logits_all=True, **KW) as llm:
        seen = _count_outputs(llm)
        llm.create_completion(LONG_PROMPT, max_tokens=4, temperature=0.0)
        assert seen and all(outputs in (0, n) for n, outputs in seen) and seen[0][1] == 0
        seen.clear()
        tokens = llm.tokenize(b"the quick brown fox")
        llm.reset()
        llm.eval(tokens)  # the binding's eval with logits_all: every row, into scores
        assert seen == [(len(tokens), len(tokens))]
        assert np.isfinite(llm.scores[: len(tokens)]).all() and llm.n_tokens == len(tokens)


def test_after_a_rejected_draft_the_next_step_drafts(half_path):
    with Llama(half_path, draft="mtp", draft_max=3, **KW) as llm:
        calls = _proposals(llm)
        llm.create_completion(LONG_PROMPT, max_tokens=40, temperature=0.0)
        stats = llm.draft_stats.last
        assert 0 < stats.accepted < stats.drafted  # rejections happened
        # a draft after every step, rejected or not; each one drafted in full
        assert len(calls) >= stats.steps and all(n == want == 3 for want, n in calls if want == 3), calls
        t = llm.timings()
        assert t["draft_lengths"].get(3, 0) >= stats.steps - 1, t  # only the budget's end drafts less


def test_the_draft_context_is_derived_from_the_targets(half_path):
    with Llama(half_path, draft="mtp", type_k=llama_cpp.GGML_TYPE_Q8_0, type_v=llama_cpp.GGML_TYPE_Q8_0,
               flash_attn=True, offload_kqv=False, n_threads=1, **KW) as llm:
        t, d = llm.context_params, llm._draft_ctx.params
        for name in ("type_k", "type_v", "flash_attn_type", "offload_kqv", "n_ctx", "n_batch", "n_ubatch",
                     "n_seq_max", "n_threads", "n_threads_batch"):
            assert getattr(d, name) == getattr(t, name), name
        assert d.type_k == llama_cpp.GGML_TYPE_Q8_0 and d.offload_kqv is False
        assert d.ctx_type == llama_cpp.LLAMA_CONTEXT_TYPE_MTP and d.n_rs_seq == 0
    # and llama.cpp built it so: a q8_0 draft KV is smaller than an f16 one
    from llama_metaws.tools.plan import memory_breakdown

    sizes = {}
    for kind in (llama_cpp.GGML_TYPE_Q8_0, llama_cpp.GGML_TYPE_F16):
        with Llama(half_path, draft="mtp", type_k=kind, type_v=kind, flash_attn=True, **KW) as llm:
            sizes[kind] = sum(e["context"] for e in memory_breakdown(llm._draft_ctx).values())
    assert 0 < sizes[llama_cpp.GGML_TYPE_Q8_0] < sizes[llama_cpp.GGML_TYPE_F16]


def _logprobs(llm, **kw):
    out = llm.create_completion(LONG_PROMPT, max_tokens=40, temperature=0.0, logprobs=3, **kw)
    lp = out["choices"][0]["logprobs"]
    return out["choices"][0]["text"], lp["token_logprobs"], lp["top_logprobs"]


def test_logprobs_with_drafting_equal_those_without(half_path):
    with Llama(half_path, logits_all=True, **KW) as plain, \
            Llama(half_path, draft="mtp", logits_all=True, **KW) as llm:
        text0, lp0, top0 = _logprobs(plain)
        text1, lp1, top1 = _logprobs(llm)
        assert llm.draft_stats.last.drafted > 0
        assert len(llm.tokenize(LONG_PROMPT.encode())) + 40 > KW["n_batch"]
        assert text1 == text0 and len(lp1) == len(lp0) > 0
        np.testing.assert_allclose(np.array(lp1, dtype=float), np.array(lp0, dtype=float), atol=1e-4)
        for a, b in zip(top1, top0):
            assert a.keys() == b.keys()


def test_logprobs_without_logits_all_equal_the_bindings_with_it(half_path):
    binding = llama_cpp.Llama(half_path, logits_all=True, **KW)
    try:
        want = _logprobs(binding)
    finally:
        binding.close()
    for kw in (dict(), dict(draft="mtp")):
        with Llama(half_path, **KW, **kw) as llm:
            text, lp, top = _logprobs(llm)
        assert text == want[0] and len(lp) == len(want[1]) > 0
        np.testing.assert_allclose(np.array(lp, dtype=float), np.array(want[1], dtype=float), atol=1e-4)
        assert [sorted(a) for a in top] == [sorted(b) for b in want[2]]


def test_p_min_is_llama_cpps_top_10_probability():
    logits = np.full(151936, -30.0, dtype=np.float32)
    logits[:10] = [5.0] + [4.0] * 9
    p = _top_probability(logits)
    want = 1.0 / (1.0 + 9 * np.exp(-1.0))  # a softmax over the 10 best, not the whole vocabulary
    assert abs(p - want) < 1e-6
    # the long tail does not dilute it (over the whole vocabulary it would be far lower)
    logits[10:] = 3.0
    assert abs(_top_probability(logits) - want) < 1e-6


def test_adaptive_length_follows_acceptance():
    a = AdaptiveLength()
    assert a.next_step() == 1  # a fresh start probes with one token ...
    a.update(1, 1)
    assert a.next_step() == 2  # ... and once it is accepted doubles
    a.update(2, 2)
    assert a.next_step() == 4
    a.update(4, 4)
    assert a.next_step() == AdaptiveLength.CAP  # as far as the cap
    for _ in range(5):  # the third token is always rejected: two are drafted
        a.update(a.next_step(), 2)
    assert a.n == 2
    for _ in range(5):  # nothing accepted: no draft (plain decode steps)
        a.update(a.next_step(), 0)
    assert a.n == 0
    steps = 0
    while a.next_step() == 0:  # given up, the first depth is tried again before long
        steps += 1
    assert 0 < steps <= 1 / AdaptiveLength.RETRY
    for _ in range(20):  # accepted in full again: back to the cap
        a.update(a.next_step(), a.n)
    assert a.n == AdaptiveLength.CAP


def test_draft_max_auto_keeps_the_output(half_path, models_dir):
    """Whatever lengths it chooses (tests/test_draft_policy.py: from acceptance and costs), the
    output is the target's: with the costs it measured (on this CPU mostly plain steps), and with
    costs where drafting pays (a GPU's: every depth that agrees drafts)."""
    from llama_metaws.engine.policy import FixedCosts

    gpu = FixedCosts(target=lambda n: 0.010 + 0.0002 * n, catch_up=lambda n: 0.0005, draft=lambda m: 0.0008)
    full = str(make_tiny_mtp_model(models_dir / "drafting-full.gguf", seed=31, agreement=1.0))
    for path in (full, half_path):
        with Llama(path, **KW) as plain:
            want = plain.create_completion(LONG_PROMPT, max_tokens=40, temperature=0.0)["choices"][0]["text"]
        for costs in (None, gpu):
            with Llama(path, draft="mtp", draft_max="auto", **KW) as llm:
                if costs is not None:
                    llm._engine.set_costs(costs)
                calls = _proposals(llm)
                got = llm.create_completion(LONG_PROMPT, max_tokens=40, temperature=0.0)["choices"][0]["text"]
                assert got == want
                asked = [n for n, _ in calls]
                assert bool(asked) or costs is None
                assert not asked or (llm.context_params.n_rs_seq >= max(asked) and max(asked) <= AdaptiveLength.CAP)
                t = llm.timings()
                assert sum(t["draft_lengths"].values()) > 0 and 0.0 <= t["plain_steps_share"] <= 1.0


def test_draft_max_auto_on_the_command_line():
    import argparse

    from llama_metaws.cli.flags import draft_max_value

    assert draft_max_value("auto") == "auto" and draft_max_value("4") == 4
    for bad in ("0", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            draft_max_value(bad)
    with pytest.raises(ValueError, match="'auto'"):
        Llama("unused.gguf", draft="mtp", draft_max="sometimes")


@pytest.fixture(scope="module")
def full_path(models_dir):
    # a head that always agrees
    return str(make_tiny_mtp_model(models_dir / "drafting-full.gguf", seed=31, agreement=1.0))


def test_a_draft_cut_by_the_caller_is_not_counted_as_rejected(full_path):
    # generate() knows no max_tokens: a caller that stops after n tokens cuts the last draft
    # short; whatever step it stops in, nothing was rejected
    with Llama(full_path, draft="mtp", draft_max=2, **KW) as llm:
        prompt = llm.tokenize(LONG_PROMPT.encode())
        for n in (9, 10, 11):
            generate_n(llm, prompt, n)
            st = llm.draft_stats.last
            assert st.drafted > 0 and st.accepted == st.drafted, (n, st)


@pytest.mark.parametrize("max_tokens", [1, 5, 6, 9])
def test_no_draft_outlives_max_tokens(full_path, max_tokens):
    # as llama-speculative-simple sizes its drafts: a step yields its accepted drafts and one
    # token more, so it drafts at most one fewer than the request may still take
    with Llama(full_path, draft="mtp", draft_max=3, **KW) as llm:
        calls = _proposals(llm)
        out = llm.create_completion(LONG_PROMPT, max_tokens=max_tokens, temperature=0.0)
        assert out["usage"]["completion_tokens"] == max_tokens
        asked = [n for n, _ in calls]
        # every draft accepted (the head agrees), so the budget left is known at each step
        left, want = max_tokens, []
        while left > 0:
            k = min(3, left - 1)
            if k > 0:
                want.append(k)
            left -= k + 1
        assert asked == want, calls
        st = llm.draft_stats.last
        assert st.drafted == st.accepted == sum(asked), st
        # the stream and the chat path carry max_tokens too
        calls.clear()
        list(llm.create_completion(LONG_PROMPT, max_tokens=max_tokens, temperature=0.0, stream=True))
        assert [n for n, _ in calls] == want
        calls.clear()
        llm.create_chat_completion([{"role": "user", "content": LONG_PROMPT}], max_tokens=max_tokens,
                                   temperature=0.0)
        assert sum(n for n, _ in calls) <= max_tokens - 1 and all(n <= 3 for n, _ in calls), calls


def test_timings_follow_llama_cpps_phases(full_path, half_path):
    n_out = 12
    with Llama(half_path, **KW) as plain:
        plain.create_completion(LONG_PROMPT, max_tokens=n_out, temperature=0.0)
        t = plain.timings()
        # without drafting: the prompt phase ends with the first token
        assert t["prompt_ms"] == t["ttft_ms"] > 0
        assert t["predicted_n"] == n_out and t["decode_tokens"] == n_out - 1
        assert t["prompt_tokens_per_s"] == pytest.approx(t["prompt_n"] / t["prompt_ms"] * 1e3)
    with Llama(full_path, draft="mtp", draft_max=3, **KW) as llm:
        llm.create_completion(LONG_PROMPT, max_tokens=n_out, temperature=0.0)
        t = llm.timings()
        # with drafting: the prompt but its held-back last token, then every step (the first
        # one, decoding the held-back token with its draft, included)
        assert 0 < t["prompt_ms"] < t["ttft_ms"]
        assert t["prompt_n"] == t["prompt_tokens"] and t["cache_n"] == 0
        assert t["prompt_tokens_per_s"] == pytest.approx((t["prompt_n"] - 1) / t["prompt_ms"] * 1e3)
        assert t["predicted_n"] == t["decode_tokens"] == n_out
        assert t["decode_tokens_per_s"] == pytest.approx(n_out / t["predicted_ms"] * 1e3)
