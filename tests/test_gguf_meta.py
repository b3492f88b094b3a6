"""gguf_meta.read_keys: a GGUF file's scalar and string keys, equal to gguf-py's reading, in
little memory and with a clear error for a file that is not one."""

import resource

import gguf
import numpy as np
import pytest

from llama_metaws.engine.gguf_meta import read_keys


def _scalars(path):
    reader = gguf.GGUFReader(path)
    out = {}
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and field.types and field.types[0] != gguf.GGUFValueType.ARRAY:
            out[name] = field.contents()
    return out


def test_read_keys_equals_gguf_py(tiny_mtp_model):
    want = _scalars(str(tiny_mtp_model))
    assert "general.architecture" in want and len(want) > 5
    got = read_keys(str(tiny_mtp_model), list(want) + ["no.such.key"])
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v) if isinstance(v, float) else got[k] == v, k


def test_read_keys_steps_over_a_real_vocabulary(tmp_path):
    # 151,936 tokens and their scores ahead of the key asked for: gguf-py holds hundreds of MB
    # of views for them; read_keys steps over them
    path = tmp_path / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "qwen35")
    w.add_token_list([f"tok{i}".encode() for i in range(151936)])
    w.add_token_scores([0.0] * 151936)
    w.add_uint32("qwen35.nextn_predict_layers", 1)
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    got = read_keys(str(path), ["qwen35.nextn_predict_layers", "general.architecture", "no.such.key"])
    assert got == {"qwen35.nextn_predict_layers": 1, "general.architecture": "qwen35"}
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 20 * 1024  # KiB


@pytest.mark.parametrize("cut", [3, 20, 200])
def test_a_truncated_or_foreign_file_is_a_value_error(tiny_mtp_model, tmp_path, cut):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(tiny_mtp_model.read_bytes()[:cut])
    with pytest.raises(ValueError):
        read_keys(str(bad), ["tokenizer.ggml.tokens_count_that_is_not_there"])
    other = tmp_path / "other.bin"
    other.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="GGUF magic"):
        read_keys(str(other), ["general.architecture"])


def test_check_complete_finds_a_cut_in_the_tensor_data(tiny_mtp_model, tmp_path):
    from llama_metaws.engine.gguf_meta import check_complete

    check_complete(str(tiny_mtp_model))  # whole: no error
    data = tiny_mtp_model.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) - 1])
    with pytest.raises(ValueError, match="tensors need"):
        check_complete(str(bad))
