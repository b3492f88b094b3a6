"""llama-server's command lines through serve: every flag of the vendored llama-server in the
table (llama_metaws.cli.server_flags), each taken or refused as the table says, real command lines
from llama.cpp's docs and server tests, the LLAMA_ARG_* variables, the docs file the table
generates, and serve's defaults (llama-server's) in a real start."""

import contextlib
import functools
import io
import re
import shlex
import tarfile

import pytest

from llama_metaws import cli
from llama_metaws.cli import flags, server_flags
from llama_metaws.cli.server_flags import BY_SPELLING, NOOP, REFUSED, REMOVED, SAME, TABLE, VALUES

# a valid value for each value-taking flag serve takes (by its first spelling)
SAMPLES = {
    "-t": "2", "-tb": "2", "-c": "128", "-n": "16", "-b": "64", "-ub": "32", "--keep": "0", "-ctxcp": "4",
    "-cms": "64", "-cram": "0", "-fa": "on", "-s": "7", "--temp": "0.5", "--rope-scaling": "yarn",
    "--rope-scale": "2", "--rope-freq-base": "10000", "--rope-freq-scale": "0.5", "--yarn-orig-ctx": "128",
    "--yarn-ext-factor": "0.5", "--yarn-attn-factor": "1", "--yarn-beta-slow": "1", "--yarn-beta-fast": "32",
    "-ctk": "q8_0", "-ctv": "q8_0", "-dt": "0.1", "-np": "2", "--rpc": "127.0.0.1:50052", "-lm": "none",
    "-lzm": "off", "--numa": "isolate", "-dev": "CPU", "-ngl": "12", "-sm": "row", "-ts": "3,1", "-mg": "1",
    "-fit": "off", "-fitt": "512", "-fitc": "512", "--override-kv": "a.b=int:3", "-a": "tiny", "--tags": "x,y",
    "-m": "model.gguf", "--host": "0.0.0.0", "--port": "9090", "--cors-origins": "localhost",
    "--cors-methods": "GET", "--cors-headers": "X-A", "--api-key": "k1,k2", "--api-key-file": "keys.txt",
    "--chat-template-kwargs": '{"enable_thinking": false}', "--sse-ping-interval": "-1", "--threads-http": "4",
    "--cache-reuse": "0", "--slot-save-path": "/tmp", "--reasoning-format": "none", "-rea": "off",
    "--reasoning-budget": "8", "--reasoning-budget-message": "stop", "--chat-template": "chatml",
    "--chat-template-file": "t.jinja", "--sleep-idle-seconds": "-1", "--log-colors": "off", "-lv": "3",
    "--spec-draft-n-max": "2", "--spec-draft-n-min": "0", "--spec-synth-len": "1.5",
    "--spec-synth-rates": "0.9,0.5", "--spec-draft-p-min": "0.5", "--spec-type": "draft-mtp",
    "--spec-draft-model": "mtp-model.gguf",
}


@functools.lru_cache(maxsize=None)
def _parser():
    return cli.make_parser()


def parse(argv, env=None, command="serve"):
    """(the Namespace, or None when refused; stderr) of ``llama-metaws <command> argv`` as main()
    parses it, with ``env`` the only LLAMA_ARG_* variables."""
    environ = {k: v for k, v in (env or {}).items()}
    err = io.StringIO()
    parser = _parser()
    sub = cli._subparser(parser, command)
    with contextlib.redirect_stderr(err), pytest.MonkeyPatch.context() as mp:
        for key in [k for k in __import__("os").environ if k.startswith(("LLAMA_ARG_", "LLAMA_API_KEY"))]:
            mp.delenv(key)
        for k, v in environ.items():
            mp.setenv(k, v)
        try:
            args, unknown = parser.parse_known_args([command] + cli._llama_argv(sub, list(argv)))
            if unknown:
                sub.error(f"invalid argument: {unknown[0]}")
        except server_flags.EnvError as e:
            return None, str(e)
        except SystemExit as e:
            assert e.code == 2, err.getvalue()
            return None, err.getvalue()
    return args, err.getvalue()


