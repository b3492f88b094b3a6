"""Slots saved to files and restored (``Llama.save_slot`` / ``restore_slot`` / ``erase_slot``, and
``POST /slots/{id}?action=save|restore|erase`` with ``--slot-save-path``).

The model is the tiny hybrid MTP one (a recurrent layer and an attention layer): its state cannot
be cut back, so reuse after a restore goes through the restored live state or the restored
checkpoints, and the draft context must come back too. Every restored slot's next request must
reuse its prefix and output exactly what a fresh slot outputs.
"""

import pytest

from llama_metaws import Llama
from llama_metaws_dev.testing import make_tiny_mtp_model
from serving import Server, llama_error

KW = dict(n_ctx=2 * 256, n_batch=64, n_ubatch=64, n_seq_max=2, verbose=False)
PROMPT = [(7 * i + 3) % 100 + 1 for i in range(40)]  # token ids (the test vocabulary prints them in hex)
OTHER = [(11 * i + 5) % 100 + 1 for i in range(30)]
N = 8


@pytest.fixture(scope="module")
def path(models_dir):
    return str(make_tiny_mtp_model(models_dir / "slot-files.gguf", seed=9, agreement=0.8))


@pytest.fixture(scope="module")
def llm(path):
    with Llama(path, draft="mtp", **KW) as llm:
        yield llm


def _draft_pos_max(llm, seq):
    from llama_metaws.native.binding import llama_cpp

    return int(llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(llm._draft_ctx.ctx), seq))


def _run(llm, slot, prompt, cache_prompt=True):
    out = llm.create_completion(prompt, max_tokens=N, temperature=0.0, id_slot=slot, cache_prompt=cache_prompt)
    return out["choices"][0]["text"], llm.timings()


def test_a_restored_slot_reuses_its_prefix_and_outputs_what_a_fresh_one_does(llm, tmp_path):
    _run(llm, 1, PROMPT)
    n, size = llm.save_slot(1, tmp_path / "s.bin")
    assert n == llm.slots()[1]["n_past"] > len(PROMPT) and size == (tmp_path / "s.bin").stat().st_size
    saved_cps = llm._engine.slots[1].checkpoints.stats()["positions"]
    assert saved_cps  # a hybrid target's prompt leaves checkpoints: they travel in the file
    _run(llm, 1, OTHER, cache_prompt=False)  # slot 1 moves on
    _run(llm, 0, OTHER, cache_prompt=False)  # so does slot 0
    assert llm.restore_slot(0, tmp_path / "s.bin") == (n, size)
    assert llm.slots()[0]["n_past"] == n
    assert _draft_pos_max(llm, 0) == n - 1  # the draft context holds the same positions again
    assert llm._engine.slots[0].checkpoints.stats()["positions"] == saved_cps

    longer = PROMPT + [42, 43, 44]
    fresh, t_fresh = _run(llm, 1, longer, cache_prompt=False)
    assert t_fresh["cache_n"] == 0
    llm.restore_slot(0, tmp_path / "s.bin")
    text, t = _run(llm, 0, longer)
    assert text == fresh and t["cache_n"] >= len(PROMPT) - 1, t  # the live state, restored, goes on
    # the draft context came back too: it drafts what a fresh slot's drafts, accepted alike
    assert (t["draft_n"], t["draft_n_accepted"]) == (t_fresh["draft_n"], t_fresh["draft_n_accepted"]), (t, t_fresh)

    # a prompt that parts from the saved one before its end: a restored checkpoint serves it
    parted = PROMPT[:-2] + [42, 43]
    fresh, _ = _run(llm, 1, parted, cache_prompt=False)
    llm.restore_slot(0, tmp_path / "s.bin")
    text, t = _run(llm, 0, parted)
    assert text == fresh and 0 < t["cache_n"] <= len(PROMPT) - 2, t
    assert t["cache_n"] in saved_cps


def test_erase_empties_the_slot(llm, tmp_path):
    _run(llm, 1, PROMPT)
    held = llm.slots()[1]["n_past"]
    assert llm.erase_slot(1) == held > 0
    assert llm.slots()[1]["n_past"] == 0
    text, t = _run(llm, 1, PROMPT)
    assert t["cache_n"] == 0


