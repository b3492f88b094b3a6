"""The patched Llama: a drop-in for llama_cpp.Llama with MTP drafting, devices, split modes."""

import math
import subprocess
import sys

import numpy as np
import pytest

import llama_cpp

from llama_metaws import Llama
from llama_metaws_dev.testing import EOS_TOKEN, make_tiny_model, make_tiny_mtp_model

KW = dict(n_ctx=256, n_batch=64, n_ubatch=64, verbose=False)
PROMPT = "the quick brown fox jumps"


@pytest.fixture(scope="module")
def agree_path(models_dir):
    return str(make_tiny_mtp_model(models_dir / "llm-agree.gguf", seed=21, agreement=0.8))


@pytest.fixture(scope="module")
def random_path(models_dir):
    return str(make_tiny_mtp_model(models_dir / "llm-random.gguf", seed=22))


def _text(llm, prompt=PROMPT, **kw):
    return llm.create_completion(prompt, max_tokens=kw.pop("max_tokens", 24), **kw)["choices"][0]["text"]


@pytest.mark.parametrize("split", [
    dict(split_mode="none"),
    dict(split_mode="layer", devices=["CPU", "CPU"]),
    dict(split_mode="tensor", devices=["CPU", "CPU"]),
])
def test_greedy_identity_with_and_without_drafting(agree_path, split):
    with Llama(agree_path, **KW, **split) as plain, Llama(agree_path, draft="mtp", **KW, **split) as llm:
        for prompt in (PROMPT, "a", PROMPT * 6):  # short, one chunk, longer than n_ubatch
            assert _text(llm, prompt, temperature=0.0) == _text(plain, prompt, temperature=0.0), prompt
        assert llm.draft_stats.total.drafted > 0 and llm.draft_stats.total.accepted > 0
        entries = llm.workspace_stats()
        # every buffer type with a need holds it (with a GPU backend and the layers on the CPU,
        # the GPU's entry may need nothing: ops are offloaded only for large batches)
        assert any(e.allocated > 0 for e in entries)
        assert all(e.allocated > 0 for e in entries if e.owner_need or e.borrower_need)
        if split["split_mode"] == "tensor":
            assert any(e.alias for e in entries)


@pytest.mark.parametrize("agreement,check", [(1.0, lambda a: a >= 0.9), (0.0, lambda a: a <= 0.1)])
def test_acceptance_follows_the_agreement_models(models_dir, agreement, check):
    path = str(make_tiny_mtp_model(models_dir / f"llm-a{agreement}.gguf", seed=23, agreement=agreement))
    with Llama(path, draft="mtp", **KW) as llm:
        _text(llm, max_tokens=40, temperature=0.0)
        last = llm.draft_stats.last
        assert last.drafted > 0
        assert check(last.acceptance), llm.draft_stats
        t = llm.timings()
        assert t["decode_tokens"] > 0 and t["decode_tokens_per_s"] > 0 and t["prompt_tokens_per_s"] > 0
        _text(llm, "b", max_tokens=20, temperature=0.0)
        assert llm.draft_stats.total.drafted > last.drafted  # total keeps counting
        t = llm.timings()
        assert t["decode_tokens"] > 0 and t["decode_tokens_per_s"] > 0
        # a prompt of one token to evaluate: it is the held-back one, the prompt phase has none
        assert (t["prompt_tokens_per_s"] > 0) == (t["prompt_n"] > 1), t


SAMPLING = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, max_tokens=3)


def test_sampled_decoding_with_a_fixed_seed_is_reproducible(random_path):
    with Llama(random_path, draft="mtp", **KW) as llm:
        a = [_text(llm, seed=s, **SAMPLING) for s in (1, 2, 3)]
        b = [_text(llm, seed=s, **SAMPLING) for s in (1, 2, 3)]
    assert a == b and len(set(a)) > 1


