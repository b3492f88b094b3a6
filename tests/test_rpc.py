"""Tensor split across hosts: two ggml RPC servers (``llama-metaws rpc-server``) on 127.0.0.1.

The servers are started here, on free ports, and killed by PID; every wait is bounded. Greedy
output over the servers (layer and tensor split, MTP drafting, the workspace and its alias on
the RPC meta buffers) equals one CPU's; a server killed mid-request is a Python exception in
the client (run in a child process, so a hang or an abort would fail the test, not stall it);
a wrong address is a ValueError at load.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from llama_metaws import Llama
from llama_metaws.cli import flags
from llama_metaws.engine import rpc
from llama_metaws.cli import make_parser
from llama_metaws_dev.testing import free_port, make_tiny_mtp_model, start_rpc_server, stop_process

KW = dict(n_ctx=256, n_batch=64, n_ubatch=64, verbose=False)
PROMPTS = ("the quick brown fox jumps", "a")
N_TOKENS = 24
START_TIMEOUT = 30.0


@pytest.fixture(scope="module")
def servers():
    procs = [start_rpc_server(free_port()) for _ in range(2)]
    try:
        yield [p.endpoint for p in procs]
    finally:
        for p in procs:
            stop_process(p)


@pytest.fixture(scope="module")
def mtp_path(models_dir):
    return str(make_tiny_mtp_model(models_dir / "rpc-mtp.gguf", seed=31, agreement=0.8))


def _texts(llm):
    return [llm.create_completion(p, max_tokens=N_TOKENS, temperature=0.0)["choices"][0]["text"]
            for p in PROMPTS]


@pytest.fixture(scope="module")
def cpu_texts(mtp_path):
    with Llama(mtp_path, **KW) as llm:
        return _texts(llm)


@pytest.mark.parametrize("split_mode", ["layer", "tensor"])
def test_greedy_output_over_two_rpc_servers_equals_one_cpu(servers, mtp_path, cpu_texts, split_mode):
    # without drafting the target keeps no rollback snapshots (n_rs_seq = 0): under tensor split
    # its recurrent layers' empty states_extra view is the one patch 0013 keeps in range (without
    # it both servers die on their range check)
    with Llama(mtp_path, rpc_servers=servers, split_mode=split_mode, **KW) as plain:
        assert _texts(plain) == cpu_texts
    with Llama(mtp_path, draft="mtp", rpc_servers=servers, split_mode=split_mode, **KW) as llm:
        assert _texts(llm) == cpu_texts
        assert llm.draft_stats.total.drafted > 0 and llm.draft_stats.total.accepted > 0
        entries = llm.workspace_stats()
        assert entries and all(e.allocated > 0 for e in entries)
        names = llm._rpc.device_names
        rpc_entries = [e for e in entries if "RPC" in e.buffer_type]
        assert rpc_entries, [e.buffer_type for e in entries]  # the compute buffers are remote
        if split_mode == "tensor":
            # the shared workspace is a meta buffer over the two servers' devices, and the MTP
            # draft computes in it through a borrower alias
            meta = [e for e in rpc_entries if e.device == f"Meta({','.join(names)})"]
            assert meta and all(e.alias and e.shared for e in meta), entries
            assert all(ep in meta[0].buffer_type for ep in servers), meta
        llm._rpc.check(llm._ctx.ctx)  # both servers still answer


def test_rpc_devices_combine_with_local_ones(servers, mtp_path, cpu_texts):
    names = rpc.connect(servers).device_names
    assert len(names) == 2 and all(n.startswith("RPC") for n in names)
    # llama.cpp's --rpc string form, and the servers' devices next to the local CPU
    with Llama(mtp_path, draft="mtp", rpc_servers=",".join(servers), devices=[*names, "CPU"],
               split_mode="layer", **KW) as llm:
        assert _texts(llm) == cpu_texts


def test_split_weights_go_up_in_packed_commands(mtp_path, tmp_path):
    """Patch 0021: each device's slice of a split weight goes in packed SET_TENSOR commands, not
    one per row; the servers count them (GGML_RPC_DEBUG logs a line per command served)."""
    logs = [tmp_path / f"server{i}.log" for i in range(2)]
    procs = [start_rpc_server(free_port(), env=dict(os.environ, GGML_RPC_DEBUG="1"), stderr=open(log, "w"))
             for log in logs]
    counts = {}
    try:
        for split_mode in ("layer", "tensor"):
            before = sum(log.read_text().count("[set_tensor]") for log in logs)
            Llama(mtp_path, rpc_servers=[p.endpoint for p in procs], split_mode=split_mode, **KW).close()
            time.sleep(0.2)  # the servers' last lines
            counts[split_mode] = sum(log.read_text().count("[set_tensor]") for log in logs) - before
    finally:
        for p in procs:
            stop_process(p)
    # row by row, tensor split took about 80 times layer split's commands (2,102 vs 27)
    assert 0 < counts["layer"] and counts["tensor"] <= 3 * counts["layer"], counts


def test_a_wrong_address_is_a_clear_error_at_load(mtp_path):
    port = free_port()  # nothing listens there
    with pytest.raises(ValueError, match=rf"cannot use the RPC server 127\.0\.0\.1:{port}: cannot connect"):
        Llama(mtp_path, rpc_servers=[f"127.0.0.1:{port}"], **KW)


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import llama_metaws
    from llama_metaws import Llama
    from llama_metaws.engine.rpc import RPCServerError
    path, a, b, victim = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    llm = Llama(path, draft="mtp", rpc_servers=[a, b], split_mode="tensor", n_ctx=512,
                n_batch=64, n_ubatch=64, verbose=False)
    n = 0
    try:
        for chunk in llm.create_completion("the quick brown fox", max_tokens=400, temperature=0.0,
                                           stream=True):
            n += 1
            if n == 4:
                os.kill(victim, signal.SIGKILL)
        print("NO ERROR after", n, "chunks", flush=True)
    except RPCServerError as e:
        print("RAISED", type(e).__name__, "after", n, "chunks:", e, flush=True)
    llm.close()
    print("CLOSED", flush=True)
""")


