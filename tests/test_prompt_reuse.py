"""Prompt reuse on a hybrid target (qwen35) with MTP drafting: checkpoints, the live state, the
binding's save_state/load_state and LlamaRAMCache; every reused request equals a fresh run."""

import llama_cpp
import numpy as np
import pytest

from llama_metaws import Llama
from llama_metaws.engine.checkpoints import PrefixReuse, common_prefix
from llama_metaws_dev.testing import N_VOCAB, generate_n, make_tiny_mtp_model

KW = dict(n_ctx=256, n_batch=64, n_ubatch=64, verbose=False)
EVERY = 16
P1 = [(7 * i + 3) % N_VOCAB for i in range(40)]
NEW = [(11 * i + 5) % N_VOCAB for i in range(10)]
GREEDY = dict(temp=0.0)
SAMPLED = dict(temp=1.0, top_k=0, top_p=1.0, min_p=0.0)


@pytest.fixture(scope="module")
def agree_path(models_dir):
    return str(make_tiny_mtp_model(models_dir / "reuse-agree.gguf", seed=21, agreement=0.8))


@pytest.fixture(scope="module")
def random_path(models_dir):
    return str(make_tiny_mtp_model(models_dir / "reuse-random.gguf", seed=22))


def run(llm, tokens, n, seed=None, **sampling):
    """``n`` tokens of ``llm.generate`` (closed after them, as create_completion does)."""
    if seed is not None:
        llm.set_seed(seed)
    return generate_n(llm, tokens, n, **(sampling or GREEDY))


def fresh_run(path, tokens, n, split, seed=None, **sampling):
    with Llama(path, draft="mtp", **KW, **split) as fresh:
        out = run(fresh, tokens, n, seed=seed, **sampling)
        assert fresh.timings()["cache_n"] == 0
        return out


@pytest.mark.parametrize("split", [dict(), dict(split_mode="tensor", devices=["CPU", "CPU"])],
                         ids=["one-device", "tensor-split"])
@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_a_second_turn_equals_a_fresh_run(agree_path, random_path, split, mode):
    path, sampling, seed = (agree_path, GREEDY, None) if mode == "greedy" else (random_path, SAMPLED, 7)
    with Llama(path, draft="mtp", checkpoint_min_step=EVERY, **KW, **split) as llm:
        assert llm.checkpoint_stats()["enabled"]
        a1 = run(llm, P1, 12, seed=seed, **sampling)
        held = list(llm.input_ids[: llm.n_tokens])
        p2 = P1 + a1 + NEW  # history, the first answer, new text
        a2 = run(llm, p2, 12, seed=seed, **sampling)
        t = llm.timings()
        assert llm.workspace_stats()  # the shared workspace is in play
        if mode == "greedy":
            assert llm.draft_stats.total.accepted > 0
    assert a2 == fresh_run(path, p2, 12, split, seed=seed, **sampling)
    common = common_prefix(held, p2)
    assert common >= len(P1) + len(a1) - 1
    assert t["cache_n"] >= common - EVERY and t["cache_n"] + t["prompt_n"] == len(p2)


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_a_prompt_diverging_after_a_checkpoint_restores_it(agree_path, random_path, mode):
    path, sampling, seed = (agree_path, GREEDY, None) if mode == "greedy" else (random_path, SAMPLED, 3)
    with Llama(path, draft="mtp", checkpoint_min_step=EVERY, **KW) as llm:
        run(llm, P1, 12, seed=seed, **sampling)
        # every 16 tokens, 4 before the end (llama-server's choice) and at the end of what the
        # prompt decodes before its last token (held back, decoded with the first draft)
        assert llm.checkpoint_stats()["positions"] == [16, 32, 36, 39]
        p2 = P1[:35] + NEW  # diverges at 35: the newest checkpoint inside is at 32
        a2 = run(llm, p2, 12, seed=seed, **sampling)
        t, stats = llm.timings(), llm.checkpoint_stats()
    assert stats["restored"] == 1
    assert t["cache_n"] == 32 and t["prompt_n"] == len(p2) - 32
    assert a2 == fresh_run(path, p2, 12, {}, seed=seed, **sampling)


def test_a_prompt_diverging_before_every_checkpoint_is_evaluated_in_full(agree_path):
    with Llama(agree_path, draft="mtp", checkpoint_min_step=EVERY, **KW) as llm:
        run(llm, P1, 8)
        p2 = P1[:10] + NEW  # before the first checkpoint (16); the live state is at 47
        a2 = run(llm, p2, 10)
        t = llm.timings()
        assert t["cache_n"] == 0 and t["prompt_n"] == len(p2)
        assert llm.checkpoint_stats()["restored"] == 0
        p3 = [(P1[0] + 1) % N_VOCAB] + P1[1:]  # differs at the very first token
        a3 = run(llm, p3, 10)
        assert llm.timings()["cache_n"] == 0 and llm.timings()["prompt_n"] == len(p3)
    assert a2 == fresh_run(agree_path, p2, 10, {})
    assert a3 == fresh_run(agree_path, p3, 10, {})


