"""``Llama``: llama-cpp-python's ``Llama`` on the engine, with MTP drafting, named devices and the workspace.

A subclass, so everything ``llama_cpp.Llama`` does keeps working (completions, ``__call__``,
streaming, chat with the model's template, tokenize/detokenize, stop strings, seeds, logprobs,
grammars, the low-level ``eval``/``sample``/``generate``, ``save_state``/``load_state``). The
generation runs on the :class:`~llama_metaws.engine.core.Engine`: each completion is an engine
request, and several threads' completions on one ``Llama(n_seq_max=N)`` run in the same steps,
N at a time, batched (:mod:`llama_metaws.api.completion` answers them in the binding's shapes). The
draft model is the model's own MTP (NextN) head in a second context, and the two contexts share a
phase-aware workspace.

New keyword arguments (llama.cpp's option names), held and checked by one
:class:`~llama_metaws.api.options.LlamaOptions` (``Llama(path, options=LlamaOptions(...))`` takes one
made already; ``llm.options`` is the one a Llama was built from):

- ``draft="mtp"`` drafts with the model's NextN layers (``None``, the default: no drafting);
  ``draft_max`` (3) tokens per step at most (``"auto"``: a length chosen per step and slot
  for the most tokens per second, from each depth's recent acceptance and the step costs:
  measured at load, or a curve saved by an earlier load and checked
  (:mod:`llama_metaws.engine.prior`), then as the engine runs, see
  :mod:`llama_metaws.engine.policy`; a model with several NextN heads, mimo2 or step35, drafts
  step k with head k and at most as many tokens as it has heads, as llama.cpp does; a recurrent
  target whose snapshots do not reach the draft, qwen3next, verifies with speculative
  checkpoints, :mod:`llama_metaws.engine.rollback`),
  ``draft_p_min`` (0.0) stops a draft at the first token the head gives less probability;
  the binding's ``draft_model`` (prompt lookup, ...) drafts on the engine too; a ``str`` or
  ``os.PathLike`` ``draft_model`` is a GGUF file, llama-server's ``-md``: an MTP head of its own
  file (``mtp-*.gguf``) or a Gemma 4 assistant, loaded as an MTP context beside the target and
  placed as the target is, ``draft="mtp"`` implied (:mod:`llama_metaws.engine.draft_file`,
  docs/drafting.md);
  ``draft_synth_rates`` (a rate per draft position) or ``draft_synth_len``: llama-server's synthetic
  acceptance for benchmarks (:mod:`llama_metaws.engine.synthetic`; the output is not valid text);
- ``context_shift=True``: a generation that fills its slot's context goes on past it, as
  llama-server's ``--context-shift`` (:mod:`llama_metaws.engine.shift`);
- ``devices=["CPU", "CUDA0", ...]``: device names as llama.cpp prints them; the same CPU device
  may be listed twice (a CPU test bed); with devices, ``n_gpu_layers`` defaults to all layers;
- ``rpc_servers=["host:port", ...]`` (or llama.cpp's ``--rpc`` string ``"h1:p1,h2:p2"``): ggml
  RPC servers (:mod:`llama_metaws.engine.rpc`), whose devices (``RPC0``, ...) come first by default,
  then the local GPUs; a lost server raises :class:`~llama_metaws.engine.rpc.RPCServerError`;
- ``split_mode``: ``"none" | "layer" | "row" | "tensor"`` or the binding's integers, with
  ``tensor_split``; the binding's ``offload_kqv=False`` (``-nkvo``) under tensor split keeps
  the KV caches in host memory, each device on its own heads (CPU devices; else a ValueError);
- ``n_seq_max`` (llama.cpp's ``-np``): the engine's slots, requests served at once;
  ``kv_unified=True`` (``-kvu``): one KV buffer for all of them, each may use the whole context
  (else each has ``n_ctx / n_seq_max``);
- ``phase_aware_workspace`` (on: with ``draft="mtp"`` the target and its draft context share
  their compute buffers; without a draft context it has nothing to share) and ``workspace_mode``
  (``"alias"``, ``"private-meta"``, ``"off"``; ``"unsafe-shared"`` only with
  ``allow_unsafe_workspace=True``, to reproduce a crash);
- prompt reuse of a recurrent or hybrid target (:mod:`llama_metaws.engine.checkpoints`):
  ``ctx_checkpoints`` (count per slot, 32), ``checkpoint_min_step`` (8192 tokens between those
  inside a long prompt; 0: no minimum) and ``ctx_checkpoints_bytes``, llama-server's defaults;
- ``n_gpu_layers="auto"`` (llama-server's ``-ngl`` default): the layers that fit the devices' free
  memory, by llama.cpp's own fit (:mod:`llama_metaws.engine.fit`; with ``n_ctx=0`` the context is
  fitted too); ``"all"``: every layer. ``fit_params`` (default: on for ``"auto"``) runs that fit
  over whatever is left at llama.cpp's defaults, ``fit_target_mib`` (1024: MiB left free per
  device, or one per device) and ``fit_min_ctx`` (4096) as llama-server's ``-fitt`` / ``-fitc``;
  :attr:`fitted` holds what it chose;
- ``flash_attn="auto"``: on wherever the devices support it, as llama.cpp decides (the binding's
  ``True`` / ``False`` too; its default stays off);
- ``load_mode``, ``lazy_mode``, ``check_tensors``, ``use_extra_bufts``, ``no_host``:
  ``llama_model_params`` fields by llama.cpp's names (left out: llama.cpp's defaults);
- ``chat_format="llama.cpp"`` or ``chat_template`` (text): chats on llama.cpp's chat layer (:mod:`.chat_layer`),
  also the default for a model whose template it reads; other ``chat_format`` names are the binding's
  (a GGUF without a template: the binding's default is llama-2, llama.cpp's chat layer and llama-server
  fall back to chatml, docs/real-gguf.md);
- ``use_extra_bufts=False`` (llama.cpp's ``--no-repack``): the weights stay in the file's layout, not in
  the CPU's repacked (CPU_REPACK, AMX) buffer types; ``swa_full`` is the binding's (default on: a
  full-size sliding-window cache; off, as llama-server's default, a prefix is kept only at a checkpoint).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import inspect
import os
import random
import threading
import time
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from . import chat_layer as _chat
from . import completion as _completion
from . import state as _state
from ..engine import checkpoints as _ckpt
from ..engine import contexts as _contexts
from ..engine import draft_file as _draft_file
from ..engine import devices as _devices
from ..engine import fit as _fit
from ..engine import rpc as _rpc
from ..engine import prior as _prior
from ..engine import sampling as _sampling
from ..engine import synthetic as _synthetic
from ..engine.core import Engine
from ..engine.gguf_meta import architecture as _gguf_arch, nextn_layers as _gguf_nextn_layers
from ..native.archs import check_mtp_graph, check_tensor_split as check_arch_tensor_split
from ..engine.limits import check_draft_max
from ..engine import slot_files as _slot_files
from ..engine.request import DraftStats, Request, timings_of
from ..engine.samplers import SamplingParams
from ..engine.workspace import Workspace
from ..errors import GrammarError
from ..native.binding import _internals, llama_cpp, set_verbose
from ..native.params import check_fields, keeping, set_fields
from .options import LlamaOptions

__all__ = ["Llama", "LlamaOptions", "DraftStatsReport"]

#: the binding's completion arguments, which ``create_completion`` and ``__call__`` take as it does
_BINDING_COMPLETION = inspect.signature(llama_cpp.Llama.create_completion)

#: drafts a binding draft model (prompt lookup, ...) may give per step at most
PROPOSER_MAX = 10
#: a closed generator waits this long at most for its request to end (one engine step)
CLOSE_WAIT_S = 60.0


class DraftStatsReport:
    """``Llama.draft_stats``: ``last`` (the request that ended last) and ``total`` (since the model loaded)."""

    def __init__(self, engine_fn) -> None:
        self._engine = engine_fn

    @property
    def last(self) -> DraftStats:
        e = self._engine()
        return e.last.stats if e is not None and e.last is not None else DraftStats()

    @property
    def total(self) -> DraftStats:
        e = self._engine()
        return e.total if e is not None else DraftStats()

    def __repr__(self) -> str:
        last, total = self.last, self.total
        return (f"DraftStatsReport(last={last} acceptance={last.acceptance:.3f}, "
                f"total={total} acceptance={total.acceptance:.3f})")


def _options(options: Optional[LlamaOptions], given: dict) -> LlamaOptions:
    """``Llama``'s options: ``options`` as given (then our keyword arguments must be left at their
    defaults), else one made of the keyword arguments ``given``, which checks them."""
    if options is None:
        return LlamaOptions(**given)
    if not isinstance(options, LlamaOptions):
        raise TypeError(f"options must be a LlamaOptions, got {type(options).__name__}")
    defaults = {f.name: f.default for f in dataclasses.fields(LlamaOptions)}
    beside = [name for name, value in given.items() if _differs(value, defaults[name])]
    if beside:
        raise TypeError(f"{', '.join(beside)}: give these in options=, not beside it")
    options.validate()  # changed since it was made, perhaps
    return options


def _differs(value, default) -> bool:
    if value is default:
        return False
    try:
        return bool(value != default)
    except (TypeError, ValueError):  # an array's elementwise answer
        return True


def _check_model_file(model_path: str) -> None:
    if not os.path.exists(model_path):
        raise ValueError(f"Model path does not exist: {model_path}")
    if os.path.getsize(model_path) == 0:
        raise ValueError(f"Model file is empty: {model_path}")


@dataclasses.dataclass
class _Load:
    """What one ``Llama`` loads, worked out by the steps of its ``__init__`` from its options and
    the binding's arguments."""

    model_path: str
    split: int                                  # llama.cpp's split mode
    n_gpu_layers: Union[None, int, str]         # None (not given), "auto", "all" or a count
    flash_attn: int                             # llama.cpp's flash_attn_type
    fit_params: bool                            # run llama.cpp's fit
    model_fields: dict                          # our llama_model_params fields
    chat_format: Optional[str]
    devices: Optional[Sequence[str]] = None     # with RPC servers, theirs first by default
    tensor_split: Optional[List[float]] = None  # as given, or as the fit chose
    draft: Optional[str] = None                 # "mtp" (a draft model's file implies it) or None
    draft_file: Optional["_draft_file.DraftFile"] = None
    proposer: object = None                     # the binding's draft model (prompt lookup, ...)
    synth_rates: Optional[List[float]] = None   # llama-server's synthetic acceptance, per position
    context_fields: dict = dataclasses.field(default_factory=dict)  # our llama_context_params fields

    @classmethod
    def of(cls, model_path: str, options: LlamaOptions, kwargs: dict) -> "_Load":
        """The start: the binding's arguments that we take wider (``n_gpu_layers`` "auto" / "all",
        ``flash_attn="auto"``, ``chat_format="llama.cpp"``) read out of ``kwargs``."""
        n_gpu_layers = _contexts.gpu_layers(kwargs.pop("n_gpu_layers", None))  # None, "auto", "all" or N
        flash_attn = _contexts.flash_attn_type(kwargs.get("flash_attn", False))  # True, False or "auto"
        # llama-server fits when -ngl is auto (its default)
        fit_params = options.fit_params if options.fit_params is not None else n_gpu_layers == "auto"
        return cls(model_path=model_path, split=options.split, n_gpu_layers=n_gpu_layers, flash_attn=flash_attn,
                   fit_params=bool(fit_params), model_fields=options.model_fields(),
                   chat_format=kwargs.pop("chat_format", None), devices=options.devices,
                   tensor_split=options.tensor_split, draft=options.draft)


