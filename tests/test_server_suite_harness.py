"""The harness of ``make server-suite`` (tests/server_suite): the llama-server shim's flag mapping,
the expected-failures list and the count. The suite itself runs in ``make server-suite``."""

import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "server_suite"
sys.path.insert(0, str(HERE))

import expected  # noqa: E402
import run  # noqa: E402


def _shim():
    loader = importlib.machinery.SourceFileLoader("lmws_llama_server_shim", str(HERE / "llama-server"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_the_shim_maps_llama_servers_flags_onto_serve(monkeypatch, tmp_path):
    monkeypatch.setenv("LMWS_SUITE_MODELS", str(tmp_path))
    shim = _shim()
    argv = ["--port", "8080", "--temp", "0.8", "--seed", "42", "--host", "127.0.0.1", "--offline",
            "--hf-repo", "ggml-org/test-model-stories260K", "--batch-size", "32", "--no-slots", "--alias",
            "tinyllama-2", "--ctx-size", "512", "--parallel", "2", "--n-predict", "64", "--no-jinja"]
    out = shim.translate(argv)
    assert out[:2] == ["-m", str(tmp_path / "tinyllama.gguf")]
    assert "--offline" not in out and "--hf-repo" not in out
    assert out[2:] == ["--port", "8080", "--temp", "0.8", "--seed", "42", "--host", "127.0.0.1", "--batch-size",
                       "32", "--no-slots", "--alias", "tinyllama-2", "--ctx-size", "512", "--parallel", "2",
                       "--n-predict", "64", "--no-jinja"]  # llama.cpp's built-in templates by name
    # the speculative preset: its draft model becomes the MTP stand-in's own head
    out = shim.translate(["--hf-repo", "ggml-org/stories15M_MOE", "--hf-file", "x.gguf", "--model-draft",
                          "tmp/stories15M-q4_0.gguf", "--spec-type", "draft-simple", "--spec-draft-n-min", "4",
                          "--spec-draft-n-max", "8"])
    assert out == ["-m", str(tmp_path / "tiny-mtp.gguf"), "--spec-draft-n-max", "8", "--spec-type", "draft-mtp"]
    # a code model gets the FIM stand-in, a repository with a quant tag the default one, no model too
    assert shim.translate(["--hf-repo", "ggml-org/Qwen2.5-Coder-1.5B-IQ3_XXS-GGUF"])[1].endswith("tinyllama-infill.gguf")
    assert shim.translate(["--hf-repo", "bartowski/Phi-3.5-mini-instruct-GGUF:Q4_K_M"])[1].endswith("tinyllama.gguf")
    assert shim.translate(["--port", "1"])[:2] == ["-m", str(tmp_path / "tinyllama.gguf")]
    # a flag serve does not know passes through, for serve to refuse by name
    assert shim.translate(["--frobnicate", "3"])[2:] == ["--frobnicate", "3"]


def test_the_expected_failures_list_parses_and_matches(tmp_path):
    entries = expected.load_expected(HERE / "expected_failures.txt")
    assert entries and all(e.category in expected.CATEGORIES and e.reason for e in entries)
    f = tmp_path / "list.txt"
    f.write_text("# comment\n\nunit/test_a.py | embedding: needs one\n"
                 "unit/test_b.py::* | not-served: later\n"
                 "unit/test_b.py::test_x[1] | real-model: its text\n")
    es = expected.load_expected(f)
    assert expected.match(es, "unit/test_a.py::test_q").is_file
    assert expected.match(es, "unit/test_b.py::test_x[1]").category == "real-model"  # exact over prefix
    assert expected.match(es, "unit/test_b.py::test_x[2]").category == "not-served"
    assert expected.match(es, "unit/test_c.py::test_x") is None
    f.write_text("unit/test_a.py | sometimes: no such category\n")
    with pytest.raises(ValueError, match="category must be one of"):
        expected.load_expected(f)
    f.write_text("unit/test_a.py no separator\n")
    with pytest.raises(ValueError, match="ENTRY | CATEGORY"):
        expected.load_expected(f)


def test_the_count_leaves_real_model_tests_out_and_names_unlisted_failures(tmp_path):
    f = tmp_path / "list.txt"
    f.write_text("unit/t.py::real | real-model: text\nunit/t.py::later | not-served: item 9\n"
                 "unit/t.py::fixed | not-served: item 8\n")
    es = expected.load_expected(f)
    c = run.count({"unit/t.py::ok": "passed", "unit/t.py::real": "xfailed", "unit/t.py::later": "xfailed",
                   "unit/t.py::fixed": "xpassed", "unit/t.py::new": "failed", "unit/t.py::slow": "deselected",
                   "unit/t.py::skip": "skipped"}, es)
    assert c["tally"]["in_scope"] == 5 and c["tally"]["slow"] == 1 and c["tally"]["skipped"] == 1
    assert c["counted"] == 4 and c["passed_counted"] == 2  # ok and fixed, of all but real
    assert c["unexpected"] == ["unit/t.py::new"] and c["listed_passing"] == ["unit/t.py::fixed"]
    assert c["by_category"] == {"real-model": 1, "not-served": 1}


def test_the_stand_ins_tokenize_any_text_and_carry_fim_tokens(tmp_path):
    code = f"""
import llama_metaws
from llama_metaws import Llama
import sys
sys.path.insert(0, {str(HERE)!r})
import run
run.write_standins(__import__('pathlib').Path({str(tmp_path)!r}))
llm = Llama({str(tmp_path / 'tinyllama-infill.gguf')!r}, n_ctx=256, verbose=False)
text = "unicode 媽 and emoji 🤗"
toks = llm.tokenize(text.encode(), add_bos=True, special=True)
assert toks[0] == llm.token_bos(), toks
assert llm.detokenize(toks[1:]).decode().strip() == text, llm.detokenize(toks[1:])
fim = llm.tokenize(b"<|fim_prefix|>", add_bos=False, special=True)
from llama_cpp import llama_cpp as C
assert fim == [C.llama_vocab_fim_pre(llm._model.vocab)] and fim[0] > 0, fim
llm.close()
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr
