"""Grammars and sampling that fail one request, never the process (native/sampler.cpp, engine.sampling).

What used to end the process is run in a child process, so that a regression is a failed test
with the child's last words rather than a dead test run: a grammar llama.cpp cannot parse
(llama_sampler_init_grammar returns NULL, the binding adds it to its chain: a segfault), and a
grammar no token of the vocabulary can continue (every candidate's logit -inf, the greedy
sampler selects one anyway, and the grammar's accept throws "Unexpected empty grammar stack
after accepting piece" through ctypes: std::terminate).
"""

import json
import subprocess
import sys
import textwrap

import pytest

from llama_metaws_dev.testing import EOS_TOKEN, make_tiny_model, make_tiny_mtp_model, split_devices
from llama_metaws.tools.children import child_env


@pytest.fixture(scope="module")
def chars_model(models_dir):
    """A tiny model whose vocabulary has characters: JSON can be generated."""
    return make_tiny_model(models_dir / "sampling-chars.gguf", seed=52, vocab="chars")


@pytest.fixture(scope="module")
def chars_mtp_model(models_dir):
    return make_tiny_mtp_model(models_dir / "sampling-chars-mtp.gguf", seed=51, agreement=0.8, vocab="chars")


def _child(code: str, *args):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], capture_output=True,
                          text=True, timeout=180, env=child_env())


# --- in a child: what used to end the process --------------------------------------------

DEAD_END = """
    import sys
    from llama_metaws import Llama
    from llama_metaws.errors import GrammarError
    from llama_metaws.native.binding import llama_cpp

    llm = Llama(sys.argv[1], n_ctx=128, verbose=False)
    for text in sys.argv[2:]:
        grammar = llama_cpp.LlamaGrammar.from_string(text, verbose=False)
        try:
            llm.create_completion("0 1 2", max_tokens=4, temperature=float(0), grammar=grammar)
            print("no error")
        except GrammarError as e:
            print("GrammarError:", e)
    # the model goes on, and a grammar it can meet works
    out = llm.create_completion("0 1 2", max_tokens=4, temperature=float(0),
                                grammar=llama_cpp.LlamaGrammar.from_string('root ::= [0-9a-f]+', verbose=False))
    print("after:", out["choices"][0]["text"])
    print("done", flush=True)
"""


def test_a_grammar_the_vocabulary_cannot_meet_fails_the_request_not_the_process(tiny_model):
    # the TEST vocabulary prints hex digits only: no token starts a JSON object
    res = _child(DEAD_END, tiny_model, 'root ::= "{" [a-z]* "}"', 'root ::= "0" "{"')
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith("GrammarError: no token can be sampled"), res.stdout
    assert lines[1].startswith("GrammarError: no token can be sampled"), res.stdout  # after one token
    assert lines[2].startswith("after: ") and len(lines[2]) > len("after: ") and lines[3] == "done"
    assert "terminate called" not in res.stderr and "Unexpected empty grammar stack" not in res.stderr


def test_a_grammar_that_does_not_parse_is_a_grammar_error_with_llama_cpps_message(tiny_model):
    res = _child(DEAD_END, tiny_model, "root ::= (", 'root ::= "a"\nroot ::= root "b"', 'start ::= "a"')
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0] == "GrammarError: the grammar is not valid: expecting ')' at", res.stdout
    assert "left recursion" in lines[1], res.stdout
    assert lines[2] == "GrammarError: the grammar is not valid: grammar does not contain a 'root' symbol"
    assert lines[-1] == "done"


def test_accept_refuses_what_the_grammar_does_not_allow(tiny_model):
    """An end-of-generation token before the grammar is complete aborted in llama.cpp
    (GGML_ABORT in llama_grammar_accept_impl); a token the grammar rejects threw."""
    code = """
        import sys
        from llama_metaws import Llama
        from llama_metaws.engine import sampling
        from llama_metaws.native.binding import llama_cpp

        llm = Llama(sys.argv[1], n_ctx=128, verbose=False)
        # with a logits processor in the chain too: the binding's Python sampler has no name
        # function, which llama_sampler_name would call
        chain = llm._init_sampler(temp=0.0, grammar=llama_cpp.LlamaGrammar.from_string('root ::= "1" "2"', verbose=False),
                                  logits_processor=llama_cpp.LogitsProcessorList([lambda ids, scores: scores]))
        for token in (int(sys.argv[2]), 5, 1):
            try:
                chain.accept(token)
                print("accepted", token)
            except sampling.GrammarError as e:
                print("refused", token, e)
        print("done", flush=True)
    """
    res = _child(code, tiny_model, EOS_TOKEN)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines() == [
        f"refused {EOS_TOKEN} token {EOS_TOKEN} is not allowed by the grammar here",
        "refused 5 token 5 is not allowed by the grammar here",
        "accepted 1",
        "done"], res.stdout