def test_the_table_holds_every_flag_of_the_vendored_llama_server():
    from llama_metaws.native.build import fetch_sdist
    from llama_metaws.paths import VENDOR_PREFIX, cache_root
    from llama_metaws.native.runtime import require_build

    path = require_build().src_dir / "tools" / "server" / "README.md"  # the build's vendored tree
    if path.is_file():
        readme = path.read_text()
    else:  # a build from a trimmed tree: the pinned sdist's
        with tarfile.open(fetch_sdist(cache_root() / "downloads", lambda line: None)) as tar:
            readme = tar.extractfile(VENDOR_PREFIX + "tools/server/README.md").read().decode()
    # the README's option tables (llama-server --help, as llama.cpp generates them into it)
    theirs = set()
    for cell in re.findall(r"^\| `([^`]+)` \|", readme, flags=re.M):
        theirs.update(word.split(" ")[0] for word in cell.split(", ") if word.startswith("-"))
    ours = [s for f in TABLE for s in f.spellings]
    assert len(ours) == len(set(ours))  # no spelling in two rows
    assert set(ours) == theirs
    assert len(TABLE) == len(set(f.names[0] for f in TABLE))


def test_every_flag_serve_takes_parses_and_every_refused_one_errs_with_its_reason():
    for flag in TABLE:
        for spelling in flag.spellings:
            value = [SAMPLES.get(flag.names[0], "1")] if flag.value and spelling in flag.names else []
            status = flag.status_of(spelling)
            argv = (["-m", "x.gguf"] if flag.names[0] != "-m" else []) + [spelling, *value]
            if status == VALUES:
                bad = ["-m", "x.gguf", spelling, "12345"]
                args, err = parse(bad)
                assert args is None and spelling in err and flag.note in err and "usage:" not in err, (bad, err)
            if status in (SAME, VALUES, NOOP):
                if flag.names[0] in ("-h", "--version", "--list-devices"):
                    continue  # they print and exit (below)
                args, err = parse(argv)
                assert args is not None, (argv, err)
                flags.llama_kwargs(args)  # what serve loads the model with
            else:
                args, err = parse(argv)
                assert args is None, argv
                # one line naming the flag, the reason, and no usage block
                assert f"error: {spelling}: {flag.note_of(spelling)}" in err and "usage:" not in err, (argv, err)
    for spelling in ("--draft", "--draft-n", "--draft-max"):  # as llama.cpp refuses them
        _, err = parse(["-m", "x", spelling, "3"])
        assert "the argument has been removed. use --spec-draft-n-max or --spec-ngram-mod-n-max" in err
    _, err = parse(["-m", "x", "--no-such-flag"])
    assert "error: invalid argument: --no-such-flag" in err and "usage:" not in err
    _, err = parse(["-m", "x", "--checkpoint-every", "512"])  # ours before; llama-server never had it
    assert "--checkpoint-every: renamed: -cms/--checkpoint-min-step" in err


def test_print_and_exit_flags(capsys):
    for argv, text in ((["--version"], "llama-metaws"), (["--list-devices"], "CPU"), (["--usage"], "usage:")):
        with pytest.raises(SystemExit) as e:
            cli.main(["serve", *argv])
        assert e.value.code == 0
        assert text in capsys.readouterr().out


