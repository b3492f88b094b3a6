"""``Llama``: llama-cpp-python's ``Llama`` with MTP drafting, named devices and the workspace.

A subclass, so everything ``llama_cpp.Llama`` does keeps working (completions, ``__call__``,
streaming, chat with the model's template, tokenize/detokenize, stop strings, seeds,
logprobs): all of it runs through ``Llama.generate``, whose speculative path asks a draft
model for tokens, evaluates them with the sampled token in one batch, samples every position
from the target and keeps drafts only while they equal the sampled token. That keeps the
target's distribution whether sampling is greedy or not. Here the draft model is the model's
own MTP (NextN) head in a second context (:class:`MTPDraftModel`), fed the target's hidden
rows by :meth:`Llama.eval`, and the two contexts share a phase-aware workspace.

New keyword arguments (llama.cpp's option names):

- ``draft="mtp"`` drafts with the model's NextN layers (``None``, the default: no drafting);
  ``draft_max`` (3) tokens per step at most (``"auto"``: a length chosen per step from the
  last steps' acceptance, see :class:`~llama_metaws.engine.draft_model.AdaptiveLength`),
  ``draft_p_min`` (0.0) stops a draft at the first token the head gives less probability;
- ``devices=["CPU", "CUDA0", ...]``: device names as llama.cpp prints them; the same CPU device
  may be listed twice (a CPU test bed); with devices, ``n_gpu_layers`` defaults to all layers;
- ``rpc_servers=["host:port", ...]`` (or llama.cpp's ``--rpc`` string ``"h1:p1,h2:p2"``): ggml
  RPC servers (:mod:`llama_metaws.engine.rpc`), whose devices (``RPC0``, ...) come first by default,
  then the local GPUs; a lost server raises :class:`~llama_metaws.engine.rpc.RPCServerError`;
- ``split_mode``: ``"none" | "layer" | "row" | "tensor"`` or the binding's integers, with
  ``tensor_split``; the binding's ``offload_kqv=False`` (``-nkvo``) under tensor split keeps
  the KV caches in host memory, each device on its own heads (CPU devices; else a ValueError);
- ``n_seq_max`` (llama.cpp's ``-np``): sequences the contexts hold;
- ``phase_aware_workspace=True`` and ``workspace_mode`` (``"alias"``, ``"private-meta"``,
  ``"off"``; ``"unsafe-shared"`` only with ``allow_unsafe_workspace=True``, to reproduce a crash);
- prompt reuse of a recurrent or hybrid target with drafting (:mod:`llama_metaws.engine.checkpoints`):
  ``ctx_checkpoints`` (count), ``checkpoint_every`` (tokens) and ``ctx_checkpoints_bytes``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
import time
from typing import List, Optional, Sequence, Union

import numpy as np

from .engine import devices as _devices
from .native.binding import _internals, llama_cpp
from .engine import checkpoints as _ckpt
from .engine import rpc as _rpc
from .guard import RequestGuard
from .engine import contexts as _contexts
from .engine.contexts import split_mode_value
from .engine.gguf_meta import check_complete, read_keys
from .engine.draft_model import AdaptiveLength, DraftStatsReport, MTPDraftModel
from .engine.mtp import DraftStats, MTPDrafter
from .native.params import check_fields, set_fields
from .engine.workspace import MODES as WORKSPACE_MODES
from .engine.workspace import Workspace

__all__ = ["Llama", "MTPDraftModel", "DraftStatsReport", "RequestGuard"]

DRAFT_KINDS = ("mtp",)
# the binding's completion generator, whose max_tokens bounds a request's drafts
_COMPLETION = inspect.signature(llama_cpp.Llama._create_completion)

def _gguf_nextn_layers(path: str) -> tuple:
    """(architecture, nextn_predict_layers) from the file's metadata, without loading it."""
    try:
        arch = read_keys(path, ["general.architecture"]).get("general.architecture")
        if arch is None:
            raise ValueError(f"{path} has no general.architecture: not a llama.cpp model")
        n = read_keys(path, [f"{arch}.nextn_predict_layers"]).get(f"{arch}.nextn_predict_layers", 0)
        check_complete(path)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        if "general.architecture" in str(e):
            raise
        raise ValueError(f"{path} is not a readable GGUF model (truncated?): {e}") from None
    return arch, int(n)