def test_checkpoint_memory_stays_within_its_bounds_over_20_requests(agree_path):
    with Llama(agree_path, draft="mtp", checkpoint_min_step=EVERY, **KW) as probe:
        run(probe, P1[:20], 1)
        s = probe.checkpoint_stats()
        one = s["bytes"] // s["count"]
    bound = int(2.5 * one)  # two checkpoints fit, never three
    rng = np.random.default_rng(5)
    with Llama(agree_path, draft="mtp", checkpoint_min_step=EVERY, ctx_checkpoints=4,
               ctx_checkpoints_bytes=bound, **KW) as llm:
        history = list(P1)
        for i in range(20):
            if i % 3 == 2:  # now and then another conversation
                history = [int(x) for x in rng.integers(0, N_VOCAB, size=int(rng.integers(20, 50)))]
            out = run(llm, history, 6)
            s = llm.checkpoint_stats()
            assert s["bytes"] <= bound and s["count"] <= min(4, 2), s
            assert s["count"] >= 1
            history = (history + out + [int(x) for x in rng.integers(0, N_VOCAB, size=5)])[-150:]
        assert s["evicted"] > 0 and s["saved"] >= 20 and s["max_bytes"] == bound
    with Llama(agree_path, draft="mtp", ctx_checkpoints_bytes=one // 2, **KW) as small:
        run(small, P1, 2)  # no checkpoint fits: none kept, nothing breaks
        assert small.checkpoint_stats()["count"] == 0 and small.checkpoint_stats()["skipped"] >= 1


def test_bad_checkpoint_arguments_are_value_errors(agree_path):
    for kw in (dict(ctx_checkpoints=-1), dict(checkpoint_min_step=-5), dict(checkpoint_min_step="16"),
               dict(ctx_checkpoints_bytes=1.5), dict(ctx_checkpoints=True)):
        with pytest.raises(ValueError, match="ctx_checkpoints|checkpoint_min_step"):
            Llama(agree_path, draft="mtp", **kw, **KW)


def test_without_checkpoints_the_live_state_is_still_reused(agree_path):
    with Llama(agree_path, draft="mtp", ctx_checkpoints=0, **KW) as llm:
        a1 = run(llm, P1, 8)
        p2 = P1 + a1 + NEW
        a2 = run(llm, p2, 8)
        assert llm.checkpoint_stats()["count"] == 0
        assert llm.timings()["cache_n"] >= len(P1) + len(a1) - 1
        run(llm, P1[:30] + NEW, 4)  # inside the history: no checkpoint, a full evaluation
        assert llm.timings()["cache_n"] == 0
    assert a2 == fresh_run(agree_path, p2, 8, {})


def test_save_state_and_load_state_carry_the_draft_context(agree_path):
    with Llama(agree_path, draft="mtp", **KW) as llm:
        a1 = run(llm, P1, 10)
        state = llm.save_state()
        run(llm, NEW * 3, 10)  # something else in between
        llm.load_state(state)
        p2 = P1 + a1 + NEW
        a2 = run(llm, p2, 10)
        assert llm.timings()["cache_n"] >= len(P1) + len(a1) - 1
        assert llm.draft_stats.last.accepted > 0  # the draft context was restored with it
        with Llama(agree_path, **KW) as plain:  # no drafting: a state without the draft context
            run(plain, P1, 2)
            with pytest.raises(ValueError, match="draft context"):
                llm.load_state(plain.save_state())
    assert a2 == fresh_run(agree_path, p2, 10, {})


def test_llama_ram_cache_with_drafting(agree_path):
    kw = dict(KW, ctx_checkpoints=0)  # only the cache can bring a's state back
    with Llama(agree_path, draft="mtp", **kw) as llm:
        llm.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=1 << 26))
        llm.create_completion(P1, max_tokens=10, temperature=0.0)
        held = [int(t) for t in llm.input_ids[: llm.n_tokens]]  # a's prompt and answer
        llm.create_completion(NEW * 3, max_tokens=10, temperature=0.0)
        again = held + NEW
        got = llm.create_completion(again, max_tokens=10, temperature=0.0)["choices"][0]["text"]
        assert llm.timings()["cache_n"] == len(held)  # the cached state of a came back
        assert llm.draft_stats.last.accepted > 0
    with Llama(agree_path, draft="mtp", **KW) as fresh:
        want = fresh.create_completion(again, max_tokens=10, temperature=0.0)["choices"][0]["text"]
    assert got == want