def test_a_bad_file_is_a_value_error_and_leaves_the_slot_empty(llm, tmp_path):
    _run(llm, 1, PROMPT)
    good = tmp_path / "good.bin"
    llm.save_slot(1, good)
    data = good.read_bytes()
    cases = {"garbage": b"not a slot file", "truncated": data[: len(data) // 2], "extended": data + b"x"}
    for name, blob in cases.items():
        (tmp_path / name).write_bytes(blob)
        _run(llm, 0, PROMPT)
        with pytest.raises(ValueError):
            llm.restore_slot(0, tmp_path / name)
        assert llm.slots()[0]["n_past"] == 0, name
    text, t = _run(llm, 0, PROMPT)  # and the slot works afterwards
    assert t["cache_n"] == 0 and text
    with pytest.raises(ValueError, match="no slot"):
        llm.save_slot(5, tmp_path / "x.bin")


def test_a_file_from_another_setup_is_refused(llm, path, models_dir, tmp_path):
    _run(llm, 1, PROMPT)
    f = tmp_path / "s.bin"
    llm.save_slot(1, f)
    with Llama(path, **KW) as plain:  # the same model without drafting
        with pytest.raises(ValueError, match="saved with MTP drafting"):
            plain.restore_slot(0, f)
    other = str(make_tiny_mtp_model(models_dir / "slot-files-other.gguf", seed=10, agreement=0.5, vocab="chars"))
    with Llama(other, draft="mtp", **KW) as llm2:
        with pytest.raises(ValueError, match="another model"):
            llm2.restore_slot(0, f)
    n_slot = llm.n_ctx_slot()
    with Llama(path, draft="mtp", **dict(KW, n_seq_max=1, n_ctx=2 * n_slot)) as big:
        long = (PROMPT * 20)[: n_slot + 10]
        _run(big, 0, long)
        big.save_slot(0, tmp_path / "long.bin")
    with pytest.raises(ValueError, match="does not fit"):
        llm.restore_slot(0, tmp_path / "long.bin")


# --- the server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slot-save")
    (tmp / "slots").mkdir()
    srv = Server(path, "--spec-type", "draft-mtp", "-np", "2", "-c", "512", "-b", "64", "-ub", "64",
                 "--temp", "0", "--slot-save-path", str(tmp / "slots"), log_path=tmp / "server.log")
    srv.dir = tmp / "slots"
    yield from srv.running()


def _complete(server, slot, prompt, cache_prompt=True):
    status, res = server.json("POST", "/completion", {"prompt": prompt, "id_slot": slot, "n_predict": N,
                                                      "cache_prompt": cache_prompt})
    assert status == 200, res
    return res


def test_save_restore_and_erase_through_the_server(server):
    first = _complete(server, 1, PROMPT)
    status, res = server.json("POST", "/slots/1?action=save", {"filename": "slot1.bin"})
    assert status == 200, res
    assert res["id_slot"] == 1 and res["filename"] == "slot1.bin" and res["n_saved"] >= len(PROMPT)
    assert res["n_written"] == (server.dir / "slot1.bin").stat().st_size and res["timings"]["save_ms"] >= 0
    n_saved = res["n_saved"]
    _complete(server, 0, OTHER, cache_prompt=False)
    status, res = server.json("POST", "/slots/0?action=restore", {"filename": "slot1.bin"})
    assert status == 200, res
    assert res["n_restored"] == n_saved and res["n_read"] > 0 and "restore_ms" in res["timings"]
    again = _complete(server, 0, PROMPT)
    assert again["content"] == first["content"] and again["timings"]["cache_n"] == len(PROMPT) - 1
    status, res = server.json("POST", "/slots/0?action=erase")
    assert status == 200 and res == {"id_slot": 0, "n_erased": res["n_erased"]} and res["n_erased"] > 0
    assert _complete(server, 0, PROMPT)["timings"]["cache_n"] == 0


@pytest.mark.parametrize("route, body, message", [
    ("/slots/0?action=save", {"filename": "../escape.bin"}, "Invalid filename"),
    ("/slots/0?action=save", {"filename": "a/b.bin"}, "Invalid filename"),
    ("/slots/0?action=save", {"filename": "trailing."}, "Invalid filename"),
    ("/slots/0?action=save", {}, "Invalid filename"),
    ("/slots/0?action=restore", {"filename": "missing.bin"}, "Unable to restore slot"),
    ("/slots/0?action=fly", {"filename": "x.bin"}, "Invalid action"),
    ("/slots/7?action=save", {"filename": "x.bin"}, "Invalid slot ID"),
    ("/slots/x?action=save", {"filename": "x.bin"}, "Invalid slot ID"),
])
def test_bad_slot_actions_are_400s(server, route, body, message):
    status, res = server.json("POST", route, body)
    assert status == 400 and message in llama_error(res, 400)["message"], res
    assert not list(server.dir.glob("*escape*")) and not (server.dir.parent / "escape.bin").exists()


def test_a_damaged_file_is_a_400_and_the_server_goes_on(server):
    (server.dir / "bad.bin").write_bytes(b"LMWSSLOT" + b"\0" * 40)
    status, res = server.json("POST", "/slots/0?action=restore", {"filename": "bad.bin"})
    assert status == 400 and "Unable to restore slot" in llama_error(res, 400)["message"], res
    assert server.json("GET", "/health")[0] == 200 and _complete(server, 0, PROMPT)["content"]


def test_without_a_slot_save_path_slot_actions_are_a_501(path, tmp_path):
    srv = Server(path, "-c", "256", log_path=tmp_path / "plain.log")
    try:
        status, res = srv.json("POST", "/slots/0?action=save", {"filename": "x.bin"})
        assert status == 501 and "--slot-save-path" in llama_error(res, 501)["message"], res
    finally:
        srv.kill()