def _timings(n_prompt: int, cache_n: int, prompt_n: int, predicted_n: int, t0: float,
             t_first: Optional[float], t_end: float, t_encoded: Optional[float] = None) -> dict:
    """A request's figures (see :meth:`Llama.timings`); ``t_encoded``: when a drafting request's
    prompt, all but its held-back last token, was decoded on both contexts (else None)."""
    t_first = t_end if t_first is None else t_first
    if t_encoded is None:  # the prompt phase ends with the first token, the decode phase follows it
        n_prompt_phase, t_split, n_decode = prompt_n, t_first, max(predicted_n - 1, 0)
    else:  # llama-speculative-simple's phases: the held-back token's step opens the decode phase
        n_prompt_phase, t_split, n_decode = max(prompt_n - 1, 0), t_encoded, predicted_n
    prompt_s, predicted_s = t_split - t0, t_end - t_split
    return {
        "prompt_tokens": n_prompt,
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_s * 1e3,
        "prompt_tokens_per_s": n_prompt_phase / prompt_s if n_prompt_phase and prompt_s > 0 else 0.0,
        "ttft_ms": (t_first - t0) * 1e3,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_s * 1e3,
        "decode_tokens": n_decode,
        "decode_tokens_per_s": n_decode / predicted_s if n_decode and predicted_s > 0 else 0.0,
    }


class _WithOurFields:
    """``self.<name> = params`` stores the binding's params with our fields set on them.

    ``llama_cpp.Llama.__init__`` makes ``self.model_params`` / ``self.context_params`` from the
    binding's default-params calls before it loads the model / the context; this data
    descriptor adds the fields in ``self.<fields_attr>`` at that assignment, on this instance
    only, by the names the struct declares (:func:`~llama_metaws.native.params.set_fields`).
    """

    def __init__(self, fields_attr: str):
        self.fields_attr = fields_attr

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj, objtype=None):
        return self if obj is None else obj.__dict__.get(self.slot)

    def __set__(self, obj, params) -> None:
        set_fields(params, getattr(obj, self.fields_attr, {}))
        obj.__dict__[self.slot] = params