def _chi2_threshold(df: int, z: float = 3.09) -> float:
    """Upper 0.001 quantile of chi-square (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.slow
def test_sampled_tokens_keep_the_targets_distribution(random_path):
    """First token: chi-square against the target's softmax (p < 0.001 fails). Three tokens, the
    later ones decided with drafts in play: drafting must not change what a seed samples."""
    n = 400
    with Llama(random_path, logits_all=True, **KW) as plain:
        plain.eval(plain.tokenize(PROMPT.encode(), add_bos=False))
        logits = np.array(plain.scores[plain.n_tokens - 1], dtype=np.float64)
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        plain_pairs = [_text(plain, seed=s, **SAMPLING) for s in range(n)]
    with Llama(random_path, draft="mtp", **KW) as llm:
        # the TEST vocabulary prints a token as its id in hex; the end of generation prints nothing
        texts = [_text(llm, seed=s, **dict(SAMPLING, max_tokens=1)) for s in range(n)]
        first = [int(t, 16) if t else EOS_TOKEN for t in texts]
        pairs = [_text(llm, seed=s, **SAMPLING) for s in range(n)]
        drafted = llm.draft_stats.total.drafted

    counts = np.bincount(first, minlength=len(probs)).astype(float)
    expected = probs * n
    big = expected >= 5  # pool the rare tokens into one cell
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < _chi2_threshold(len(obs) - 1), (chi2, len(obs))

    assert drafted > 0
    same = sum(a == b for a, b in zip(pairs, plain_pairs))
    assert same >= 0.99 * n, f"{same}/{n} seeds sampled the same three tokens"


def test_a_request_longer_than_n_batch(agree_path):
    """Prompt plus output well past n_batch rows of logits (the binding keeps n_batch rows)."""
    prompt = "lorem ipsum dolor sit amet " * 20  # ~108 tokens in the TEST vocabulary
    kw = dict(KW, n_ctx=512, n_batch=64, n_ubatch=64)
    with Llama(agree_path, **kw) as plain, Llama(agree_path, draft="mtp", **kw) as llm:
        assert _text(llm, prompt, max_tokens=100, temperature=0.0) == _text(plain, prompt, max_tokens=100,
                                                                            temperature=0.0)
        assert llm.draft_stats.last.accepted > 0


def test_drop_in_features(agree_path):
    with Llama(agree_path, draft="mtp", logits_all=True, **KW) as llm:
        assert isinstance(llm, llama_cpp.Llama)
        toks = llm.tokenize(b"hello world", add_bos=False)
        assert toks and llm.detokenize(toks)
        full = _text(llm, temperature=0.0, max_tokens=12)
        assert llm(PROMPT, max_tokens=12, temperature=0.0)["choices"][0]["text"] == full
        streamed = "".join(c["choices"][0]["text"] for c in
                           llm.create_completion(PROMPT, max_tokens=12, temperature=0.0, stream=True))
        assert streamed == full
        stop = full[4:6]
        cut = _text(llm, temperature=0.0, max_tokens=12, stop=[stop])
        assert stop not in cut and full.startswith(cut)
        res = llm.create_completion(PROMPT, max_tokens=5, temperature=0.0, logprobs=3)
        assert res["usage"]["completion_tokens"] == 5
        assert len(res["choices"][0]["logprobs"]["tokens"]) == 5
        chat = llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0.0)
        assert chat["choices"][0]["message"]["role"] == "assistant"
        assert chat["choices"][0]["message"]["content"]


@pytest.mark.parametrize("chat_format", ["chatml", "llama.cpp"])  # the binding's handler, our chat layer
def test_id_slot_and_cache_prompt_are_arguments_of_each_completion_call(agree_path, chat_format):
    """llama-server's ``id_slot`` and ``cache_prompt`` go with the call, down to its engine request."""
    with Llama(agree_path, draft="mtp", n_seq_max=2, chat_format=chat_format, **KW) as llm:
        greedy = dict(max_tokens=6, temperature=0.0)
        text = llm(PROMPT, id_slot=1, **greedy)["choices"][0]["text"]
        assert llm.slots()[0]["n_past"] == 0 and llm.slots()[1]["n_past"] > 0
        assert _text(llm, id_slot=1, **greedy) == text and llm.timings()["cache_n"] > 0
        assert _text(llm, id_slot=1, cache_prompt=False, **greedy) == text and llm.timings()["cache_n"] == 0
        streamed = "".join(c["choices"][0]["text"] for c in
                           llm.create_completion(PROMPT, stream=True, id_slot=0, **greedy))
        assert streamed == text and llm.slots()[0]["n_past"] > 0

        chat = [{"role": "user", "content": "hi"}]
        llm.erase_slot(0), llm.erase_slot(1)
        first = llm.create_chat_completion(chat, id_slot=1, **greedy)["choices"][0]["message"]["content"]
        assert llm.slots()[0]["n_past"] == 0 and llm.slots()[1]["n_past"] > 0
        again = llm.create_chat_completion(chat, id_slot=1, cache_prompt=False, **greedy)
        assert again["choices"][0]["message"]["content"] == first and llm.timings()["cache_n"] == 0
        assert llm.slots()[0]["n_past"] == 0
        llm.create_chat_completion(chat, id_slot=1, **greedy)
        assert llm.timings()["cache_n"] > 0

        # a slot the model does not have: at the call, before a stream starts
        with pytest.raises(ValueError, match="slot 2: this model has slots 0 to 1"):
            llm.create_completion(PROMPT, stream=True, id_slot=2)
        with pytest.raises(ValueError, match="slot True: this model has slots 0 to 1"):
            llm.create_chat_completion(chat, id_slot=True)
        with pytest.raises(TypeError):  # the binding's arguments, and no others
            llm.create_completion(PROMPT, slot=1)