# real command lines: llama.cpp's docs (README.md, docs/, tools/server/README.md) and its server
# suite's presets and tests (tools/server/tests/utils.py and unit/), as they start llama-server
COMMAND_LINES = [
    "-m models/7B/ggml-model.gguf -c 2048",
    "-m ~/models/Llama-3.2-1B-Instruct-Q4_K_M.gguf --port 8080 -c 1024",
    "-m model.gguf",
    "--model /srv/models/llama.gguf",
    "-m gemma-3-4b-it-Q4_K_M.gguf --mmproj mmproj-gemma-3-4b-it-Q4_K_M.gguf",
    "-hf ggml-org/gemma-3-4b-it-GGUF",
    "-hf ggml-org/Qwen3-8B-GGUF:q8_0",
    "--jinja -fa on -m Qwen2.5-7B-Instruct-Q4_K_M.gguf",
    "-m Qwen3-4B.gguf -md Qwen3-4B-eagle3.gguf --spec-type draft-eagle3",
    "-m model.gguf --spec-type ngram-mod --spec-ngram-mod-n-match 24 --spec-ngram-mod-n-min 48 "
    "--spec-ngram-mod-n-max 64",
    "-m model.gguf --spec-type ngram-simple --spec-draft-n-max 64",
    "--models-dir ./models_directory",
    "-m model.gguf --mcp-servers-config mcp.json",
    "-m model.gguf --ui-config '{\"pasteLongTextToFileLen\": 0}'",
    "--list-devices",
    # the suite's presets, as utils.py renders them (its downloads, and the same with a local file)
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --hf-repo ggml-org/models "
    "--hf-file tinyllamas/stories260K.gguf --batch-size 32 --alias tinyllama-2 --ctx-size 512 --parallel 2 "
    "--n-predict 64",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --model stories260K.gguf --batch-size 32 "
    "--alias tinyllama-2 --ctx-size 512 --parallel 2 --n-predict 64",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --model bge-small.gguf --batch-size 128 --ubatch-size 128 "
    "--embedding --pooling last --ctx-size 512 --parallel 2",
    "--port 8080 --temp 0.0 --seed 42 --host 127.0.0.1 --model stories15M_MOE-F16.gguf --batch-size 1024 "
    "--ctx-size 2048 --parallel 1 --n-predict 64 --model-draft stories15M-q4_0.gguf",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --model stories260K.gguf --ctx-size 256 --parallel 2 "
    "--n-predict 64 --context-shift --api-key my-api-key --metrics --slots --no-ui",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --model stories260K.gguf --ctx-size 512 -ctk q8_0 "
    "-ctv q8_0 -fa on --kv-unified --jinja --reasoning-format deepseek --reasoning on",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --model stories260K.gguf --slot-save-path ./tmp "
    "--cache-ram 0 --no-cache-idle-slots --swa-full --offline --no-mmproj --no-models-autoload",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --model stories260K.gguf --cache-ram 100",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --model stories15M_MOE.gguf --spec-type draft-mtp "
    "--spec-draft-n-max 8 --spec-draft-n-min 4",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --model stories15M_MOE.gguf --spec-type draft-mtp "
    "--spec-draft-n-max 8 --spec-synth-len 3.5",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --model stories260K.gguf --backend_sampling",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --model stories260K.gguf --lora lora.gguf",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --model stories260K.gguf --sleep-idle-seconds 1",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --model stories260K.gguf --tools all",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --model stories260K.gguf --draft-max 8",
]


def _first_refused(argv):
    """(spelling, reason) of the first flag of ``argv`` serve refuses by the table; None: it takes all."""
    i = 0
    while i < len(argv):
        spelling = argv[i]
        fixed = spelling.replace("_", "-") if spelling.startswith("--") else spelling
        flag = BY_SPELLING.get(spelling) or BY_SPELLING.get(fixed)
        assert flag is not None, f"{spelling}: not a llama-server flag"
        spelling = spelling if spelling in BY_SPELLING else fixed
        value = argv[i + 1] if flag.value and spelling in flag.names else None
        if flag.names[0] in ("--list-devices",):
            return spelling, None
        if not flag.takes(spelling, value):
            return spelling, flag.note_of(spelling)
        i += 2 if value is not None else 1
    return None


@pytest.mark.parametrize("line", COMMAND_LINES)
def test_real_llama_server_command_lines_go_as_the_table_says(line):
    argv = shlex.split(line)
    refused = _first_refused(argv)
    if refused is not None and refused[0] == "--list-devices":
        with pytest.raises(SystemExit) as e:
            cli.main(["serve", *argv])
        assert e.value.code == 0
        return
    args, err = parse(argv)
    if refused is None:
        assert args is not None, (line, err)
        kw = flags.llama_kwargs(args)
        given = dict(zip(argv, argv[1:]))
        for spellings, key, want in ((("-c", "--ctx-size"), "n_ctx", int), (("--parallel", "-np"), "n_seq_max", int),
                                     (("--temp",), None, float), (("--port",), None, int)):
            for s in spellings:
                if s in given:
                    got = kw[key] if key else getattr(args, s.lstrip("-"))
                    assert got == want(given[s]), (line, s, got)
        return
    spelling, reason = refused
    assert args is None and spelling.replace("_", "-") in err and reason in err and "usage:" not in err, (line, err)