class Llama(llama_cpp.Llama):
    """llama-cpp-python's ``Llama`` with MTP drafting, named devices and the workspace.

    See the module docstring for the new keyword arguments; every other argument is
    ``llama_cpp.Llama``'s. Extra attributes: :attr:`draft_stats`, :meth:`workspace_stats`,
    :meth:`timings`.

    Thread safety: one instance may be used from several threads, its requests are serialized
    by a per-instance :class:`RequestGuard` held by :meth:`generate` (from its first ``next``
    until the generator ends, is closed or is garbage-collected, on whichever thread that
    happens) and by :meth:`eval`, so a second thread waits for the first request.
    """

    def __init__(
        self,
        model_path: str,
        *args,
        draft: Optional[str] = None,
        draft_max: Union[int, str] = 3,
        draft_p_min: float = 0.0,
        devices: Optional[Sequence[str]] = None,
        rpc_servers: Union[None, str, Sequence[str]] = None,
        split_mode: Union[str, int] = llama_cpp.LLAMA_SPLIT_MODE_LAYER,
        tensor_split: Optional[List[float]] = None,
        phase_aware_workspace: bool = True,
        workspace_mode: str = "alias",
        allow_unsafe_workspace: bool = False,
        n_seq_max: int = 1,
        ctx_checkpoints: int = _ckpt.DEFAULT_CTX_CHECKPOINTS,
        checkpoint_every: int = _ckpt.DEFAULT_CHECKPOINT_EVERY,
        ctx_checkpoints_bytes: int = _ckpt.DEFAULT_CHECKPOINT_BYTES,
        **kwargs,
    ):
        # Serializes requests from several threads (see the class docstring): the target, the
        # draft context and their shared workspace must see one request at a time (two
        # concurrent ones abort in ggml).
        self._guard = RequestGuard()
        self._request_counts = None  # [cache_n, prompt_n] of the request being generated
        self._mtp: Optional[MTPDraftModel] = None
        self._draft_ctx = None
        self._workspace: Optional[Workspace] = None
        self.draft_stats = DraftStatsReport()
        self._timings = _timings(0, 0, 0, 0, 0.0, 0.0, 0.0)
        self._in_request = False  # inside _generate_held
        self._t_encoded = None    # when the request's prompt was decoded (drafting: its held-back token aside)
        self._budgets = threading.local()  # .next: max_tokens of the completion about to generate
        self._verifying = False   # the request's prompt is evaluated: every row is sampled now
        # prompt reuse through checkpoints (a recurrent target with drafting); checks arguments
        self._reuse = _ckpt.PromptReuse(ctx_checkpoints, checkpoint_every, ctx_checkpoints_bytes)

        # arguments first: a clear ValueError before anything is loaded
        if draft is not None and draft not in DRAFT_KINDS:
            raise ValueError(f"draft={draft!r}: the supported kinds are {DRAFT_KINDS} (or None)")
        adaptive = draft_max == "auto"
        if adaptive:  # the length adapts per step (draft_model.AdaptiveLength), up to its cap
            draft_max = AdaptiveLength.CAP
        if isinstance(draft_max, bool) or not isinstance(draft_max, int) or draft_max < 1:
            raise ValueError(f"draft_max must be an integer >= 1 or 'auto', got {draft_max!r}")
        if not (0.0 <= float(draft_p_min) <= 1.0):
            raise ValueError(f"draft_p_min must be in [0, 1], got {draft_p_min!r}")
        if workspace_mode not in WORKSPACE_MODES:
            raise ValueError(f"workspace_mode {workspace_mode!r} is not one of {', '.join(WORKSPACE_MODES)}")
        if workspace_mode == "unsafe-shared" and not allow_unsafe_workspace:
            raise ValueError("workspace_mode='unsafe-shared' aborts the process under tensor split; "
                             "pass allow_unsafe_workspace=True to reproduce that, or use 'alias'")
        split = split_mode_value(split_mode)
        if not os.path.exists(model_path):
            raise ValueError(f"Model path does not exist: {model_path}")
        if os.path.getsize(model_path) == 0:
            raise ValueError(f"Model file is empty: {model_path}")

        if isinstance(n_seq_max, bool) or not isinstance(n_seq_max, int) or n_seq_max < 1:
            raise ValueError(f"n_seq_max must be an integer >= 1, got {n_seq_max!r}")
        model_fields = {}
        self._device_list = None
        self._rpc = _rpc.connect(rpc_servers)  # ValueError for a bad or unreachable server
        local = None
        if self._rpc and not devices:
            devices = self._rpc.default_devices()
        elif not devices:  # an earlier Llama's servers stay registered: keep this model off them
            local = _rpc.local_devices()
        if devices:
            self._device_list = _devices.DeviceList(list(devices))  # ValueError lists the devices
            model_fields["devices"] = self._device_list.pointer
            kwargs.setdefault("n_gpu_layers", -1)
        elif local is not None:
            self._device_list = _devices.DeviceList(local, allow_empty=True)
            model_fields["devices"] = self._device_list.pointer
        if split == llama_cpp.LLAMA_SPLIT_MODE_TENSOR:  # devices, flash attention, host KV
            _devices.check_tensor_split(self._device_list, kwargs)
        if draft == "mtp":
            arch, n_nextn = _gguf_nextn_layers(model_path)
            if n_nextn < 1:
                raise ValueError(
                    f"draft='mtp' needs a model with NextN (MTP) layers; this {arch!r} model has none "
                    f"({arch}.nextn_predict_layers is missing or 0). Use draft=None, or an MTP model "
                    f"(qwen35, qwen3next, glm4-moe, deepseek2, ...)")
            model_fields["load_mtp"] = True
            n_ubatch = kwargs.get("n_ubatch", 512)
            if draft_max + 1 > min(kwargs.get("n_batch", 512), n_ubatch):
                raise ValueError(f"draft_max={draft_max}: a verification batch of {draft_max + 1} "
                                 "tokens must fit n_batch and n_ubatch")

        self._draft_max = draft_max if draft == "mtp" else 0  # the longest draft ("auto": its cap)
        # n_seq_max, rollback snapshots and llama-server's output rows (engine.contexts)
        context_fields, self._draft_fields = _contexts.context_fields(
            n_seq_max=n_seq_max, draft_max=self._draft_max,
            n_batch=kwargs.get("n_batch", 512), logits_all=bool(kwargs.get("logits_all", False)))

        draft_model = kwargs.pop("draft_model", None)  # the binding's own (prompt lookup, ...)
        if draft == "mtp":
            if draft_model is not None:
                raise ValueError("draft='mtp' and draft_model=... both give a draft model: choose one")
            draft_model = MTPDraftModel.__new__(MTPDraftModel)  # set up once the model is loaded
        # llama_cpp.Llama.__init__ makes its params with the binding's default-params calls and
        # assigns them to self.model_params / self.context_params before it loads anything: the
        # properties below add our fields there, on this instance alone (no other thread or
        # instance can see them), by the names the structs declare
        self._model_fields, self._context_fields = model_fields, context_fields
        super().__init__(
            model_path, *args, split_mode=split, tensor_split=tensor_split,
            draft_model=draft_model, **kwargs,
        )
        # what llama.cpp was given is what we asked for (a binding that built its params some
        # other way would otherwise lose them silently)
        check_fields(self.model_params, model_fields, "llama_model_params")
        check_fields(self.context_params, context_fields, "llama_context_params")
        for name, getter in (("n_seq_max", llama_cpp.llama_n_seq_max), ("n_rs_seq", llama_cpp.llama_n_rs_seq)):
            if name in context_fields and int(getter(self._ctx.ctx)) < context_fields[name]:
                raise RuntimeError(f"the context has {name}={int(getter(self._ctx.ctx))}, "
                                   f"{context_fields[name]} was asked for")

        if draft == "mtp":
            # the binding turns logits_all on whenever a draft model is set: logits for every
            # prompt token (n_tokens x n_vocab computed and copied). Drafting reads only what
            # sampling reads (see _eval_drafting); logits_all and logprobs stay the user's choice
            self._logits_all = bool(kwargs.get("logits_all", False))
            self._setup_mtp(draft_max, float(draft_p_min), phase_aware_workspace, workspace_mode,
                            allow_unsafe_workspace)
            self._mtp.length = AdaptiveLength() if adaptive else None
            # a recurrent state can be cut back only inside its last decode: reuse checkpoints
            self._reuse.active = bool(self._is_recurrent or self._is_hybrid)
        self._rpc.check(self._ctx.ctx)  # the weights reached every server

    # the binding assigns these once, in __init__, before it loads the model / the context
    model_params = _WithOurFields("_model_fields")
    context_params = _WithOurFields("_context_fields")

    # ---------------------------------------------------------------------------------------

    def _setup_mtp(self, draft_max, p_min, phase_aware, mode, allow_unsafe) -> None:
        # the draft context is the target's, as llama.cpp derives it: the same KV types, flash
        # attention, offload, threads and sizes; an MTP context with no rollback snapshots
        cp = _contexts.draft_context_params(self.context_params, self._draft_fields)
        self._draft_ctx = self._stack.enter_context(contextlib.closing(
            _internals.LlamaContext(model=self._model, params=cp, verbose=self.verbose)))
        drafter = MTPDrafter(self._ctx, self._draft_ctx, draft_max=draft_max, p_min=p_min)
        self._stack.callback(drafter.close)
        # the draft model object was handed to llama_cpp.Llama before the model existed
        self.draft_model.__init__(drafter, self.draft_stats)
        self._mtp = self.draft_model
        if phase_aware and mode != "off":
            n_decode = self.context_params.n_seq_max * (draft_max + 1)
            self._workspace = Workspace(self._ctx, self._draft_ctx, mode=mode,
                                        n_decode_tokens=n_decode, allow_unsafe=allow_unsafe)
            self._stack.callback(self._workspace.close)  # before the contexts go (LIFO)

    def eval(self, tokens: Sequence[int]):
        """Evaluate tokens on the target; with MTP drafting, feed the draft context too."""
        with self._guard.hold():  # one request at a time (see the class docstring)
            counts = self._request_counts
            if counts is not None and counts[0] is None:
                # the request's first evaluation: what the binding kept of the last prompt
                counts[0], counts[1] = self.n_tokens, len(tokens)
            try:
                out = self._eval_locked(tokens)
            except RuntimeError:  # llama_decode failed: a lost RPC server is what to name
                self._rpc.check()
                raise
            self._rpc.check(self._ctx.ctx)  # every command answered, none dropped (patch 0014)
            return out

    def _eval_locked(self, tokens: Sequence[int]):
        if self._mtp is None:
            return super().eval(tokens)
        return self._eval_drafting(tokens)

    def _eval_drafting(self, tokens: Sequence[int]) -> None:
        """The target decodes ``tokens``; the draft context follows it.

        Logits are asked for where the binding's sampling reads them and nowhere else (unless
        ``logits_all``): every position of a request's evaluations after its prompt (the
        sampled token and its drafts), the last token of a plain ``eval``. A request's prompt
        is decoded as llama.cpp's draft-mtp does it: its last token is held back, the head
        drafts from it, and ``[last, drafts...]`` is decoded in one batch, every row sampled
        by the binding (which keeps the drafts equal to what it samples). No logits are
        copied: the sampler reads llama.cpp's own rows.
        """
        self._mtp.sync(self.n_tokens)
        self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1)
        # after a request's prompt, each evaluation is [sampled token, drafts...] (or what a
        # caller sent into the generator), every position of which the binding samples
        prompt = self._in_request and not self._verifying
        every_row = self._logits_all or self._verifying
        self._verifying = self._in_request
        tokens = list(tokens)
        # chunks of n_batch at most; a request's prompt ends one at each checkpoint position but
        # the one read from the rollback snapshots (not with every row: llama then splits a
        # batch into ubatches without keeping its last tokens together)
        reach = 0 if every_row else self._mtp.drafter.rollback_states
        for start, n, backs in self._reuse.chunks(self.n_tokens, len(tokens), self.n_batch, prompt,
                                                  held_back=1 if prompt else 0, reach=reach):
            # a prompt's chunks need no logits: the held-back token's batch below gives them
            self._decode_chunk(tokens[start : start + n], "all" if every_row else "none" if prompt else "last")
            for back in backs:
                self._reuse.save(self, back)
        if prompt and tokens:
            self._t_encoded = time.perf_counter()  # llama-speculative-simple's end of "encoded"
            last, n_past = tokens[-1], self.n_tokens
            self._decode_chunk([last] + self._mtp.draft_at(last, n_past), "all")
        self._requires_eval = False

    def _decode_chunk(self, chunk: List[int], rows: str) -> None:
        """Decode ``chunk`` after ``n_tokens`` on the target, with logits for ``rows`` ("all",
        "last", "none"; every row with ``logits_all``), and feed it to the draft context."""
        n, n_past = len(chunk), self.n_tokens
        every = self._logits_all or rows == "all"
        self._batch.set_batch(batch=chunk, n_past=n_past, logits_all=every)
        if rows == "none" and not every:
            self._batch.batch.logits[n - 1] = False
        self._ctx.decode(self._batch)
        self.input_ids[n_past : n_past + n] = chunk
        if self._logits_all:  # the user asked for every row (logprobs): keep them, as the binding does
            self.scores[n_past : n_past + n, :] = np.ctypeslib.as_array(
                self._ctx.get_logits(), shape=(n, self._n_vocab))
        self.n_tokens += n
        self._mtp.target_decoded(chunk, n_past)

    def checkpoint_stats(self) -> dict:
        """Prompt reuse: :meth:`llama_metaws.engine.checkpoints.PromptReuse.stats`."""
        return self._reuse.stats()

    def generate(self, tokens, *args, **kwargs):
        """``llama_cpp.Llama.generate``, timed; the draft statistics of this request start at zero.

        The instance is held from the first ``next`` until the generator ends, is closed or is
        garbage-collected, on whichever thread each of those happens (see :class:`RequestGuard`).
        """
        if self._guard.inside():
            # called from inside the request being run (a logits processor, a chat handler's
            # second completion): it already holds the instance
            yield from self._generate_held(tokens, *args, **kwargs)
            return
        ticket = self._guard.acquire()
        inner = self._generate_held(tokens, *args, **kwargs)
        try:
            with self._guard.running(ticket):
                token = next(inner)
            while True:
                sent = yield token  # suspended: the instance stays held, no thread is marked
                with self._guard.running(ticket):
                    token = inner.send(sent)
        except StopIteration:
            pass
        finally:
            try:
                with self._guard.running(ticket):
                    inner.close()
            finally:
                self._guard.release(ticket)

    def _create_completion(self, *args, **kwargs):
        """The binding's completion generator; its ``max_tokens`` bounds the request's drafts."""
        max_tokens = _COMPLETION.bind(self, *args, **kwargs).arguments.get("max_tokens")
        budget = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else None
        return self._with_budget(super()._create_completion(*args, **kwargs), budget)

    def _with_budget(self, inner, budget):
        # runs from the first next(), on that thread, which then starts generate() inside `inner`
        self._budgets.next = budget
        try:
            return (yield from inner)
        finally:  # a completion that failed before generate() started leaves no stale budget
            self._budgets.next = None

    def _generate_held(self, tokens, *args, **kwargs):
        self.draft_stats.last = DraftStats()
        # the tokens this request may still take (None: unbounded); a step drafts one fewer at
        # most, as llama-speculative-simple does, so no draft outlives the request
        budget, self._budgets.next = getattr(self._budgets, "next", None), None
        if self._mtp is not None:
            self._mtp.remaining = budget
        self._t_encoded = None
        sampled = list(tokens)  # the prompt, then each token sampled (None: a caller sent tokens)
        reuse = self._reuse.active and kwargs.get("reset", True)
        if reuse:  # the live state, a rollback inside its snapshots, a checkpoint; else afresh
            self._reuse.start(self, sampled[:])
        n_prompt = len(tokens)
        counts = self._request_counts = [None, 0]
        t0 = time.perf_counter()
        t_first, n_out = None, 0
        inner = super().generate(tokens, *args, **kwargs)
        self._in_request, self._verifying = True, False
        try:
            token = next(inner)
            while True:
                if t_first is None:
                    t_first = time.perf_counter()
                n_out += 1
                if budget is not None and self._mtp is not None:
                    self._mtp.remaining = budget - n_out
                if sampled is not None:
                    sampled.append(token)
                # the binding's protocol: a caller may send tokens to evaluate next; pass them on
                sent = yield token
                sampled = sampled if sent is None else None
                token = inner.send(sent)
        except StopIteration:
            pass
        except Exception as e:
            sampled = None  # a failed request: nothing to settle (a closed generator is no failure)
            if isinstance(e, RuntimeError):  # a decode failed (the draft's too): a lost RPC server?
                self._rpc.check()
            raise
        finally:
            inner.close()
            self._in_request = self._verifying = False
            if self._mtp is not None:
                # before the reuse bookkeeping cuts the draft context (which would settle it)
                self._mtp.end_request(sampled)
                self._mtp.remaining = None
            if reuse and sampled:
                self._reuse.end(self, sampled)
            t_end = time.perf_counter()
            self._request_counts = None
            cache_n = counts[0] or 0
            self._timings = _timings(n_prompt, cache_n, counts[1], n_out, t0, t_first, t_end, self._t_encoded)

    def save_state(self) -> "llama_cpp.LlamaState":
        """The binding's state; with drafting, the draft context's too (``LlamaRAMCache`` works)."""
        with self._guard.hold():
            state = super().save_state()
            return state if self._mtp is None else _ckpt.save_draft_state(self, state)

    def load_state(self, state: "llama_cpp.LlamaState") -> None:
        """The binding's; with drafting, a drafting Llama's state (the draft context's is restored)."""
        with self._guard.hold():
            _ckpt.check_draft_state(self, state)
            super().load_state(state)
            _ckpt.load_draft_state(self, state)

    def workspace_stats(self):
        """Per compute buffer type: requirements, bytes allocated, generation, grows/shrinks."""
        if self._workspace is None:
            return []
        return self._workspace.stats()

    def timings(self) -> dict:
        """The last request's prompt and decode figures.

        ``prompt_tokens`` (the whole prompt), ``cache_n`` (of those, kept from the last request:
        not evaluated again), ``prompt_n`` (evaluated), ``ttft_ms`` (until the first token),
        ``predicted_n`` (tokens sampled, the first included), and the two phases:
        ``prompt_ms``/``prompt_tokens_per_s``, then ``predicted_ms`` with ``decode_tokens`` and
        ``decode_tokens_per_s`` (``decode_tokens`` over ``predicted_ms``).

        Without drafting the prompt phase ends with the first token (as llama-bench's pp and the
        binding count it), and ``decode_tokens`` are the tokens after the first one. With
        ``draft="mtp"`` the phases are llama-speculative-simple's: the prompt's last token is held
        back and decoded with the first draft, so the prompt phase is the ``prompt_n - 1`` tokens
        before it, decoded on the target and the draft context, and the decode phase is every
        step after it, all ``predicted_n`` tokens; ``ttft_ms`` then includes the first step.
        """
        return dict(self._timings)

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Free everything; closing twice is harmless."""
        if getattr(self, "_stack", None) is None:  # __init__ raised before the binding's ran
            return
        self._mtp = None
        super().close()