def test_what_a_triggered_lazy_grammar_throws_is_a_sampling_error(tiny_model):
    """A lazy grammar waits for its trigger token, then accepts it: when the token's text does
    not fit, llama.cpp throws from accept; the shim catches it."""
    code = """
        import ctypes, sys
        from llama_metaws import Llama
        from llama_metaws.engine import sampling
        from llama_metaws.errors import GrammarError, SamplingError
        from llama_metaws.native.binding import llama_cpp

        llm = Llama(sys.argv[1], n_ctx=128, verbose=False)
        tokens = (llama_cpp.llama_token * 1)(5)
        smpl = llama_cpp.llama_sampler_init_grammar_lazy_patterns(
            llm._model.vocab, b'root ::= "x"', b"root", None, 0, tokens, 1)
        try:
            sampling.accept(smpl, 5)  # the trigger, whose text "5" the grammar cannot take
            print("accepted")
        except GrammarError as e:
            print("GrammarError", e)
        except SamplingError as e:
            print("SamplingError", e)
        print("done", flush=True)
    """
    res = _child(code, tiny_model)
    assert res.returncode == 0, res.stderr[-3000:]
    first = res.stdout.splitlines()[0]
    assert first.startswith("SamplingError llama.cpp's sampler threw: Unexpected empty grammar stack"), res.stdout


# --- in process ----------------------------------------------------------------------------


def test_check_grammar_refuses_what_would_overflow_the_stack_before_llama_cpp_parses_it(tiny_model):
    from llama_metaws import Llama
    from llama_metaws.engine import sampling

    with Llama(str(tiny_model), n_ctx=128, verbose=False) as llm:
        llm.check_grammar('root ::= ("a" | [b-c])+ # ( not counted in a comment\n')
        llm.check_grammar('root ::= "(((" [(] ")"')  # nor in literals and classes
        deep = "root ::= " + "(" * 20000 + '"a"' + ")" * 20000  # overflows an 8 MiB stack in llama.cpp
        with pytest.raises(sampling.GrammarError, match="nests groups 20000 deep; at most 256"):
            llm.check_grammar(deep)
        chain = "root ::= a0\n" + "".join(f"a{i} ::= a{i + 1}\n" for i in range(5000)) + 'a5000 ::= "x"\n'
        with pytest.raises(sampling.GrammarError, match="more than 4096 rules"):
            llm.check_grammar(chain)
        with pytest.raises(ValueError, match="expecting ::= at"):  # GrammarError is a ValueError
            llm.check_grammar('root = "a"')
        assert sampling.grammar_depth('a ::= ((b) (c ("d")))') == 3


def test_json_response_format_and_forced_tool_calls_work_on_a_vocabulary_that_can_spell_them(chars_model):
    from llama_metaws import Llama

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    chat = [{"role": "user", "content": "give me a number"}]
    with Llama(str(chars_model), n_ctx=512, verbose=False) as llm:
        res = llm.create_chat_completion(chat, max_tokens=64, temperature=0,
                                         response_format={"type": "json_object", "schema": schema})
        assert res["choices"][0]["finish_reason"] == "stop"
        value = json.loads(res["choices"][0]["message"]["content"])
        assert set(value) == {"n"} and isinstance(value["n"], int)
        # a sampled temperature goes through the same checked chain
        res = llm.create_chat_completion(chat, max_tokens=64, temperature=0.9, seed=3,
                                         response_format={"type": "json_object", "schema": schema})
        assert isinstance(json.loads(res["choices"][0]["message"]["content"])["n"], int)
    # this model's template has no tools (llama.cpp's chat layer leaves them out, as llama-server):
    # the binding's own format by name forces the call with its grammar
    with Llama(str(chars_model), n_ctx=512, verbose=False, chat_format="chatml") as llm:
        tools = [{"type": "function", "function": {"name": "pick", "parameters": schema}}]
        res = llm.create_chat_completion(chat, max_tokens=64, temperature=0, tools=tools,
                                         tool_choice={"type": "function", "function": {"name": "pick"}})
        call = res["choices"][0]["message"]["tool_calls"][0]["function"]
        assert call["name"] == "pick" and set(json.loads(call["arguments"])) == {"n"}