def test_llama_arg_variables_stand_for_their_flags_and_the_command_line_wins():
    for flag in TABLE:
        if not flag.env or not flag.takes(flag.names[0]) or not flag.env.startswith("LLAMA_"):
            continue
        value = SAMPLES[flag.names[0]] if flag.value else "1"
        base = [] if flag.names[0] == "-m" else ["-m", "x.gguf"]
        from_flag, _ = parse(base + [flag.names[0]] + ([value] if flag.value else []))
        from_env, err = parse(base, env={flag.env: value})
        assert from_env is not None and vars(from_env) == vars(from_flag), (flag.env, err)
        if flag.neg and flag.takes(flag.neg[0]):  # a falsey value, or LLAMA_ARG_NO_*: the negative spelling
            off, _ = parse(base + [flag.neg[0]])
            assert vars(parse(base, env={flag.env: "false"})[0]) == vars(off)
            assert vars(parse(base, env={flag.env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_"): "1"})[0]) == vars(off)
    env = {"LLAMA_ARG_CTX_SIZE": "128", "LLAMA_ARG_N_PARALLEL": "2", "LLAMA_ARG_FLASH_ATTN": "off",
           "LLAMA_ARG_CONTEXT_SHIFT": "true", "LLAMA_ARG_MODEL": "env.gguf", "LLAMA_API_KEY": "k"}
    args, err = parse(["-c", "64"], env=env)
    kw = flags.llama_kwargs(args)
    assert (kw["n_ctx"], kw["n_seq_max"], kw["flash_attn"], kw["context_shift"]) == (64, 2, False, True)
    assert (args.model, args.api_key) == ("env.gguf", "k")
    assert "LLAMA_ARG_CTX_SIZE environment variable is set, but will be overwritten by command line argument -c" in err
    # a variable of a refused flag is an error naming both; a generic variable (HF_TOKEN) is not ours
    args, err = parse(["-m", "x"], env={"LLAMA_ARG_MMPROJ": "p.gguf"})
    assert args is None and "LLAMA_ARG_MMPROJ (--mmproj): " + BY_SPELLING["--mmproj"].note in err
    args, err = parse(["-m", "x"], env={"LLAMA_ARG_DRAFT_MAX": "4"})
    assert args is None and "the argument has been removed" in err
    args, err = parse(["-m", "x"], env={"LLAMA_ARG_CONTEXT_SHIFT": "maybe"})
    assert args is None and "truthy or falsey" in err
    assert parse(["-m", "x"], env={"HF_TOKEN": "secret", "LLAMA_ARG_EMBEDDINGS": "0"})[0] is not None
    # generate reads the variables of the flags it has, and leaves the server's alone
    args, _ = parse(["-p", "hi"], env={"LLAMA_ARG_MODEL": "g.gguf", "LLAMA_ARG_PORT": "1", "LLAMA_ARG_CTX_SIZE": "96"},
                    command="generate")
    assert (args.model, args.ctx_size) == ("g.gguf", 96)


def test_serve_takes_llama_server_defaults():
    from llama_metaws.engine import fit

    args, _ = parse(["-m", "x.gguf"])
    kw = flags.llama_kwargs(args)
    assert (kw["n_gpu_layers"], kw["fit_params"], kw["n_ctx"], kw["fit_min_ctx"]) == ("auto", True, 0, 4096)
    assert (kw["n_seq_max"], kw["kv_unified"], kw["flash_attn"]) == (4, True, "auto")
    assert (kw["ctx_checkpoints"], kw["checkpoint_min_step"], kw["load_mode"]) == (32, 8192, -1)
    assert kw["phase_aware_workspace"] is True and kw["workspace_mode"] == "alias"
    explicit = flags.llama_kwargs(parse(["-m", "x", "-c", "0", "-np", "2", "-ngl", "all", "--fit", "off"])[0])
    assert explicit["fit_min_ctx"] == fit.FULL_CONTEXT  # -c 0 given: the whole context, never cut
    assert (explicit["n_seq_max"], "kv_unified" in explicit) == (2, False)
    assert (explicit["n_gpu_layers"], explicit["fit_params"]) == ("all", False)
    assert flags.llama_kwargs(parse(["-m", "x", "-ngl", "-1"])[0])["n_gpu_layers"] == "all"
    assert flags.llama_kwargs(parse(["-m", "x", "-np", "-1", "-no-kvu"])[0]).get("kv_unified") is None
    gen = flags.llama_kwargs(parse(["-m", "x", "-p", "hi"], command="generate")[0])
    assert gen["n_seq_max"] == 1  # llama.cpp's common default outside the server


def test_workspace_flags_need_a_draft_context_and_unsafe_shared_is_the_reproductions_alone():
    for argv, flag in ((["--phase-aware-workspace"], "--phase-aware-workspace"),
                       (["--no-phase-aware-workspace"], "--no-phase-aware-workspace"),
                       (["--workspace-mode", "private-meta"], "--workspace-mode")):
        args, _ = parse(["-m", "x", *argv])
        with pytest.raises(ValueError, match=f"{flag}: the workspace is shared by the target and its MTP draft "
                           "context, and without --spec-type draft-mtp there is no draft context"):
            flags.llama_kwargs(args)
    mtp = ["-m", "x", "--spec-type", "draft-mtp"]
    assert flags.llama_kwargs(parse(mtp)[0])["phase_aware_workspace"] is True
    assert flags.llama_kwargs(parse(mtp + ["--phase-aware-workspace"])[0])["phase_aware_workspace"] is True
    assert flags.llama_kwargs(parse(mtp + ["--no-phase-aware-workspace"])[0])["phase_aware_workspace"] is False
    assert flags.llama_kwargs(parse(mtp + ["--workspace-mode", "private-meta"])[0])["workspace_mode"] == "private-meta"
    args, err = parse(mtp + ["--workspace-mode", "unsafe-shared"])
    assert args is None and "llama-metaws-dev repro --mode unsafe-shared" in err
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    assert "unsafe-shared" not in out.getvalue() and "--no-phase-aware-workspace" in out.getvalue()


def test_the_docs_table_is_what_the_table_generates():
    from pathlib import Path

    doc = Path(__file__).resolve().parents[1] / "docs" / "server-flags.md"
    assert doc.read_text() == server_flags.markdown(), \
        "docs/server-flags.md is stale: python -m llama_metaws.cli.server_flags > docs/server-flags.md"
    for f in TABLE:  # every refusal says why
        assert f.status not in (REFUSED, REMOVED) or f.note
        assert f.status != VALUES or f.allowed


def test_a_real_start_on_llama_servers_defaults_and_variables(models_dir, tmp_path):
    from serving import Server

    from llama_metaws_dev.testing import make_tiny_mtp_model

    model = make_tiny_mtp_model(models_dir / "flags-mtp.gguf", agreement=0.8)  # a 256-token context
    # serve -m MODEL --spec-type draft-mtp and nothing else: 4 slots sharing the model's whole
    # context, the workspace on; --metrics from its variable
    srv = Server(model, "--spec-type", "draft-mtp", log_path=tmp_path / "defaults.log",
                 env={"LLAMA_ARG_ENDPOINT_METRICS": "1"})
    try:
        _, props = srv.json("GET", "/props")
        assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 256
        assert props["phase_aware_workspace"] == {"enabled": True, "mode": "alias"}
        status, res = srv.json("POST", "/completion", {"prompt": "hello", "n_predict": 8, "temperature": 0})
        assert status == 200 and res["tokens_predicted"] == 8
        m = srv.metrics()
        assert m['llamametaws:workspace_enabled{mode="alias"}'] == 1 and m["llamametaws:slots"] == 4
        assert any(k.startswith("llamametaws:workspace_shared{") and v == 1 for k, v in m.items())
    finally:
        srv.kill()
    # the workspace off, the slots and the context from variables, -c on the command line winning
    srv = Server(model, "--spec-type", "draft-mtp", "--no-phase-aware-workspace", "-c", "1024",
                 log_path=tmp_path / "off.log", env={"LLAMA_ARG_N_PARALLEL": "2", "LLAMA_ARG_CTX_SIZE": "512",
                                                     "LLAMA_ARG_ENDPOINT_METRICS": "true"})
    try:
        _, props = srv.json("GET", "/props")
        assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == 512  # 1024 / 2
        assert props["phase_aware_workspace"] == {"enabled": False, "mode": None}
        assert srv.metrics()['llamametaws:workspace_enabled{mode="none"}'] == 0
        assert "LLAMA_ARG_CTX_SIZE environment variable is set, but will be overwritten" in srv.log()
    finally:
        srv.kill()