def test_bad_inputs_are_exceptions(agree_path, models_dir, tmp_path):
    plain_model = str(make_tiny_model(models_dir / "llm-llama.gguf", arch="llama"))
    with pytest.raises(ValueError, match="'llama' model has none"):
        Llama(plain_model, draft="mtp", **KW)
    with pytest.raises(ValueError, match=r"unknown device 'CUDA9'.*CPU"):
        Llama(agree_path, devices=["CUDA9"], **KW)
    with pytest.raises(ValueError, match="at least two"):
        Llama(agree_path, devices=["CPU"], split_mode="tensor", **KW)
    with pytest.raises(ValueError, match="split_mode 'diagonal'"):
        Llama(agree_path, split_mode="diagonal", **KW)
    with pytest.raises(ValueError, match="draft_max must be an integer >= 1"):
        Llama(agree_path, draft="mtp", draft_max=0, **KW)
    with pytest.raises(ValueError, match="does not exist"):
        Llama(str(tmp_path / "missing.gguf"), **KW)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(open(agree_path, "rb").read()[: 1 << 20])
    with pytest.raises(ValueError):
        Llama(str(truncated), draft="mtp", **KW)
    with pytest.raises(ValueError, match="allow_unsafe_workspace"):
        Llama(agree_path, draft="mtp", workspace_mode="unsafe-shared", **KW)
    llm = Llama(agree_path, draft="mtp", **KW)
    llm.close()
    llm.close()  # harmless


def test_one_options_object_checks_itself_and_builds_a_llama(agree_path):
    """``LlamaOptions`` holds our keyword arguments and checks them when made (the messages
    ``Llama``'s keywords give); ``Llama(path, options=...)`` loads from one, the same as the keywords."""
    from llama_metaws import LlamaOptions

    for bad, match in ((dict(draft="eagle"), "supported kinds"), (dict(draft_max=True), "draft_max must be"),
                       (dict(draft_p_min=1.5), r"draft_p_min must be in \[0, 1\]"),
                       (dict(workspace_mode="shared"), "is not one of"),
                       (dict(split_mode="diagonal"), "split_mode 'diagonal'"),
                       (dict(n_seq_max=0), "n_seq_max must be an integer >= 1"),
                       (dict(ctx_checkpoints=-1), "ctx_checkpoints must be"),
                       (dict(checkpoint_min_step=1.5), "checkpoint_min_step must be")):
        with pytest.raises(ValueError, match=match):
            LlamaOptions(**bad)
        with pytest.raises(ValueError, match=match):  # before the model file is even looked at
            Llama("/nonexistent/model.gguf", **bad)
    opts = LlamaOptions(draft="mtp", draft_max="auto", n_seq_max=2, use_extra_bufts=False)
    assert opts.adaptive and opts.draft_max_cap > 1 and opts.model_fields() == {"use_extra_bufts": False}
    with Llama(agree_path, options=LlamaOptions(draft="mtp", draft_max=2, n_seq_max=2), **KW) as llm, \
            Llama(agree_path, draft="mtp", draft_max=2, n_seq_max=2, **KW) as same:
        assert llm.options == same.options and len(llm.slots()) == 2 and llm.drafting
        assert _text(llm, temperature=0.0) == _text(same, temperature=0.0)
    with pytest.raises(TypeError, match="n_seq_max: give these in options="):
        Llama(agree_path, options=LlamaOptions(), n_seq_max=2, **KW)


# the server: tests/test_server.py


def test_the_cli_takes_llama_cpp_flags(agree_path):
    cmd = [sys.executable, "-m", "llama_metaws", "generate", "-m", agree_path, "--device", "CPU,CPU",
           "-sm", "tensor", "-ts", "0.55,0.45", "--spec-type", "draft-mtp", "--phase-aware-workspace",
           "-np", "2", "-c", "256", "-ub", "64", "-p", PROMPT, "-n", "16"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
    assert "draft:" in res.stderr and "alias=True" in res.stderr
    with Llama(agree_path, devices=["CPU", "CPU"], split_mode="tensor", n_seq_max=2, **KW) as plain:
        assert res.stdout.strip() == _text(plain, max_tokens=16, temperature=0.0).strip()
    bad = subprocess.run([sys.executable, "-m", "llama_metaws", "generate", "-m", agree_path,
                          "-p", "x", "--draft-pmin", "0.5"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--draft-pmin" in bad.stderr
