"""Every bad input we know of, what the user gets, and the table in docs/bad-inputs.md.

Each case is run here; the document's table is generated from these very cases
(``python tests/test_bad_inputs.py`` rewrites it) and a test checks that it is current.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llama_metaws.errors import GrammarError

DOC = Path(__file__).resolve().parent.parent / "docs" / "bad-inputs.md"
KW = dict(n_ctx=128, n_batch=32, n_ubatch=32, verbose=False)


class Env:
    """Model files and contexts the cases need, made once."""

    def __init__(self, tmp: Path):
        from llama_metaws_dev.testing import make_tiny_model, make_tiny_mtp_model

        self.tmp = tmp
        self.mtp = str(make_tiny_mtp_model(tmp / "bad-mtp.gguf", seed=1, agreement=0.5))
        self.plain = str(make_tiny_model(tmp / "bad-llama.gguf", arch="llama"))
        self.empty = tmp / "empty.gguf"
        self.empty.write_bytes(b"")
        self.truncated = tmp / "truncated.gguf"
        self.truncated.write_bytes(Path(self.mtp).read_bytes()[: 1 << 20])


def _llama(env, path=None, **kw):
    from llama_metaws import Llama

    return Llama(path or env.mtp, **{**KW, **kw}).close()


def _complete_with_grammar(env, text):
    from llama_metaws import Llama
    from llama_metaws.native.binding import llama_cpp

    with Llama(env.plain, **KW) as llm:
        llm.create_completion("0 1", max_tokens=4, temperature=0,
                              grammar=llama_cpp.LlamaGrammar.from_string(text, verbose=False))


def _contexts(env):
    from llama_metaws.engine.contexts import load_model, new_context

    model = load_model(env.mtp, load_mtp=True)
    target = new_context(model, n_ctx=128, n_batch=32, n_rs_seq=3)
    draft = new_context(model, n_ctx=128, n_batch=32, mtp=True)
    return model, target, draft


def _workspace_on_closed_draft(env):
    from llama_metaws.engine.workspace import Workspace

    model, target, draft = _contexts(env)
    draft.close()
    try:
        Workspace(target, draft)
    finally:
        target.close()
        model.close()


def _workspace_foreign(env):
    from llama_metaws.engine.workspace import Workspace

    Workspace(object(), object())


def _engine(env, prompt=(1, 2, 3), **kw):
    from llama_metaws.engine.core import Engine
    from llama_metaws.engine.request import Request

    model, target, draft = _contexts(env)
    try:
        with Engine(target, draft, **kw) as engine:
            engine.submit(Request(list(prompt), max_tokens=4)).wait(60)
    finally:
        draft.close()
        target.close()
        model.close()


def _compute_buffers_closed(env):
    from llama_metaws.engine.buffers import compute_buffers

    model, target, draft = _contexts(env)
    target.close()
    draft.close()
    try:
        compute_buffers(target)
    finally:
        model.close()


def _injected_grow_failure(env):
    from llama_metaws.engine.core import Engine
    from llama_metaws.engine.workspace import Workspace, inject_alloc_failure

    model, target, draft = _contexts(env)
    ws = Workspace(target, draft, n_decode_tokens=4)
    drafter = Engine(target, draft, draft_max=3)
    try:
        drafter.complete([1, 2, 3], 4)       # decode phase: the entry is decode-sized
        inject_alloc_failure(1)              # the next prompt's grow fails
        drafter.complete(list(range(60)), 4)
    finally:
        inject_alloc_failure(0)
        drafter.close()
        ws.close()
        draft.close()
        target.close()
        model.close()


def _load_state_without_draft(env):
    from llama_metaws import Llama

    with Llama(env.mtp, **KW) as plain, Llama(env.mtp, draft="mtp", **KW) as llm:
        plain.eval(plain.tokenize(b"abc"))
        llm.load_state(plain.save_state())


def _cli(*argv, env_vars=None):
    """A command line that fails: its exit status and the last line it printed."""
    import os

    res = subprocess.run([sys.executable, "-m", "llama_metaws", *argv], capture_output=True, text=True,
                         env=dict(os.environ, **(env_vars or {})))
    raise SystemExit(f"exit status {res.returncode}: {res.stderr.strip().splitlines()[-1]}")


def _cli_unknown_flag(env):
    _cli("generate", "-m", env.mtp, "-p", "x", "--draft-pmin", "0.5")


# (what the user does, how, the exception type, a pattern its message must match)
CASES = [
    ("Llama(draft='mtp') on a model without nextn layers",
     lambda e: _llama(e, e.plain, draft="mtp"), ValueError, r"'llama' model has none"),
    ("Llama(draft='eagle')", lambda e: _llama(e, draft="eagle"), ValueError, r"supported kinds are"),
    ("Llama(draft='mtp', draft_model=...) (two draft models)",
     lambda e: _llama(e, draft="mtp", draft_model=object()), ValueError, r"choose one"),
    ("Llama(draft_max=0)", lambda e: _llama(e, draft="mtp", draft_max=0), ValueError, r"draft_max must be"),
    ("Llama(draft_p_min=1.5)", lambda e: _llama(e, draft="mtp", draft_p_min=1.5), ValueError, r"draft_p_min must be"),
    ("Llama(draft_max=40) with n_ubatch 32", lambda e: _llama(e, draft="mtp", draft_max=40), ValueError,
     r"must fit n_batch and n_ubatch"),
    ("Llama(rpc_servers='nonsense') (not host:port)", lambda e: _llama(e, rpc_servers="nonsense"),
     ValueError, r"rpc_servers: 'nonsense' is not host:port"),
    ("Llama(rpc_servers=['127.0.0.1:1', '127.0.0.1:1']) (a server twice)",
     lambda e: _llama(e, rpc_servers=["127.0.0.1:1", "127.0.0.1:1"]), ValueError, r"listed twice"),
    ("Llama(rpc_servers=['127.0.0.1:1']) with no RPC server there",
     lambda e: _llama(e, rpc_servers=["127.0.0.1:1"]), ValueError,
     r"cannot use the RPC server 127\.0\.0\.1:1: cannot connect .*llama-metaws rpc-server"),
    ("Llama(devices=['CUDA9']) on a machine without it", lambda e: _llama(e, devices=["CUDA9"]), ValueError,
     r"unknown device 'CUDA9'; the devices here are: CPU"),
    ("Llama(split_mode='tensor') with one device", lambda e: _llama(e, devices=["CPU"], split_mode="tensor"),
     ValueError, r"give at least two"),
    ("Llama(split_mode='tensor', flash_attn=False)",
     lambda e: _llama(e, devices=["CPU", "CPU"], split_mode="tensor", flash_attn=False), ValueError,
     r"needs flash attention"),
    ("Llama(split_mode='diagonal')", lambda e: _llama(e, split_mode="diagonal"), ValueError,
     r"split_mode 'diagonal' is not one of"),
    ("Llama(n_seq_max=0)", lambda e: _llama(e, n_seq_max=0), ValueError, r"n_seq_max must be"),
    ("Llama(ctx_checkpoints=-1)", lambda e: _llama(e, draft="mtp", ctx_checkpoints=-1), ValueError,
     r"ctx_checkpoints must be an integer >= 0"),
    ("Llama(checkpoint_min_step=-5)", lambda e: _llama(e, draft="mtp", checkpoint_min_step=-5), ValueError,
     r"checkpoint_min_step must be an integer >= 0"),
    ("Llama(draft='mtp').load_state(a state saved without drafting)", _load_state_without_draft, ValueError,
     r"this state has no MTP draft context"),
    ("Llama(workspace_mode='sometimes')", lambda e: _llama(e, draft="mtp", workspace_mode="sometimes"),
     ValueError, r"is not one of alias, private-meta, unsafe-shared, off"),
    ("Llama(workspace_mode='unsafe-shared') without allow_unsafe_workspace",
     lambda e: _llama(e, draft="mtp", workspace_mode="unsafe-shared"), ValueError, r"allow_unsafe_workspace=True"),
    ("Llama() on a missing file", lambda e: _llama(e, str(e.tmp / "missing.gguf")), ValueError, r"does not exist"),
    ("Llama() on an empty file", lambda e: _llama(e, str(e.empty)), ValueError, r"Model file is empty"),
    ("Llama(draft='mtp') on a truncated file", lambda e: _llama(e, str(e.truncated), draft="mtp"), ValueError,
     r"not a readable GGUF model \(truncated\?\)"),
    ("Llama() on a truncated file", lambda e: _llama(e, str(e.truncated)), ValueError, r"Failed to load model"),
    ("Workspace(target, draft) on a closed draft context", _workspace_on_closed_draft, ValueError,
     r"draft context is closed"),
    ("Workspace(object(), object())", _workspace_foreign, ValueError, r"target context is closed or not a llama context"),
    ("Engine(draft_max=0)", lambda e: _engine(e, draft_max=0), ValueError, r"draft_max must be"),
    ("Engine(p_min=nan)", lambda e: _engine(e, p_min=math.nan), ValueError, r"p_min must be in"),
    ("Request([]) (an empty prompt)", lambda e: _engine(e, prompt=()), ValueError, r"prompt is empty"),
    ("Engine.submit(Request([500])) (a token outside the vocabulary)", lambda e: _engine(e, prompt=(500,)),
     ValueError, r"outside the vocabulary"),
    ("compute_buffers() of a closed context", _compute_buffers_closed, ValueError, r"NULL"),
    ("a decode whose workspace grow cannot be allocated", _injected_grow_failure, RuntimeError,
     r"returned -2 during prompt"),
    ("inject_alloc_failure(-1)", lambda e: __import__("llama_metaws.engine.workspace", fromlist=["x"]).inject_alloc_failure(-1),
     ValueError, r"n must be >= 0"),
    ("make_tiny_model(arch='nope')", lambda e: __import__("llama_metaws_dev.testing", fromlist=["x"]).make_tiny_model(
        e.tmp / "x.gguf", arch="nope"), ValueError, r"supported"),
    ("make_tiny_mtp_model(agreement=2.0)", lambda e: __import__("llama_metaws_dev.testing", fromlist=["x"]).make_tiny_mtp_model(
        e.tmp / "x.gguf", agreement=2.0), ValueError, r"agreement must be"),
    ("repro.run_case('cuda', 'alias')", lambda e: __import__("llama_metaws_dev.repro", fromlist=["x"]).run_case(
        "cuda", "alias"), ValueError, r"unknown case"),
    ("Llama.create_completion(grammar='root ::= (') (a grammar that does not parse)",
     lambda e: _complete_with_grammar(e, "root ::= ("), GrammarError, r"the grammar is not valid: expecting '\)'"),
    ("Llama.create_completion(grammar=...) that no token of the vocabulary can continue",
     lambda e: _complete_with_grammar(e, 'root ::= "{"'), GrammarError, r"no token can be sampled"),
    ("engine.sampling.check_grammar('root ::= ' + '(' * 20000 + ...) (nested deeper than llama.cpp's stack allows)",
     lambda e: __import__("llama_metaws.engine.sampling", fromlist=["x"]).check_grammar(
         "root ::= " + "(" * 20000 + '"a"' + ")" * 20000), GrammarError, r"nests groups 20000 deep"),
    ("llama-metaws generate --draft-pmin 0.5 (an unknown flag)", _cli_unknown_flag, SystemExit,
     r"exit status 2: llama-metaws generate: error: invalid argument: --draft-pmin"),
    ("llama-metaws serve --mmproj P (a llama-server flag serve refuses)",
     lambda e: _cli("serve", "-m", e.mtp, "--mmproj", "p.gguf"), SystemExit,
     r"exit status 2: llama-metaws serve: error: --mmproj: multimodal input is not served"),
    ("llama-metaws serve --draft-max 3 (removed by llama.cpp)", lambda e: _cli("serve", "-m", e.mtp, "--draft-max", "3"),
     SystemExit, r"--draft-max: the argument has been removed. use --spec-draft-n-max"),
    ("LLAMA_ARG_MMPROJ=P llama-metaws serve (a refused flag's variable)",
     lambda e: _cli("serve", "-m", e.mtp, env_vars={"LLAMA_ARG_MMPROJ": "p.gguf"}), SystemExit,
     r"environment variable LLAMA_ARG_MMPROJ \(--mmproj\): multimodal"),
    ("llama-metaws serve --phase-aware-workspace without --spec-type draft-mtp",
     lambda e: _cli("serve", "-m", e.mtp, "--phase-aware-workspace"), SystemExit,
     r"exit status 2: .*--phase-aware-workspace: the workspace is shared by the target and its MTP draft context"),
    ("llama-metaws serve --workspace-mode unsafe-shared",
     lambda e: _cli("serve", "-m", e.mtp, "--spec-type", "draft-mtp", "--workspace-mode", "unsafe-shared"),
     SystemExit, r"llama-metaws-dev repro --mode unsafe-shared"),
    ("Llama(n_gpu_layers='most')", lambda e: _llama(e, n_gpu_layers="most"), ValueError,
     r"n_gpu_layers must be a count of layers \(-1: all\), 'all' or 'auto'"),
    ("Llama(flash_attn='maybe')", lambda e: _llama(e, flash_attn="maybe"), ValueError,
     r"flash_attn must be True, False or 'auto'"),
]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return Env(tmp_path_factory.mktemp("bad"))


def _run(case, env):
    _, fn, exc_type, pattern = case
    with pytest.raises(exc_type) as err:
        fn(env)
    message = str(err.value)
    assert re.search(pattern, message), message
    return message


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(env, case):
    _run(case, env)


def _clean(message: str, env) -> str:
    first = message.strip().splitlines()[0] if message.strip() else ""
    return first.replace(str(env.tmp), "<dir>").replace("|", "\\|")


def render(env) -> str:
    rows = ["| input | exception | message |", "|---|---|---|"]
    for case in CASES:
        message = _run(case, env)
        rows.append(f"| {case[0]} | `{case[2].__name__}` | {_clean(message, env)} |")
    return "\n".join(rows)


def test_the_document_lists_every_case(env):
    text = DOC.read_text()
    for case in CASES:
        assert f"| {case[0]} | `{case[2].__name__}` |" in text, f"docs/bad-inputs.md lacks: {case[0]}"


if __name__ == "__main__":  # rewrite the table from the cases
    import tempfile

    import llama_metaws  # noqa: F401

    with tempfile.TemporaryDirectory() as tmp:
        table = render(Env(Path(tmp)))
    head = DOC.read_text().split("<!-- table -->")[0] if DOC.exists() else ""
    DOC.write_text(head + "<!-- table -->\n" + table + "\n")
    print(table)
