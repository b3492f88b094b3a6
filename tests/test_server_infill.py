"""``POST /infill`` as llama-server serves it (tools/server/README.md): a coder's FIM prompt from
``input_prefix``, ``input_suffix``, ``input_extra`` and ``prompt``, then ``/completion``'s answer.

The model: a tiny one with the ``fim`` vocabulary (Qwen2.5-Coder's FIM tokens as control tokens,
named in the GGUF's ``tokenizer.ggml.fim_*_token_id`` keys). A model without them gets a 400.
"""

import pytest

from llama_metaws_dev.testing import make_tiny_model
from serving import Server, llama_error

PRE, SUF, MID, REP, SEP = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>"
BODY = {"input_prefix": "int main() {\n", "prompt": "    int n = ", "input_suffix": "}\n",
        "input_extra": [{"filename": "llama.h", "text": "int llama_n(void);\n"}], "n_predict": 6,
        "temperature": 0}
N_BATCH = 64


@pytest.fixture(scope="module")
def fim_model(models_dir):
    return make_tiny_model(models_dir / "infill-fim.gguf", seed=61, vocab="fim")


@pytest.fixture(scope="module")
def server(fim_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("infill")
    srv = Server(fim_model, "-c", "512", "-b", str(N_BATCH), "-ub", str(N_BATCH), "--temp", "0",
                 log_path=tmp / "infill.log")
    yield from srv.running()


@pytest.fixture(scope="module")
def plain_server(models_dir, tmp_path_factory):
    model = make_tiny_model(models_dir / "infill-chars.gguf", seed=61, vocab="chars")
    srv = Server(model, "-c", "256", log_path=tmp_path_factory.mktemp("infill-plain") / "plain.log")
    yield from srv.running()


def test_the_prompt_is_laid_out_as_llama_server_lays_it_out(server):
    status, res = server.json("POST", "/infill", BODY)
    assert status == 200, res
    assert res["prompt"] == (f"{REP}myproject\n{SEP}llama.h\nint llama_n(void);\n{SEP}filename\n"
                             f"{PRE}int main() {{\n    int n = {SUF}}}\n{MID}")
    assert res["stop"] is True and 1 <= res["tokens_predicted"] <= 6  # a FIM separator sampled ends it (EOG)


def test_infill_generates_what_completion_generates_for_the_same_tokens(server):
    status, res = server.json("POST", "/infill", dict(BODY, return_tokens=True))
    assert status == 200, res
    status, tok = server.json("POST", "/tokenize", {"content": res["prompt"], "parse_special": True})
    assert status == 200, tok
    fim_ids = tok["tokens"]
    assert len(fim_ids) < len(res["prompt"])  # the FIM markers are single tokens, not their characters
    status, plain = server.json("POST", "/completion", {"prompt": fim_ids, "n_predict": 6, "temperature": 0,
                                                        "return_tokens": True})
    assert status == 200, plain
    assert plain["tokens"] == res["tokens"] and plain["content"] == res["content"]
    assert res["tokens_evaluated"] == len(fim_ids)


def test_infill_streams_as_completion_does(server):
    status, whole = server.json("POST", "/infill", BODY)
    assert status == 200, whole
    events = server.events("/infill", dict(BODY, stream=True))
    assert events[-1]["stop"] is True
    assert "".join(e["content"] for e in events[:-1]) == whole["content"]


def test_the_prefix_keeps_its_end_and_the_suffix_its_start_within_a_batch(server):
    body = {"input_prefix": "x" * 200 + "TAIL", "input_suffix": "HEAD" + "y" * 200, "n_predict": 1}
    status, res = server.json("POST", "/infill", body)
    assert status == 200, res
    prompt = res["prompt"]
    pre = prompt[prompt.index(PRE) + len(PRE):prompt.index(SUF)]
    suf = prompt[prompt.index(SUF) + len(SUF):prompt.index(MID)]
    # 3/4 of a batch for the prefix's last tokens, what is left of a quarter for the suffix's first
    assert pre.endswith("TAIL") and 0 < len(pre) <= 3 * N_BATCH // 4
    assert suf.startswith("HEAD") and 0 < len(suf) <= N_BATCH // 4 - 2


@pytest.mark.parametrize("extra", [{}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"},
                                   {"filename": 123, "text": 456}])
def test_a_bad_input_extra_is_a_400(server, extra):
    status, res = server.json("POST", "/infill", dict(BODY, input_extra=[extra]))
    assert status == 400 and "extra_context chunk" in llama_error(res, 400)["message"], res


@pytest.mark.parametrize("body, message", [
    ({"input_suffix": "}"}, '"input_prefix" is required'),
    ({"input_prefix": "a"}, '"input_suffix" is required'),
    ({"input_prefix": "a", "input_suffix": "b", "prompt": 3}, '"prompt" must be a string'),
    ({"input_prefix": "a", "input_suffix": "b", "input_extra": "no"}, '"input_extra" must be an array'),
])
def test_missing_or_bad_fields_are_400s(server, body, message):
    status, res = server.json("POST", "/infill", body)
    assert status == 400 and message in llama_error(res, 400)["message"], res


def test_a_model_without_fim_tokens_gets_a_400_that_says_so(plain_server):
    status, res = plain_server.json("POST", "/infill", BODY)
    error = llama_error(res, 400)
    assert status == 400 and error["message"] == ("Infill is not supported by this model: prefix token is "
                                                  "missing. suffix token is missing. middle token is missing."), res
    assert plain_server.json("GET", "/health")[0] == 200


def test_spm_infill_puts_the_suffix_first(fim_model):
    from llama_metaws.server.infill import FimTokens, layout
    from llama_metaws.server.validation import ModelAccess
    from llama_metaws.server.worker import ServedLlama

    with ServedLlama(str(fim_model), n_ctx=256, n_batch=N_BATCH, verbose=False) as llm:
        model = ModelAccess(llm)
        fim = FimTokens(llm)
        kw = dict(n_batch=N_BATCH, n_predict=-1)
        psm = layout(model, fim, "ab", "cd", [], "", spm=False, **kw)
        spm = layout(model, fim, "ab", "cd", [], "", spm=True, **kw)
        text = lambda ids: llm.detokenize(ids, special=True).decode()  # noqa: E731
        assert text(psm) == f"{REP}myproject\n{SEP}filename\n{PRE}ab{SUF}cd{MID}"
        assert text(spm) == f"{REP}myproject\n{SEP}filename\n{SUF}cd{PRE}ab{MID}"