def test_the_same_prompt_again_restores_the_checkpoint_before_its_last_token(agree_path):
    with Llama(agree_path, draft="mtp", **KW) as llm:
        first = run(llm, P1, 10)  # from scratch: the reference
        assert llm.checkpoint_stats()["positions"] == [len(P1) - 4, len(P1) - 1]
        again = run(llm, P1, 10)
        # the checkpoint where the prompt's decoding stopped before its held-back last token
        assert llm.timings()["cache_n"] == len(P1) - 1 and llm.timings()["prompt_n"] == 1
    assert again == first


@pytest.mark.parametrize("draft_max,logits_all", [(1, False), (3, False), (3, True)])
def test_a_prompt_parting_in_its_last_tokens_restores_the_tail_checkpoint(agree_path, draft_max, logits_all):
    kw = dict(KW, draft_max=draft_max, logits_all=logits_all)
    with Llama(agree_path, draft="mtp", **kw) as llm:
        sizes, decode = [], llm._engine.decode_target

        def counted(b, *args):
            sizes.append(b.n)
            return decode(b, *args)

        llm._engine.decode_target = counted
        run(llm, P1, 8)
        assert llm.checkpoint_stats()["positions"] == [len(P1) - 4, len(P1) - 1]
        if draft_max >= 3:  # the snapshots reach 3 back: one batch, read from them (logits_all
            assert sizes[0] == len(P1) - 1  # asks for no prompt row: only the rows sampling reads)
        else:  # they do not: the batches end there
            assert sizes[:2] == [len(P1) - 4, 3]
        p2 = P1[:38] + NEW  # parts from P1 between the tail checkpoint (36) and the end
        a2 = run(llm, p2, 12)
        t, stats = llm.timings(), llm.checkpoint_stats()
    assert stats["restored"] == 1
    assert t["cache_n"] == len(P1) - 4 and t["prompt_n"] == len(p2) - t["cache_n"]
    with Llama(agree_path, draft="mtp", **kw) as fresh:
        assert a2 == run(fresh, p2, 12)


@pytest.mark.parametrize("n,n_batch,reach,every,want", [
    # the tail (n - 4) read 3 back from the end of the prompt's one chunk
    (40, 64, 3, 8192, [(0, 39, [3, 0])]),
    # no snapshots that far: the chunks end at the tail too
    (40, 64, 2, 8192, [(0, 36, [0]), (36, 3, [0])]),
    # n_batch would end the first chunk between the tail and the end: it ends at the tail
    (66, 64, 3, 8192, [(0, 62, [0]), (62, 3, [0])]),
    # -cms 0, no minimum: every chunk's end takes one (the tail's chunk ends there)
    (100, 32, 3, 0, [(0, 32, [0]), (32, 32, [0]), (64, 32, [0]), (96, 3, [0])]),
    # ... and the last chunk reads the tail back from its snapshots
    (90, 32, 3, 0, [(0, 32, [0]), (32, 32, [0]), (64, 25, [3, 0])]),
    # the tail on a multiple of every: one checkpoint there
    (36, 64, 3, 16, [(0, 16, [0]), (16, 16, [0]), (32, 3, [0])]),
    # every 16 and the tail 3 back from the end
    (40, 64, 3, 16, [(0, 16, [0]), (16, 16, [0]), (32, 7, [3, 0])]),
])
def test_prompt_chunks_end_at_checkpoints_but_the_one_read_back(n, n_batch, reach, every, want):
    from llama_metaws.engine.checkpoints import CheckpointStore
    from llama_metaws.engine.request import Request
    from llama_metaws.engine.schedule import _prompt_chunk
    from llama_metaws.engine.slots import Slot

    def chunks(recurrent):
        slot = Slot(0, 256, 8, CheckpointStore())
        slot.request = Request(list(range(n)))
        slot.cursor, slot.prompt_end = 0, n - 1  # the last token held back
        PrefixReuse(recurrent=recurrent, reach=reach, checkpoint_min_step=every).stops(slot, 0, n - 1, n)
        out = []
        while slot.cursor < slot.prompt_end:
            seg = _prompt_chunk(slot, n_batch, n_batch)
            out.append((seg.pos0, seg.n, seg.backs))
            slot.cursor += seg.n
        return out

    assert chunks(True) == want
    # a target without recurrent state takes no checkpoints: chunks of n_batch
    assert chunks(False) == [(s, min(n_batch, n - 1 - s), []) for s in range(0, n - 1, n_batch)]