def test_a_grammar_under_mtp_drafting_and_tensor_split_gives_the_undrafted_output(chars_mtp_model):
    """Drafts are verified by sampling every position through the checked chain: the grammar
    accepts exactly the sampled tokens, so the output equals the one without drafting."""
    from llama_metaws import Llama
    from llama_metaws.native.binding import llama_cpp

    grammar = 'root ::= "{\\"a\\": " [0-9]{1,6} ", \\"b\\": \\"" [a-z ]{2,20} "\\"}"'
    outs = []
    for draft in (None, "mtp"):
        kw = dict(draft="mtp", devices=split_devices(2), split_mode="tensor") if draft else {}
        with Llama(str(chars_mtp_model), n_ctx=256, n_batch=64, n_ubatch=64, verbose=False, **kw) as llm:
            res = llm.create_completion("the answer is", max_tokens=48, temperature=0,
                                        grammar=llama_cpp.LlamaGrammar.from_string(grammar, verbose=False))
            outs.append(res["choices"][0]["text"])
            if draft:
                assert llm.draft_stats.last.drafted > 0
    assert outs[0] == outs[1], outs
    value = json.loads(outs[0])
    assert set(value) == {"a", "b"}


def test_grammar_checks_from_many_threads_each_get_their_own_message(tiny_model):
    """The parse message is captured from llama.cpp's stderr and log, which the process shares:
    one check at a time, each answered with its own grammar's error."""
    import threading

    from llama_metaws import Llama
    from llama_metaws.engine import sampling

    cases = {'root ::= x{}'.replace("{}", str(i)): f"Undefined rule identifier 'x{i}'" for i in range(8)}
    cases['root ::= "a"\nroot ::= root "b"'] = "left recursion"
    cases['start ::= "a"'] = "does not contain a 'root' symbol"
    wrong = []
    with Llama(str(tiny_model), n_ctx=128, verbose=False) as llm:
        def run():
            for _ in range(5):
                for text, expected in cases.items():
                    try:
                        llm.check_grammar(text)
                        wrong.append((text, "no error"))
                    except sampling.GrammarError as e:
                        if expected not in str(e):
                            wrong.append((text, str(e)))

        threads = [threading.Thread(target=run) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        llm.check_grammar('root ::= "ok"')  # and a good one still parses
    assert not wrong, wrong[:5]


def test_the_repeat_penalty_counts_the_prompt_tokens_as_llama_server_and_the_binding_do(tiny_model):
    """llama-server accepts the prompt into the sampler before the first token (init_sampler), and
    the binding's penalties read its input ids: a token of the prompt's last penalty_last_n is
    penalized at the first step too. The expected token is computed from the raw logits row."""
    import numpy as np

    from llama_metaws import Llama
    from llama_metaws.engine.request import Request
    from llama_metaws.engine.samplers import PENALTY_LAST_N, SamplingParams

    llm = Llama(str(tiny_model), n_ctx=256, n_batch=64, verbose=False)
    try:
        rng = np.random.default_rng(3)
        for _ in range(40):  # a prompt that holds the raw argmax (else the test could not fail)
            prompt = [int(t) for t in rng.integers(1, EOS_TOKEN, 20)]
            raw = llm._engine.submit(Request(prompt, SamplingParams(temp=0.0), max_tokens=1, logits_rows=True))
            row = [o for o in raw.outputs() if o.rows][0].rows[0]
            if int(np.argmax(row)) in prompt:
                break
        else:
            pytest.fail("no prompt of 40 holds its own greedy continuation")
        penalty = 50.0
        seen = set(prompt[-PENALTY_LAST_N:])
        expected = np.array(row, dtype=np.float64)
        for t in seen:  # llama.cpp's penalties: a positive logit divided, a negative one multiplied
            expected[t] = expected[t] / penalty if expected[t] > 0 else expected[t] * penalty
        got = llm._engine.complete(prompt, 1, sampling=SamplingParams(temp=0.0, repeat_penalty=penalty))
        assert got == [int(np.argmax(expected))] and got[0] != int(np.argmax(row))
    finally:
        llm.close()