def test_a_server_killed_mid_request_is_a_python_exception(mtp_path):
    procs = [start_rpc_server(free_port()) for _ in range(2)]
    try:
        eps = [p.endpoint for p in procs]
        res = subprocess.run([sys.executable, "-c", KILL_SCRIPT, mtp_path, *eps, str(procs[1].pid)],
                             capture_output=True, text=True, timeout=120)
    finally:
        for p in procs:
            stop_process(p)
    out = res.stdout + res.stderr[-2000:]
    assert res.returncode == 0, out  # no abort in the client
    assert "RAISED RPCServerError" in res.stdout and eps[1] in res.stdout, out
    assert "CLOSED" in res.stdout, out
    assert procs[0].returncode == -signal.SIGKILL  # the survivor served until we killed it


def test_rpc_server_warns_when_bound_beyond_loopback_default():
    proc = start_rpc_server(free_port(), host="127.0.0.2", wait=0)  # still loopback, not 127.0.0.1
    try:
        deadline = time.monotonic() + START_TIMEOUT
        line = ""
        while "WARNING" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
    finally:
        stop_process(proc)
    assert "WARNING" in line and "no authentication" in line, line


def test_generate_and_serve_take_rpc():
    parser = make_parser()
    for cmd in (["generate", "-p", "x"], ["serve"]):
        args = parser.parse_args([*cmd, "-m", "m.gguf", "--rpc", "127.0.0.1:50052,10.0.0.2:50052"])
        kw = flags.llama_kwargs(args)
        assert rpc.parse_servers(kw["rpc_servers"]) == ["127.0.0.1:50052", "10.0.0.2:50052"]
    assert "rpc_servers" not in flags.llama_kwargs(parser.parse_args(["serve", "-m", "m.gguf"]))


def test_devices_lists_the_servers_devices(servers):
    res = subprocess.run([sys.executable, "-m", "llama_metaws", "devices", "--rpc", ",".join(servers)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert all(ep in res.stdout for ep in servers) and "RPC1" in res.stdout, res.stdout


def test_generate_over_rpc_from_the_command_line(servers, mtp_path, cpu_texts):
    res = subprocess.run(
        [sys.executable, "-m", "llama_metaws", "generate", "-m", mtp_path, "--rpc", ",".join(servers),
         "-sm", "tensor", "--spec-type", "draft-mtp", "--phase-aware-workspace", "-c", "256",
         "-b", "64", "-ub", "64", "-p", PROMPTS[0], "-n", str(N_TOKENS)],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout == cpu_texts[0] + "\n"
    assert "alias=True" in res.stderr and "RPC" in res.stderr


def test_rpc_server_with_an_unknown_device_exits_with_a_message():
    res = subprocess.run([sys.executable, "-m", "llama_metaws", "rpc-server", "--port", str(free_port()),
                          "--device", "CUDA9"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown device 'CUDA9'" in res.stderr, res.stderr


def test_after_the_servers_are_gone_a_default_load_stays_local(mtp_path):
    # a server's devices stay registered with ggml for the life of the process, and llama.cpp's
    # default device list puts them first: a later model without rpc_servers must not go there
    from llama_metaws.engine.contexts import load_model, new_context

    proc = start_rpc_server(free_port())
    try:
        with Llama(str(mtp_path), rpc_servers=[proc.endpoint], **KW) as llm:
            over_rpc = llm.create_completion(PROMPTS[0], max_tokens=8, temperature=0.0)["choices"][0]["text"]
    finally:
        stop_process(proc)
    assert rpc.local_devices() is not None  # the dead server's device is still registered
    with Llama(str(mtp_path), **KW) as llm:
        assert llm.create_completion(PROMPTS[0], max_tokens=8, temperature=0.0)["choices"][0]["text"] == over_rpc
    model = load_model(str(mtp_path))
    try:
        ctx = new_context(model, n_ctx=64, n_batch=16)
        ctx.close()
    finally:
        model.close()
