"""llama.cpp's own fit (common_fit_params through the shim) behind Llama(n_gpu_layers="auto") and
n_ctx=0, llama-server's -ngl auto and -c 0; flash_attn="auto"; the workspace on with draft="mtp"."""

import llama_cpp
import pytest

from llama_metaws import Llama
from llama_metaws.engine import fit
from llama_metaws_dev.testing import make_tiny_mtp_model

KW = dict(n_batch=64, n_ubatch=64, verbose=False)
N_CTX_TRAIN = 4096


@pytest.fixture(scope="module")
def path(models_dir):
    return str(make_tiny_mtp_model(models_dir / "fit-4k.gguf", agreement=0.8, context_length=N_CTX_TRAIN))


def test_auto_layers_and_the_model_context_are_fitted_by_llama_cpp(path):
    with Llama(path, n_gpu_layers="auto", n_ctx=0, draft="mtp", n_seq_max=2, kv_unified=True, **KW) as llm:
        f = llm.fitted
        # a CPU-only build has no device to fit: every layer (on the CPU), the training context
        # checked against the host's memory and kept
        assert (f.verdict, f.n_gpu_layers, f.n_ctx) == ("fitted", -1, N_CTX_TRAIN)
        assert llm.n_ctx() == N_CTX_TRAIN and llm.n_ctx_slot() == N_CTX_TRAIN
        assert llm("hello", max_tokens=4, temperature=0.0)["choices"][0]["text"]
    # where memory is short (1 PiB to leave free) llama.cpp cuts the context down to the least
    # it may (fit_min_ctx), says it could not fit, and the model loads with that context
    with Llama(path, n_gpu_layers="auto", n_ctx=0, fit_target_mib=1 << 30, fit_min_ctx=512, **KW) as llm:
        assert (llm.fitted.verdict, llm.fitted.n_ctx, llm.n_ctx()) == ("could not fit", 512, 512)
    # an explicit context is left alone; --fit off leaves auto at every layer
    with Llama(path, n_gpu_layers="auto", n_ctx=1024, fit_target_mib=1 << 30, **KW) as llm:
        assert llm.fitted.n_ctx == 1024 and llm.n_ctx() == 1024
    with Llama(path, n_gpu_layers="auto", fit_params=False, n_ctx=256, **KW) as llm:
        assert llm.fitted is None and llm.model_params.n_gpu_layers == 0x7FFFFFFF
    # the binding's defaults stay: no fit unless asked for
    with Llama(path, n_ctx=256, **KW) as llm:
        assert llm.fitted is None and llm.model_params.n_gpu_layers == 0


def test_the_fit_returns_llama_cpps_status_and_never_throws(tmp_path):
    f = fit.fit(str(tmp_path / "missing.gguf"), model_fields={}, context_fields=dict(n_ctx=0))
    assert f.verdict == "error" and f.n_ctx == 0  # llama.cpp's error status, the params as they were
    with pytest.raises(ValueError, match="fit target"):
        fit.fit(str(tmp_path / "x.gguf"), model_fields={}, context_fields={}, target_mib=[-1])


def test_bad_arguments_are_value_errors(path):
    for kw, match in ((dict(n_gpu_layers="most"), "n_gpu_layers must be"), (dict(flash_attn="maybe"), "flash_attn"),
                      (dict(checkpoint_min_step=-1), "checkpoint_min_step")):
        with pytest.raises(ValueError, match=match):
            Llama(path, n_ctx=256, **kw, **KW)


def test_flash_attention_auto_is_llama_cpps_choice(path):
    outs = {}
    for fa in ("auto", True):
        with Llama(path, n_ctx=256, draft="mtp", flash_attn=fa, **KW) as llm:
            want = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO if fa == "auto" else llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
            assert llm.context_params.flash_attn_type == want  # the binding's bool did not overwrite it
            outs[fa] = llm("hello world", max_tokens=12, temperature=0.0)["choices"][0]["text"]
    assert outs["auto"] == outs[True]  # on the CPU llama.cpp turns it on


def test_the_workspace_is_on_wherever_a_draft_context_exists(path):
    with Llama(path, n_ctx=256, draft="mtp", **KW) as llm:
        assert llm.workspace_mode == "alias" and any(e.shared for e in llm.workspace_stats())
    with Llama(path, n_ctx=256, draft="mtp", phase_aware_workspace=False, **KW) as llm:
        assert llm.workspace_mode is None and llm.workspace_stats() == []
    with Llama(path, n_ctx=256, **KW) as llm:  # no draft context: nothing to share
        assert llm.workspace_mode is None