class _WithOurFields:
    """``self.<name> = params`` stores the binding's params with our fields set on them.

    ``llama_cpp.Llama.__init__`` makes ``self.model_params`` / ``self.context_params`` from the
    binding's default-params calls before it loads the model / the context; this data
    descriptor adds the fields in ``self.<fields_attr>`` at that assignment, on this instance
    only, by the names the struct declares (:func:`~llama_metaws.native.params.set_fields`), and
    keeps them: the binding's own writes that follow (its ``flash_attn_type`` from ``flash_attn``,
    its ``load_mode`` from ``use_mmap``) leave a field of ours as we set it
    (:func:`~llama_metaws.native.params.keeping`).
    """

    def __init__(self, fields_attr: str):
        self.fields_attr = fields_attr

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj, objtype=None):
        return self if obj is None else obj.__dict__.get(self.slot)

    def __set__(self, obj, params) -> None:
        fields = getattr(obj, self.fields_attr, {})
        set_fields(params, fields)
        obj.__dict__[self.slot] = keeping(params, fields)  # the binding's later writes leave ours


class _SlotZero:
    """``n_tokens`` / ``input_ids``: the binding's single sequence is the engine's slot 0 (what the
    low-level ``eval`` extends and ``save_state`` saves); before the engine exists, a plain value."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        engine = obj.__dict__.get("_engine")
        if engine is None:
            return obj.__dict__.get("_" + self.name)
        slot = engine.slots[0]
        return slot.n if self.name == "n_tokens" else slot.tokens

    def __set__(self, obj, value) -> None:
        engine = obj.__dict__.get("_engine")
        if engine is None:
            obj.__dict__["_" + self.name] = value
        elif self.name == "n_tokens":
            obj._cut_session(int(value))
        else:
            slot = engine.slots[0]
            n = min(len(value), len(slot.tokens))
            slot.tokens[:n] = np.asarray(value[:n], dtype=np.intc)


class _WithRequestFields:
    """A ``Llama`` whose ``create_completion`` (and ``__call__``) carry a request's ``id_slot`` and
    ``cache_prompt``: what the binding's chat handlers get as their ``llama`` (they call
    ``llama.create_completion`` with the binding's arguments alone); everything else is the Llama's."""

    def __init__(self, llm: "Llama", fields: dict) -> None:
        object.__setattr__(self, "_llm", llm)
        object.__setattr__(self, "_fields", fields)

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def __setattr__(self, name, value) -> None:  # a handler's writes (llama.n_tokens = ...) are the Llama's
        setattr(self._llm, name, value)

    def create_completion(self, *args, **kwargs):
        return self._llm.create_completion(*args, **self._fields, **kwargs)

    __call__ = create_completion


class Llama(llama_cpp.Llama):
    """llama-cpp-python's ``Llama`` on the engine, with MTP drafting, named devices and the workspace.

    See the module docstring for the new keyword arguments (:attr:`options` holds them); every
    other argument is ``llama_cpp.Llama``'s. The completion calls take llama-server's ``id_slot``
    and ``cache_prompt`` besides the binding's (:meth:`create_completion`). Extra attributes:
    :attr:`draft_stats`, :meth:`workspace_stats`, :meth:`timings`, :meth:`slots`,
    :meth:`checkpoint_stats`, :meth:`save_slot` / :meth:`restore_slot` / :meth:`erase_slot`.

    Threads: completions from several threads on one instance run together on the engine, up to
    ``n_seq_max`` at once, the rest waiting their turn. The binding's single-sequence calls
    (``eval``, ``sample``, ``reset``, ``save_state``, ``load_state``, ``n_tokens``,
    ``input_ids``) act on the engine's slot 0, each once no request runs.
    """

    n_tokens = _SlotZero()
    input_ids = _SlotZero()

    def __init__(
        self,
        model_path: str,
        *args,
        draft: Optional[str] = None,
        draft_max: Union[int, str] = 3,
        draft_p_min: float = 0.0,
        draft_synth_rates: Optional[Sequence[float]] = None,
        draft_synth_len: Optional[float] = None,
        context_shift: bool = False,
        devices: Optional[Sequence[str]] = None,
        rpc_servers: Union[None, str, Sequence[str]] = None,
        split_mode: Union[str, int] = llama_cpp.LLAMA_SPLIT_MODE_LAYER,
        tensor_split: Optional[List[float]] = None,
        phase_aware_workspace: bool = True,
        workspace_mode: str = "alias",
        allow_unsafe_workspace: bool = False,
        n_seq_max: int = 1,
        kv_unified: bool = False,
        ctx_checkpoints: int = _ckpt.DEFAULT_CTX_CHECKPOINTS,
        checkpoint_min_step: int = _ckpt.DEFAULT_CHECKPOINT_MIN_STEP,
        ctx_checkpoints_bytes: int = _ckpt.DEFAULT_CHECKPOINT_BYTES,
        chat_template: Optional[str] = None,
        fit_params: Optional[bool] = None,
        fit_target_mib: Union[int, Sequence[int]] = _fit.FIT_TARGET_MIB,
        fit_min_ctx: int = _fit.FIT_MIN_CTX,
        options: Optional[LlamaOptions] = None,
        **kwargs,
    ):
        t_load = time.perf_counter()
        self._engine: Optional[Engine] = None
        self._draft_ctx = None
        self._workspace: Optional[Workspace] = None
        self._seed_lock = threading.Lock()
        self._local = threading.local()    # .request: this thread's last completion
        self._last_logits: Optional[np.ndarray] = None  # the low-level eval's last row (for sample)
        self.draft_stats = DraftStatsReport(lambda: self._engine)

        given = dict(draft=draft, draft_max=draft_max, draft_p_min=draft_p_min, draft_synth_rates=draft_synth_rates,
                     draft_synth_len=draft_synth_len, context_shift=context_shift, devices=devices,
                     rpc_servers=rpc_servers, split_mode=split_mode, tensor_split=tensor_split,
                     phase_aware_workspace=phase_aware_workspace, workspace_mode=workspace_mode,
                     allow_unsafe_workspace=allow_unsafe_workspace, n_seq_max=n_seq_max, kv_unified=kv_unified,
                     ctx_checkpoints=ctx_checkpoints, checkpoint_min_step=checkpoint_min_step,
                     ctx_checkpoints_bytes=ctx_checkpoints_bytes, chat_template=chat_template,
                     fit_params=fit_params, fit_target_mib=fit_target_mib, fit_min_ctx=fit_min_ctx,
                     **_contexts.model_field_kwargs(kwargs))
        #: the options this Llama was built from (checked: a ValueError before anything is loaded)
        self.options = _options(options, given)
        _check_model_file(model_path)
        load = _Load.of(model_path, self.options, kwargs)
        self._place(load, kwargs)
        self._plan_drafting(load, kwargs)
        self._size_contexts(load, kwargs)
        self._load_contexts(load, args, kwargs)
        self._start_engine(load)
        self._attach_workspace()
        if self.options.adaptive and load.draft == "mtp":
            self._calibrate(load, t_load)
        self._chat_templates = _chat.templates_for(self, load.chat_format, kwargs.get("chat_handler"),
                                                   self.options.chat_template)
        if self._chat_templates is not None:
            self.chat_format = _chat.LAYER_FORMAT

    # the steps of __init__ -----------------------------------------------------------------

    def _place(self, load: "_Load", kwargs: dict) -> None:
        """Devices and RPC servers: the device list the model loads on (RPC servers' devices first
        by default), and what tensor split needs of them."""
        self._device_list = None
        self._rpc = _rpc.connect(self.options.rpc_servers)  # ValueError for a bad or unreachable server
        local = None
        if self._rpc and not load.devices:
            load.devices = self._rpc.default_devices()
        elif not load.devices:  # an earlier Llama's servers stay registered: keep this model off them
            local = _rpc.local_devices()
        if load.devices:
            self._device_list = _devices.DeviceList(list(load.devices))  # ValueError lists the devices
            load.model_fields["devices"] = self._device_list.pointer
            if load.n_gpu_layers is None:
                load.n_gpu_layers = "all"
        elif local is not None:
            self._device_list = _devices.DeviceList(local, allow_empty=True)
            load.model_fields["devices"] = self._device_list.pointer
        if load.split == llama_cpp.LLAMA_SPLIT_MODE_TENSOR:  # devices, flash attention, host KV, the arch
            _devices.check_tensor_split(self._device_list, kwargs)
            check_arch_tensor_split(_gguf_arch(load.model_path))
            load.flash_attn = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED

    def _plan_drafting(self, load: "_Load", kwargs: dict) -> None:
        """What drafts (the model's NextN layers, a draft model's file, the binding's draft model)
        and the longest draft the contexts are sized for."""
        draft_max = self.options.draft_max_cap
        proposer = kwargs.pop("draft_model", None)  # the binding's own (prompt lookup, ...), or a file
        if isinstance(proposer, (str, os.PathLike)):  # llama-server's -md: a draft model of its own file
            load.draft_file = _draft_file.read_draft_file(proposer)  # ValueError: no file, not a draft of ours
            proposer = None
            load.draft = load.draft or "mtp"  # the only way a file drafts here (llama-server infers it for a head too)
        load.proposer = proposer
        if load.draft == "mtp":
            if proposer is not None:
                raise ValueError("draft='mtp' and draft_model=... both give a draft model: choose one")
            if load.draft_file is not None:  # its own model, loaded beside the target's (engine.draft_file)
                _draft_file.check_pair(load.model_path, load.draft_file,
                                       tensor_split=load.split == llama_cpp.LLAMA_SPLIT_MODE_TENSOR)
                n_nextn, chained = load.draft_file.n_nextn, load.draft_file.chained_heads
            else:
                arch, n_nextn = _gguf_nextn_layers(load.model_path)
                if n_nextn < 1:
                    raise ValueError(
                        f"draft='mtp' needs a model with NextN (MTP) layers; this {arch!r} model has none "
                        f"({arch}.nextn_predict_layers is missing or 0). Use draft=None, an MTP model "
                        f"(qwen35, qwen3next, glm4-moe, deepseek2, ...), or its MTP head's file as draft_model")
                check_mtp_graph(arch)  # NextN layers without a graph (nemotron_h): refused here, not at decode
                load.model_fields["load_mtp"] = True
                chained = n_nextn > 1
            if chained:  # chained heads, one per draft step (engine.drafting): sized for as many
                draft_max = min(draft_max, n_nextn)
            check_draft_max(draft_max, min(kwargs.get("n_batch", 512), kwargs.get("n_ubatch", 512)),
                            fit="n_batch and n_ubatch")
        elif proposer is not None:
            draft_max = min(PROPOSER_MAX, kwargs.get("n_batch", 512) - 1)
        self._draft_max = draft_max if (load.draft == "mtp" or proposer is not None) else 0
        o = self.options
        load.synth_rates = _synthetic.resolve(o.draft_synth_rates, o.draft_synth_len, self._draft_max)  # ValueError

    def _size_contexts(self, load: "_Load", kwargs: dict) -> None:
        """Our context fields (n_seq_max, rollback snapshots, llama-server's output rows:
        engine.contexts), then llama.cpp's own fit of -ngl auto and -c 0 (engine.fit)."""
        o = self.options
        load.context_fields, self._draft_fields = _contexts.context_fields(
            n_seq_max=o.n_seq_max, draft_max=self._draft_max,
            n_batch=kwargs.get("n_batch", 512), logits_all=bool(kwargs.get("logits_all", False)))
        if o.kv_unified:
            load.context_fields["kv_unified"] = True
        if load.flash_attn == llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO:  # as llama.cpp decides, per device
            kwargs["flash_attn"] = False  # the binding's bool; our field is what llama.cpp gets
            load.context_fields["flash_attn_type"] = load.flash_attn
        self.fitted: Optional[_fit.Fitted] = None
        if load.fit_params:
            self.fitted = self._fit(load, kwargs)
            if self.fitted.tensor_split is not None:
                load.tensor_split = self.fitted.tensor_split
            if self.fitted.overrides is not None:  # kept alive with the instance, as the model loads
                load.model_fields["tensor_buft_overrides"] = ctypes.c_void_p(ctypes.addressof(self.fitted.overrides))
            if load.n_gpu_layers == "auto":
                load.n_gpu_layers = self.fitted.n_gpu_layers
            kwargs["n_ctx"] = self.fitted.n_ctx
        if load.n_gpu_layers is not None:  # "auto" unfitted: every layer, as llama-server's -ngl auto --fit off
            kwargs["n_gpu_layers"] = -1 if load.n_gpu_layers in ("auto", "all") else load.n_gpu_layers

    def _load_contexts(self, load: "_Load", args: tuple, kwargs: dict) -> None:
        """The binding loads the model and the target context with our fields; then the MTP draft
        context beside it."""
        # llama_cpp.Llama.__init__ assigns its default params to self.model_params / context_params
        # before it loads anything: the descriptors add our fields there, on this instance alone (no
        # other thread or instance can see them), by the names the structs declare
        self._model_fields, self._context_fields = load.model_fields, load.context_fields
        self._chat_templates = None
        super().__init__(load.model_path, *args, split_mode=load.split, tensor_split=load.tensor_split,
                         chat_format=None if load.chat_format == _chat.LAYER_FORMAT else load.chat_format, **kwargs)
        # what llama.cpp was given is what we asked for (a binding that built its params some
        # other way would otherwise lose them silently)
        check_fields(self.model_params, load.model_fields, "llama_model_params")
        check_fields(self.context_params, load.context_fields, "llama_context_params")
        # (n_rs_seq: llama.cpp clamps it to 0 for a model without recurrent rollback; the engine
        # checks it for a recurrent target, where it counts)
        n_seq_max = load.context_fields["n_seq_max"]
        if int(llama_cpp.llama_n_seq_max(self._ctx.ctx)) < n_seq_max:
            raise RuntimeError(f"the context has n_seq_max={int(llama_cpp.llama_n_seq_max(self._ctx.ctx))}, "
                               f"{n_seq_max} was asked for")
        self.draft_model = load.proposer
        if load.draft != "mtp":
            return
        # the draft context is the target's, as llama.cpp derives it: the same KV types, flash
        # attention, offload, threads and sizes; an MTP context with no rollback snapshots, whose
        # other context is the target's (a Gemma 4 assistant reads its KV cache through it)
        cp = _contexts.draft_context_params(self.context_params, self._draft_fields)
        draft_model = self._model
        if load.draft_file is not None:  # closed after the draft context (the stack is LIFO)
            draft_model = self._stack.enter_context(contextlib.closing(self._load_draft_model(load.draft_file)))
            set_fields(cp, dict(ctx_other=self._ctx.ctx))
        self._draft_ctx = self._stack.enter_context(contextlib.closing(
            _internals.LlamaContext(model=draft_model, params=cp, verbose=self.verbose)))

    def _start_engine(self, load: "_Load") -> None:
        o = self.options
        self._engine = Engine(self._ctx, self._draft_ctx, n_slots=o.n_seq_max,
                              draft_max=max(self._draft_max, 1), adaptive=o.adaptive, p_min=float(o.draft_p_min),
                              proposer=load.proposer, ctx_checkpoints=o.ctx_checkpoints,
                              checkpoint_min_step=o.checkpoint_min_step,
                              ctx_checkpoints_bytes=o.ctx_checkpoints_bytes, after_decode=self._after_decode,
                              synth_rates=load.synth_rates, context_shift=o.context_shift)
        self._stack.callback(self._engine.close)  # before the contexts go (LIFO)

    def _attach_workspace(self) -> None:
        """The phase-aware workspace the target and its MTP draft context share (none without one)."""
        o = self.options
        if self._draft_ctx is not None and o.phase_aware_workspace and o.workspace_mode != "off":
            n_decode = o.n_seq_max * (self._draft_max + 1)
            self._workspace = Workspace(self._ctx, self._draft_ctx, mode=o.workspace_mode,
                                        n_decode_tokens=n_decode, allow_unsafe=o.allow_unsafe_workspace)
            self._engine.workspace = self._workspace
            self._stack.callback(self._workspace.close)  # before the engine stops (LIFO)
        self._rpc.check(self._ctx.ctx)  # the weights reached every server

    def _calibrate(self, load: "_Load", t_load: float) -> None:
        """draft_max="auto": the costs and the acceptance the policy starts from (engine.prior)."""
        o = self.options
        head = {"draft_model": _prior.file_key(load.draft_file.path)} if load.draft_file is not None else {}
        key = _prior.cost_key(load.model_path, _prior.cost_options(self.context_params, self.model_params), dict(
            devices=list(load.devices or []), rpc=bool(self._rpc), tensor_split=list(load.tensor_split or []),
            workspace=[o.phase_aware_workspace, o.workspace_mode], **head))
        self._engine.calibrate(key, load_s=time.perf_counter() - t_load)
        self._engine.remember_acceptance(_prior.acceptance_key(load.model_path, dict(
            p_min=float(o.draft_p_min), synth_rates=list(load.synth_rates or []), **head)))

    def _load_draft_model(self, draft_file: "_draft_file.DraftFile") -> "_internals.LlamaModel":
        """The draft file's model, placed as the target is (llama-server's
        ``common_base_params_to_speculative``: the target's devices, split mode, tensor split,
        layers and key overrides), with its NextN blocks; the buffer overrides a fit wrote name
        the target's tensors and stay off."""
        mp = type(self.model_params).from_buffer_copy(self.model_params)
        set_fields(mp, dict(load_mtp=True, tensor_buft_overrides=None))
        return _internals.LlamaModel(path_model=draft_file.path, params=mp, verbose=self.verbose)

    def _fit(self, load: "_Load", kwargs: dict) -> "_fit.Fitted":
        """llama.cpp's fit (:func:`engine.fit.fit`) over the params this Llama will load with (a
        draft model's own file measured beside the target, as llama-server fits -md)."""
        n_gpu_layers = load.n_gpu_layers
        ngl = {None: 0, "auto": _fit.AUTO_LAYERS, "all": 0x7FFFFFFF, -1: 0x7FFFFFFF}.get(n_gpu_layers, n_gpu_layers)
        model = dict(load.model_fields, n_gpu_layers=ngl, split_mode=load.split, main_gpu=kwargs.get("main_gpu", 0))
        split_array = None
        if load.tensor_split:
            split_array = (ctypes.c_float * llama_cpp.LLAMA_MAX_DEVICES)(*load.tensor_split)
            model["tensor_split"] = split_array
        n_batch = kwargs.get("n_batch", 512)
        context = dict(n_ctx=kwargs.get("n_ctx", 512), n_batch=n_batch,
                       n_ubatch=min(n_batch, kwargs.get("n_ubatch", 512)), flash_attn_type=load.flash_attn,
                       offload_kqv=kwargs.get("offload_kqv", True))
        for key in ("type_k", "type_v", "swa_full", "op_offload"):
            if kwargs.get(key) is not None:
                context[key] = kwargs[key]
        context.update(load.context_fields)
        verbose = bool(kwargs.get("verbose", True))
        set_verbose(verbose)  # llama's log during the fit goes through the binding's logger
        return _fit.fit(load.model_path, model_fields=model, context_fields=context,
                        draft_fields=self._draft_fields if load.draft == "mtp" else None,
                        draft_path=load.draft_file.path if load.draft_file is not None else None,
                        target_mib=self.options.fit_target_mib, n_ctx_min=self.options.fit_min_ctx,
                        verbose=verbose)

    # the binding assigns these once, in __init__, before it loads the model / the context
    model_params = _WithOurFields("_model_fields")
    context_params = _WithOurFields("_context_fields")

    def n_ctx_slot(self) -> int:
        """The context one request has: a slot's (``n_ctx``, or ``n_ctx / n_seq_max`` without
        ``kv_unified``)."""
        return self._engine.n_ctx_seq

    @property
    def drafting(self) -> bool:
        """The engine drafts: with the MTP head (``draft="mtp"``) or a binding draft model."""
        return self._draft_max > 0

    def _after_decode(self, which: str) -> None:
        self._rpc.check(self._ctx.ctx)  # every command answered, none dropped (patch 0019)

    # ---------------------------------------------------------------------------------------
    # completions and generation: engine requests

    def create_completion(self, prompt, *args, id_slot: Optional[int] = None, cache_prompt: bool = True, **kwargs):
        """The binding's ``create_completion``, plus llama-server's request fields ``id_slot`` (run
        on that engine slot, waiting while it is busy; None or -1: any, the one holding the longest
        prefix of the prompt first) and ``cache_prompt`` (False: evaluate the whole prompt instead of
        reusing what the slot holds). Both become fields of the engine's request."""
        call = _BINDING_COMPLETION.bind(self, prompt, *args, **kwargs)  # the binding's arguments (TypeError)
        call.apply_defaults()
        arguments = {k: v for k, v in call.arguments.items() if k != "self"}
        if arguments["max_tokens"] is None:  # as the binding hands it on
            arguments["max_tokens"] = -1
        chunks = self._create_completion(**arguments, **self._request_fields(id_slot, cache_prompt))
        return chunks if arguments["stream"] else next(chunks)

    def __call__(self, prompt, *args, id_slot: Optional[int] = None, cache_prompt: bool = True, **kwargs):
        """:meth:`create_completion` (the binding's ``__call__``)."""
        return self.create_completion(prompt, *args, id_slot=id_slot, cache_prompt=cache_prompt, **kwargs)

    def create_chat_completion(self, messages=None, *args, id_slot: Optional[int] = None, cache_prompt: bool = True,
                               **kwargs):
        """The binding's call, or with ``chat_format == "llama.cpp"`` :func:`.chat_layer.create_chat_completion`;
        ``id_slot`` and ``cache_prompt`` as :meth:`create_completion` takes them."""
        fields = self._request_fields(id_slot, cache_prompt)
        if self._chat_templates is not None:
            return _chat.create_chat_completion(self, self._chat_templates, messages, *args, **fields, **kwargs)
        if fields["id_slot"] is None and fields["cache_prompt"]:
            return super().create_chat_completion(messages, *args, **kwargs)
        # the binding's chat handlers call llama.create_completion with the binding's arguments alone
        return llama_cpp.Llama.create_chat_completion(_WithRequestFields(self, fields), messages, *args, **kwargs)

    def _request_fields(self, id_slot: Optional[int], cache_prompt: bool) -> dict:
        """llama-server's ``id_slot`` (checked against the slots; -1: any, as None) and ``cache_prompt``,
        as :func:`.completion.completion` takes them."""
        n = len(self._engine.slots)
        if id_slot is not None and id_slot != -1 and (isinstance(id_slot, bool) or not isinstance(id_slot, int)
                                                      or not 0 <= id_slot < n):
            raise ValueError(f"slot {id_slot}: this model has slots 0 to {n - 1}")
        return {"id_slot": None if id_slot == -1 else id_slot, "cache_prompt": bool(cache_prompt)}

    def use_chat_templates(self, templates: "_chat.ChatTemplates") -> None:
        """Chat on these templates of llama.cpp's chat layer (the server's, from its flags)."""
        self._chat_templates, self.chat_format = templates, _chat.LAYER_FORMAT

    def _create_completion(self, *args, **kwargs):
        """The binding's completion generator, answered by the engine (:mod:`llama_metaws.api.completion`)."""
        return _completion.completion(self, *args, **kwargs)

    def _request_seed(self, seed: Optional[int]) -> int:
        """A completion's seed as the binding picks it: the one given, else the next of the
        instance's sequence (``set_seed`` sets where it goes on from)."""
        with self._seed_lock:
            seed = seed if seed is not None else random.Random(self._seed).randint(0, 2**32)
            self._seed = seed
            return seed

    def _began(self, request: Request) -> None:
        self._local.request = request

    def _ended(self, request: Request) -> None:
        pass

    def generate(self, tokens: Sequence[int], top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 typical_p: float = 1.0, temp: float = 0.80, repeat_penalty: float = 1.0, reset: bool = True,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, tfs_z: float = 1.0,
                 mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 penalize_nl: bool = True, logits_processor=None, stopping_criteria=None, grammar=None):
        """``llama_cpp.Llama.generate`` on the engine: the tokens that follow ``tokens``, one by one,
        until the generator is closed (or the context is full). A prefix of ``tokens`` that the
        engine holds is reused. Tokens sent into the generator are evaluated after the last one
        yielded, as the binding does (the request goes on as a new one over the prefix held)."""
        sampling = SamplingParams(temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p,
                                  repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                                  presence_penalty=presence_penalty, mirostat_mode=mirostat_mode,
                                  mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta,
                                  penalty_last_n=self.last_n_tokens_size, seed=self._seed, grammar=grammar,
                                  logits_processor=list(logits_processor) if logits_processor else None)
        history = [int(t) for t in tokens]
        while True:
            req = Request(history, sampling, stopping_criteria=stopping_criteria, stop_at_eog=False,
                          throttle=True)
            self._began(req)
            self._engine.submit(req)
            sent = None
            try:
                for out in req.outputs():
                    for token in out.tokens:
                        req.consumed(1)
                        sent = yield token
                        history.append(token)
                        if sent is not None:
                            break
                    if sent is not None:
                        break
            finally:
                req.cancel("closed", wait=CLOSE_WAIT_S)  # the slot is free when this returns
            if sent is None:
                return
            history.extend(int(t) for t in sent)

    # ---------------------------------------------------------------------------------------
    # the binding's single sequence: slot 0, while no request runs

    def _cut_session(self, n: int) -> None:
        """``n_tokens = n``: slot 0 holds its first ``n`` positions (fewer: cut back, or for a
        recurrent target that cannot cut there, emptied)."""
        def cut():
            slot = self._engine.slots[0]
            if n >= slot.n:
                return
            if n <= 0 or not self._engine.seq_rm(0, n):
                self._engine.clear_sequence(slot)
            else:
                slot.keep(n, slot.row(n - 1))
        self._engine.exclusive(cut)

    def reset(self):
        """Slot 0 holds nothing (the binding's ``reset``)."""
        self._requires_eval = True
        if self._engine is not None:
            self._engine.exclusive(lambda: self._engine.clear_sequence(self._engine.slots[0]))
        else:
            self.__dict__["_n_tokens"] = 0

    def eval(self, tokens: Sequence[int]):
        """Evaluate ``tokens`` after slot 0's ``n_tokens`` (the binding's ``eval``; with MTP
        drafting the draft context follows). Logits: the last row (for :meth:`sample`), every row
        into ``scores`` with ``logits_all``."""
        tokens = [int(t) for t in tokens]

        def run():
            rows = self._engine.eval_session(tokens, every_row=self._logits_all)
            n = self.n_tokens
            if self._logits_all:
                self.scores[n - len(tokens) : n, :] = rows
            self._last_logits = rows[-1].copy() if len(rows) else self._last_logits
        try:
            self._engine.exclusive(run)
        except RuntimeError:  # llama_decode failed: a lost RPC server is what to name
            self._rpc.check()
            raise
        self._requires_eval = False

    def sample(self, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
               temp: float = 0.80, repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, tfs_z: float = 1.0, mirostat_mode: int = 0,
               mirostat_eta: float = 0.1, mirostat_tau: float = 5.0, penalize_nl: bool = True,
               logits_processor=None, grammar=None, idx: Optional[int] = None):
        """A token from the last row :meth:`eval` computed (the binding's ``sample``; ``idx``: a row
        of ``scores`` with ``logits_all``)."""
        assert self.n_tokens > 0
        row = self._last_logits if idx is None or not self._logits_all else self.scores[idx]
        if row is None:
            raise RuntimeError("nothing to sample: eval() tokens first")
        sampler = self._init_sampler(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temp,
                                     repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                                     presence_penalty=presence_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                                     mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta,
                                     penalize_nl=penalize_nl, logits_processor=logits_processor, grammar=grammar)
        try:
            cur = self._candidates
            cur.copy_logits(np.asarray(row, dtype=np.single))
            llama_cpp.llama_sampler_apply(sampler.sampler, ctypes.byref(cur.candidates))
            selected = int(cur.candidates.selected)
            if not 0 <= selected < int(cur.candidates.size) or \
                    not np.isfinite(cur.candidates.data[selected].logit):
                raise GrammarError("no token is left to sample: the grammar (or a bias) rules out every one")
            token = int(cur.candidates.data[selected].id)
            _sampling.accept(sampler.sampler, token)  # what llama.cpp throws is an exception here
            return token
        finally:
            sampler.close()

    def check_grammar(self, grammar: str, root: str = "root") -> None:
        """Parse a GBNF grammar against this model's vocabulary, as llama.cpp will when it samples
        with it; :class:`~llama_metaws.errors.GrammarError` (a ``ValueError``) with llama.cpp's
        parse message when it cannot. Safe from any thread: it reads the vocabulary only."""
        _sampling.check_grammar(grammar, self._model.vocab, root)

    def _init_sampler(self, *args, grammar=None, **kwargs):
        """The binding's sampler chain (for the low-level :meth:`sample`), whose sample and accept
        cannot end the process (:class:`~llama_metaws.engine.sampling.CheckedSampler`); a grammar
        is parsed first: llama.cpp returns NULL for one that does not parse, which the binding
        would add to the chain."""
        if grammar is not None:
            self.check_grammar(grammar._grammar, grammar._root)
        return _sampling.CheckedSampler.adopt(super()._init_sampler(*args, grammar=grammar, **kwargs))

    def save_state(self) -> "llama_cpp.LlamaState":
        """The binding's state of slot 0 (the whole context); with drafting, the draft context's too."""
        return self._engine.exclusive(lambda: _state.save(self, super(Llama, self).save_state))

    def load_state(self, state: "llama_cpp.LlamaState") -> None:
        """The binding's; with drafting, a drafting Llama's state (the draft context's is restored)."""
        _state.check(self, state)
        self._engine.exclusive(lambda: _state.load(self, state))

    def _cache_lookup(self, tokens: List[int]) -> None:
        """``set_cache``: a cached state holding more of ``tokens`` than slot 0 does is loaded."""
        try:
            item = self.cache[tokens]
        except KeyError:
            return
        held = self.input_ids[: self.n_tokens].tolist()
        if llama_cpp.Llama.longest_token_prefix(item.input_ids.tolist(), tokens) > \
                llama_cpp.Llama.longest_token_prefix(held, tokens):
            self.load_state(item)

    def _cache_store(self, tokens: List[int]) -> None:
        self.cache[tokens] = self.save_state()

    # ---------------------------------------------------------------------------------------
    # llama-server's slot actions: a slot written to a file, put back, emptied (engine.slot_files)

    def _slot_call(self, fn, id_slot: int, *args):
        engine = self._engine
        if isinstance(id_slot, bool) or not isinstance(id_slot, int) or not 0 <= id_slot < len(engine.slots):
            raise ValueError(f"no slot {id_slot!r}: this model has slots 0 to {len(engine.slots) - 1}")
        slot = engine.slots[id_slot]
        return engine.exclusive(lambda: fn(engine, slot, *(str(a) for a in args)))

    def save_slot(self, id_slot: int, path) -> Tuple[int, int]:
        """Write slot ``id_slot`` (its sequence in the target and the draft context, the rows the
        draft pairs with, its checkpoints) to ``path``; (tokens saved, bytes written). Runs on the
        engine's thread once no request runs, as do :meth:`restore_slot` and :meth:`erase_slot`."""
        return self._slot_call(_slot_files.save, id_slot, path)

    def restore_slot(self, id_slot: int, path) -> Tuple[int, int]:
        """Put a slot saved by :meth:`save_slot` (from any slot of the same model, with drafting
        as here) into slot ``id_slot``; (tokens restored, bytes read). A ``ValueError`` for a file
        this model cannot take, the slot then empty."""
        return self._slot_call(_slot_files.restore, id_slot, path)

    def erase_slot(self, id_slot: int) -> int:
        """Empty slot ``id_slot``; the tokens it held."""
        return self._slot_call(_slot_files.erase, id_slot)

    # ---------------------------------------------------------------------------------------
    # what it reports

    @property
    def workspace_mode(self) -> Optional[str]:
        """The phase-aware workspace's mode (``"alias"``, ``"private-meta"``, ...), or None where
        the target and the draft do not share one (no draft context, or turned off)."""
        w = self._workspace
        return w.mode if w is not None and w.shared else None

    def workspace_stats(self):
        """Per compute buffer type: requirements, bytes allocated, generation, grows/shrinks (read
        on the engine's thread between two steps)."""
        if self._workspace is None:
            return []
        return self._engine.between_steps(self._workspace.stats)

    def checkpoint_stats(self) -> dict:
        """Prompt reuse through checkpoints, summed over the slots."""
        e = self._engine
        per = [s.checkpoints.stats() for s in e.slots]
        out = {k: sum(p[k] for p in per) for k in ("count", "bytes", "saved", "restored", "evicted", "skipped")}
        out.update(max_count=per[0]["max_count"], max_bytes=per[0]["max_bytes"],
                   positions=sorted(x for p in per for x in p["positions"]),
                   enabled=e.reuse.checkpointed and per[0]["max_count"] > 0 and per[0]["max_bytes"] > 0,
                   min_step=e.reuse.min_step)
        return out

    def engine_stats(self) -> dict:
        """The engine's steps so far, the target's and the draft's graphs (ubatches) over them, the
        most slots busy in one step, the busy slots summed over the steps, ``cost_prior``:
        draft_max="auto"'s (else None, see :meth:`engine.prior.CostPrior.describe`), and
        ``acceptance_prior``: the saved acceptance its first request started from (the file), or
        None."""
        e = self._engine
        return {"steps": e.steps, "graphs_target": e.graphs_target, "graphs_draft": e.graphs_draft,
                "slots": len(e.slots), "slots_busy_max": e.peak_busy, "busy_slot_steps": e.busy_slot_steps,
                "cost_prior": e.prior.describe() if e.prior is not None else None,
                "acceptance_prior": e.saved_acceptance.path if e.saved_acceptance is not None else None}

    def draft_lengths(self) -> dict:
        """The draft lengths the engine's steps asked for since the model loaded (0: a plain
        decode step) and how often."""
        return dict(self._engine.total.lengths)

    def slots(self) -> list:
        """Each slot's state (llama-server's ``GET /slots`` fields)."""
        return self._engine.slot_states()

    def timings(self) -> dict:
        """The figures of the completion this thread ran last (else of the request that ended last).

        ``prompt_tokens`` (the whole prompt), ``cache_n`` (of those, kept from an earlier request:
        not evaluated again), ``prompt_n`` (evaluated), ``ttft_ms`` (from the request's start on a
        slot to its first token), ``queue_ms`` (waiting for a slot), ``predicted_n`` (tokens
        sampled), and the two phases: ``prompt_ms``/``prompt_tokens_per_s``, then
        ``predicted_ms`` with ``decode_tokens`` and ``decode_tokens_per_s``. Without drafting the
        prompt phase ends with the first token (as llama-bench's pp counts it) and
        ``decode_tokens`` are the tokens after the first one; with ``draft="mtp"`` the phases are
        llama-speculative-simple's: the prompt's last token is held back and decoded with the
        first draft, so the prompt phase is the ``prompt_n - 1`` tokens before it and the decode
        phase every step after it. ``draft_n`` / ``draft_n_accepted``: the request's drafts;
        ``draft_lengths``: the draft lengths its steps asked for (0: a plain decode step) and how
        often, ``plain_steps_share`` the share of plain steps; ``shadow_drafts``: ``"auto"``'s
        scouts drafted on the side of a plain step (not verified, not in ``draft_n``)."""
        r = getattr(self._local, "request", None) or (self._engine.last if self._engine is not None else None)
        if r is None:
            return timings_of(Request([0]))
        return timings_of(r)

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Free everything; closing twice is harmless."""
        if getattr(self, "_stack", None) is None:  # __init__ raised before the binding's ran
            return
        super().close()
