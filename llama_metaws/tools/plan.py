"""The memory planner: what a model needs per device, and what the workspace and the alias save.

``plan(model="x.gguf", ...)`` or ``plan(hf_config="config.json", ...)`` asks llama.cpp itself,
without loading a weight: the model is created with ``llama_model_params.no_alloc`` (metadata
only, as llama.cpp's own ``llama_params_fit`` does), on CPU devices standing in for the GPUs
(the CPU device listed N times, as our CPU tensor-split test bed does), and the target and MTP
draft contexts are created on it. Each context's scheduler reserves its graphs without
allocating and reports the bytes it would allocate per buffer type
(``llama_get_memory_breakdown``, through the shim's ``lmws_memory_breakdown``); those are
exactly the sizes a loaded model on the same devices allocates (``tests/test_plan.py`` checks
them byte for byte against the vram harness).

What the modes hold per device, from those per-buffer-type figures (``t`` the target's, ``d``
the draft's compute):

- ``off``: ``t + d`` (two private schedulers);
- ``alias``: ``max(t, d)`` for every buffer type: one shared entry per buffer type, sized by
  ggml-alloc (patch 0002) to the larger published requirement;
- ``private-meta``: like ``alias``, but a meta buffer type (tensor split) stays private: ``t + d``.

A meta compute buffer allocates its size on every device of the meta device, so under tensor
split each device holds the meta figure. A Hugging Face ``config.json`` is first written as a
GGUF header (metadata and tensor infos, no data: a sparse file) with the tensor names and
shapes llama.cpp's loader expects; see :func:`write_gguf_from_hf_config`.

Limits of the CPU stand-in (they are stated in each plan's ``notes``): the graph is the CPU
backend's, not CUDA's (a CUDA build may place or fuse ops differently, and CUDA graphs and
cuBLAS workspaces are outside ggml's accounting); under layer split the stand-in devices share
one buffer type, so their compute is one buffer (plan on the real devices to see it per
device); under tensor split the weights and KV per device are llama.cpp's totals for the meta buffer
type shared out by ``tensor_split`` (an estimate: mirrored tensors and head granularity are not
modelled), the recurrent state (allocated for real even under ``no_alloc``) is its largest
per-device slice, and compute per device is exact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

from ..errors import PlanError
from ..engine.limits import AUTO_DRAFT_MAX
from ..cli.flags import draft_max_value
from .hf_config import WEIGHT_TYPES, write_gguf_from_hf_config
from ..engine.gguf_meta import architecture
from ..native.archs import check_mtp_graph, check_tensor_split
from ..native.params import set_fields
from .vram.probe import device_keys

__all__ = ["Plan", "DevicePlan", "PlanError", "plan", "format_plan", "write_gguf_from_hf_config",
           "CACHE_TYPES", "WEIGHT_TYPES"]

MiB = 2**20

#: -ctk / -ctv values (llama.cpp's names)
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


@dataclasses.dataclass
class DevicePlan:
    """Bytes on one device (or on the host, ``name == "CPU"`` under tensor split)."""

    name: str
    weights: int
    kv: int
    recurrent: int
    target_compute: int
    draft_compute: int
    compute: Dict[str, int]  # "off", "private-meta", "alias"

    def to_dict(self) -> dict:
        return {"name": self.name, "weights": self.weights, "kv": self.kv, "recurrent": self.recurrent,
                "target_compute": self.target_compute, "draft_compute": self.draft_compute,
                "compute": dict(self.compute)}


@dataclasses.dataclass
class Plan:
    devices: List[DevicePlan]
    model: dict
    params: dict
    buffer_types: List[dict]
    notes: List[str]

    def to_dict(self) -> dict:
        return {"devices": [d.to_dict() for d in self.devices], "model": dict(self.model),
                "params": dict(self.params), "buffer_types": [dict(b) for b in self.buffer_types],
                "notes": list(self.notes)}

    def device(self, name: str) -> DevicePlan:
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(f"no device {name!r} in the plan: {', '.join(d.name for d in self.devices)}")


# --------------------------------------------------------------------------------------------
# config.json -> GGUF header


# --------------------------------------------------------------------------------------------
# llama.cpp's figures


def memory_breakdown(ctx) -> Dict[int, dict]:
    """buft address -> {name, meta, host, device, model, context, compute} for one context:
    llama.cpp's memory breakdown (ggml's accounting of the buffers) per buffer type."""
    from ..native.shim import check_error, ffi, lib
    from ..engine.buffers import compute_buffers, context_address

    c = ffi.cast("struct llama_context *", context_address(ctx))
    n = ffi.new("int *")
    check_error(lib.lmws_memory_breakdown(c, ffi.NULL, 0, n))
    out = ffi.new("struct lmws_memory_entry[]", max(n[0], 1))
    check_error(lib.lmws_memory_breakdown(c, out, n[0], n))
    backends: Dict[int, int] = {}
    for b in compute_buffers(ctx):
        backends[b.buft] = backends.get(b.buft, 0) + 1
    res = {}
    for i in range(n[0]):
        e = out[i]
        key = int(ffi.cast("uintptr_t", e.buft))
        dev = lib.ggml_backend_buft_get_device(e.buft)
        dev_name = ffi.string(lib.ggml_backend_dev_name(dev)).decode() if dev != ffi.NULL else ""
        name = ffi.string(lib.ggml_backend_buft_name(e.buft)).decode()
        # llama.cpp adds the size once per scheduler backend; backends of one buffer type share
        # one allocator and one buffer (ggml_gallocr_get_buffer_size counts it once)
        k = max(backends.get(key, 1), 1)
        host = bool(lib.ggml_backend_buft_is_host(e.buft))  # the meta device's host buffer type too (-nkvo)
        res[key] = dict(name=name, meta=not host and (dev_name.startswith("Meta") or name.startswith("Meta")),
                        host=host, device=dev_name,
                        model=int(e.model), context=int(e.context), compute=int(e.compute) // k)
    return res


def _cache_type(name: str, flag: str) -> int:
    import gguf

    if name.lower() not in CACHE_TYPES:
        raise PlanError(f"{flag} {name!r} is not one of {', '.join(CACHE_TYPES)}")
    return int(gguf.GGMLQuantizationType[name.upper()])


def plan(model: Optional[Union[str, os.PathLike]] = None, *, hf_config=None, devices: Union[int, Sequence[str]] = 1,
         split_mode: str = "layer", tensor_split: Optional[Sequence[float]] = None, n_ctx: int = 4096,
         n_batch: int = 2048, n_ubatch: int = 512, n_seq_max: int = 1, mtp: bool = True, draft_max: int = 3,
         flash_attn: str = "auto", no_kv_offload: bool = False, cache_type_k: str = "f16",
         cache_type_v: str = "f16", weight_type: str = "q4_k", n_outputs_max: Optional[int] = None,
         verbose: bool = False) -> Plan:
    """Plan the memory of ``model`` (a GGUF: only its header is read) or of ``hf_config``.

    ``devices``: a count (that many CPU stand-ins, named ``CPU0``, ``CPU1``, ...) or names
    (``["CUDA0", "CUDA1"]``): names of devices present here are planned on those devices;
    otherwise CPU stand-ins carry the names. The contexts are made as
    :class:`llama_metaws.Llama` makes them: the target with ``n_rs_seq = draft_max`` when
    drafting (a recurrent target rolls back rejected drafts), flash attention forced on under
    tensor split; the MTP draft with llama.cpp's default context parameters otherwise; both
    with llama-server's output rows (:func:`llama_metaws.engine.limits.output_limits`: the target
    ``n_seq_max x (1 + draft_max)``, the draft ``n_seq_max``), which ``n_outputs_max`` overrides for
    both (llama.cpp's field; 0: every row of a batch, llama.cpp's default).
    ``mtp=False`` plans the target alone (every mode then holds the target's compute).
    """
    import llama_metaws  # noqa: F401  (the patched build first)

    from ..native.binding import llama_cpp
    from ..engine.devices import list_devices
    from ..engine.contexts import split_mode_value

    if (model is None) == (hf_config is None):
        raise PlanError("plan: give exactly one of model (a GGUF file) and hf_config (a config.json)")
    for name, value in (("n_ctx (-c)", n_ctx), ("n_batch (-b)", n_batch), ("n_ubatch (-ub)", n_ubatch),
                        ("n_seq_max (-np)", n_seq_max), ("draft_max", draft_max)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"plan: {name} must be an integer >= 1, got {value!r}")
    if n_outputs_max is not None and (isinstance(n_outputs_max, bool) or not isinstance(n_outputs_max, int)
                                      or n_outputs_max < 0):
        raise PlanError(f"plan: n_outputs_max (--n-outputs-max) must be an integer >= 0, got {n_outputs_max!r}")
    if flash_attn not in ("auto", "on", "off"):
        raise PlanError(f"plan: flash_attn (-fa) {flash_attn!r} is not one of auto, on, off")
    type_k, type_v = _cache_type(cache_type_k, "-ctk"), _cache_type(cache_type_v, "-ctv")
    split = split_mode_value(split_mode)
    here = {d.name for d in list_devices()}
    if isinstance(devices, int):
        if devices < 1:
            raise PlanError(f"plan: --devices {devices}: give at least 1")
        labels, names = device_keys(["CPU"] * devices), ["CPU"] * devices
        stand_in = True
    else:
        labels = device_keys(list(devices))
        stand_in = not all(d in here for d in devices)
        names = ["CPU"] * len(labels) if stand_in else list(devices)
    if split == llama_cpp.LLAMA_SPLIT_MODE_TENSOR and len(names) < 2:
        raise PlanError("plan: -sm tensor splits every tensor over several devices: give --devices 2 or more")
    if tensor_split is not None and len(tensor_split) != len(names):
        raise PlanError(f"plan: -ts has {len(tensor_split)} values for {len(names)} devices")
    if tensor_split is not None and (any(x < 0 for x in tensor_split) or sum(tensor_split) <= 0):
        raise PlanError("plan: -ts values must be >= 0 and not all 0")

    notes: List[str] = []
    with tempfile.TemporaryDirectory(prefix="llama-metaws-plan-") as tmp:
        if hf_config is not None:
            path = write_gguf_from_hf_config(hf_config, Path(tmp) / "config.gguf", weight_type=weight_type)
            notes.append(f"weights: the config.json written as a GGUF header with {weight_type} matrices "
                         "(f32 norms and small SSM tensors); a real quantization mixes types")
        else:
            path = Path(model)
            if not path.is_file():
                raise PlanError(f"plan: no model file {path}")
        from ..native.binding import set_verbose

        set_verbose(verbose)
        result = _plan_file(path, names, labels, split, tensor_split, n_ctx, n_batch, n_ubatch, n_seq_max,
                            mtp, draft_max, flash_attn, no_kv_offload, type_k, type_v, n_outputs_max, verbose, notes)
    if stand_in:
        notes.append("devices: CPU stand-ins (the CPU device listed once per device): the graph is the CPU "
                     "backend's; a CUDA build may place or fuse ops differently, and CUDA graphs, cuBLAS "
                     "workspaces and the CUDA context are outside ggml's accounting")
        if split != llama_cpp.LLAMA_SPLIT_MODE_TENSOR and len(names) > 1:
            notes.append("layer split on CPU stand-ins: the devices share one buffer type, so their compute is "
                         "one buffer (row CPU); plan on the real devices for the per-device split")
    result.params.update(devices=list(labels), stand_in=stand_in, source=os.fspath(model) if model is not None else
                         (os.fspath(hf_config) if not isinstance(hf_config, dict) else "config (dict)"))
    return result


def _plan_file(path, names, labels, split, tensor_split, n_ctx, n_batch, n_ubatch, n_seq_max, mtp, draft_max,
               flash_attn, no_kv_offload, type_k, type_v, n_outputs_max, verbose, notes) -> Plan:
    import ctypes

    from ..native.binding import llama_cpp
    from ..engine.contexts import context_fields, draft_context_params
    from ..engine.devices import DeviceList

    arch = architecture(os.fspath(path))  # refused before llama.cpp reads the file
    try:
        if split == llama_cpp.LLAMA_SPLIT_MODE_TENSOR:
            check_tensor_split(arch)
        if mtp and arch is not None:
            check_mtp_graph(arch)
    except ValueError as e:
        raise PlanError(f"plan: {e}") from None
    mp = llama_cpp.llama_model_default_params()
    device_list = DeviceList(names)
    # no_alloc: metadata only, the allocators report sizes and allocate nothing
    fields = dict(no_alloc=True, load_mode=llama_cpp.LLAMA_LOAD_MODE_NONE, load_mtp=bool(mtp), split_mode=split,
                  devices=device_list.pointer, n_gpu_layers=999)
    ts = None
    if tensor_split:
        ts = (ctypes.c_float * llama_cpp.LLAMA_MAX_DEVICES)(*tensor_split)
        fields["tensor_split"] = ts
    set_fields(mp, fields)
    model = llama_cpp.llama_model_load_from_file(os.fspath(path).encode(), mp)
    if not model:
        raise PlanError(f"plan: llama.cpp could not load {path} (run with verbose=True / -v for its log)")
    tensor = split == llama_cpp.LLAMA_SPLIT_MODE_TENSOR
    fa = {"auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
          "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}[flash_attn]
    contexts = []
    try:
        n_nextn = int(llama_cpp.llama_model_n_layer_nextn(model))
        if mtp and n_nextn == 0:
            raise PlanError(f"plan: --spec-type draft-mtp needs NextN (MTP) layers; {path} has none")
        n_b = min(n_batch, n_ctx)

        # as Llama derives them (engine.contexts.context_fields): n_seq_max, rollback snapshots,
        # llama-server's output rows; the draft from a copy of the target's params
        ours, draft_fields = context_fields(n_seq_max=n_seq_max, draft_max=draft_max if mtp else 0, n_batch=n_b,
                                            n_outputs_max=n_outputs_max)

        def target_params(ctx_size: int):
            cp = llama_cpp.llama_context_default_params()
            set_fields(cp, dict(ours, n_ctx=ctx_size, n_batch=n_b, n_ubatch=min(n_ubatch, n_b),
                                type_k=type_k, type_v=type_v, offload_kqv=not no_kv_offload,
                                flash_attn_type=llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if tensor else fa))
            return cp

        def draft_params(target_cp):
            return draft_context_params(target_cp, draft_fields)

        def make(cp):
            ctx = llama_cpp.llama_init_from_model(model, cp)
            if not ctx:
                raise PlanError("plan: llama.cpp could not create the context (run with -v for its log)")
            contexts.append(ctx)
            return ctx

        tcp = target_params(n_ctx)
        target = make(tcp)
        t = memory_breakdown(target)
        real_ctx = int(llama_cpp.llama_n_ctx(target))
        d = {}
        if mtp:
            d = memory_breakdown(make(draft_params(tcp)))
        # KV cells scale with n_ctx, the recurrent state does not: a second target context of
        # twice the cells separates them (llama.cpp reports both as the context's memory; with
        # no_alloc the KV costs nothing, the recurrent state is allocated for real)
        llama_cpp.llama_free(contexts.pop(0))
        recurrent: Dict[int, int] = {}
        big_ctx = make(target_params(2 * real_ctx))
        big = memory_breakdown(big_ctx)
        n_big = int(llama_cpp.llama_n_ctx(big_ctx))
        for key, e in t.items():
            per_cell = (big.get(key, {}).get("context", 0) - e["context"]) / (n_big - real_ctx)
            recurrent[key] = max(0, int(round(e["context"] - per_cell * real_ctx)))
        model_size = int(llama_cpp.llama_model_size(model))
        n_params = int(llama_cpp.llama_model_n_params(model))
    finally:
        for c in contexts:
            llama_cpp.llama_free(c)
        llama_cpp.llama_model_free(model)

    shares = list(tensor_split) if tensor_split else [1.0] * len(names)
    shares = [x / sum(shares) for x in shares]
    rows: Dict[str, DevicePlan] = {}
    order: List[str] = []

    def row(name: str) -> DevicePlan:
        if name not in rows:
            rows[name] = DevicePlan(name, 0, 0, 0, 0, 0, {"off": 0, "private-meta": 0, "alias": 0})
            order.append(name)
        return rows[name]

    buffer_types = []
    for key in list(t) + [k for k in d if k not in t]:
        te, de = t.get(key), d.get(key)
        e = te or de
        tc, dc = (te or {}).get("compute", 0), (de or {}).get("compute", 0)
        weights = (te or de)["model"]
        ctx_bytes = (te or {}).get("context", 0) + (de or {}).get("context", 0)
        rec = recurrent.get(key, 0)
        kv = ctx_bytes - rec
        held = {"off": tc + dc, "alias": max(tc, dc), "private-meta": tc + dc if e["meta"] else max(tc, dc)}
        buffer_types.append(dict(name=e["name"], device=e["device"], meta=e["meta"], weights=weights, kv=kv,
                                 recurrent=rec, target_compute=tc, draft_compute=dc, compute=held))
        if e["meta"]:
            targets = [(label, share) for label, share in zip(labels, shares)]
            for label, share in targets:
                r = row(label)
                r.weights += int(round(weights * share))
                r.kv += int(round(kv * share))
                r.recurrent += rec  # a real meta buffer: llama.cpp reports its largest device slice
                r.target_compute += tc
                r.draft_compute += dc
                for m in held:
                    r.compute[m] += held[m]  # a meta compute buffer holds its size on every device
        else:
            if e["device"] in labels and e["device"] != "CPU":
                name = e["device"]
            else:
                name = "CPU"  # the host, and every CPU stand-in outside a meta device
            r = row(name)
            r.weights += weights
            r.kv += kv
            r.recurrent += rec
            r.target_compute += tc
            r.draft_compute += dc
            for m in held:
                r.compute[m] += held[m]
    if tensor:
        notes.append("tensor split: weights and KV per device are llama.cpp's meta totals shared out by -ts (an "
                     "estimate); the recurrent state is allocated even under no_alloc and llama.cpp reports its "
                     "largest per-device slice; compute per device is llama.cpp's own figure")
    devices = [rows[n] for n in order if n != "CPU"] + ([rows["CPU"]] if "CPU" in rows else [])
    return Plan(devices=devices, model=dict(path=os.fspath(path), size=model_size, n_params=n_params,
                                            n_ctx=real_ctx, mtp=bool(mtp)),
                params=dict(split_mode=split, tensor_split=list(tensor_split) if tensor_split else None,
                            n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max,
                            draft_max=draft_max, flash_attn=flash_attn, no_kv_offload=no_kv_offload,
                            n_outputs_max=ours["n_outputs_max"], draft_n_outputs_max=draft_fields["n_outputs_max"] if mtp else None),
                buffer_types=buffer_types, notes=notes)


# --------------------------------------------------------------------------------------------
# the table


def _mib(b: int) -> str:
    return f"{b / MiB:,.1f}"


def format_plan(p: Plan) -> str:
    """One row per device (MiB): weights, KV, recurrent, each context's compute, each mode's total."""
    head = ["device", "weights", "KV", "recurrent", "target compute", "draft compute",
            "compute off", "compute private-meta", "compute alias", "total alias", "alias saves vs private-meta"]
    rows = []
    for d in p.devices:
        base = d.weights + d.kv + d.recurrent
        rows.append([d.name, _mib(d.weights), _mib(d.kv), _mib(d.recurrent), _mib(d.target_compute),
                     _mib(d.draft_compute), _mib(d.compute["off"]), _mib(d.compute["private-meta"]),
                     _mib(d.compute["alias"]), _mib(base + d.compute["alias"]),
                     _mib(d.compute["private-meta"] - d.compute["alias"])])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    out = [f"model: {p.model['path']} ({p.model['size'] / MiB:,.1f} MiB of weights, "
           f"{p.model['n_params'] / 1e9:.2f} B parameters), n_ctx {p.model['n_ctx']}", "MiB per device:",
           line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    out += [f"note: {n}" for n in p.notes]
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# the command


def add_arguments(p):
    """``llama-metaws plan``'s flags (llama.cpp's names)."""
    from ..cli.flags import parse_floats

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-m", "--model", help="GGUF model file (only its header is read)")
    src.add_argument("--hf-config", metavar="FILE", help="a Hugging Face config.json: Qwen3.5/3.6/3.8 dense "
                     "and MoE, GLM-4.5, GLM-4.7-Flash, DeepSeek-V3.2, MiMo-V2/V2.5, Step-3.5, Nemotron-H MoE "
                     "(examples: bench/configs/)")
    p.add_argument("--devices", "-dev", "--device", dest="devices", default="1",
                   help="a count of CPU stand-ins (e.g. 2) or comma-separated names (e.g. CUDA0,CUDA1: "
                   "planned on them when present, else on CPU stand-ins carrying the names); default 1")
    p.add_argument("-sm", "--split-mode", default="layer", choices=["none", "layer", "row", "tensor"])
    p.add_argument("-ts", "--tensor-split", type=parse_floats, help="fractions per device, e.g. 0.55,0.45")
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("-b", "--batch-size", type=int, default=2048)
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    p.add_argument("-np", "--parallel", type=int, default=1, help="sequences (n_seq_max)")
    p.add_argument("--spec-type", default="draft-mtp", choices=["none", "draft-mtp"],
                   help="draft-mtp (default): plan the MTP draft context too")
    p.add_argument("--draft-max", type=draft_max_value, default=3,
                   help=f"recurrent rollback rows of the target (n_rs_seq); auto: {AUTO_DRAFT_MAX}")
    p.add_argument("--n-outputs-max", type=int, default=None, metavar="N",
                   help="output rows each context reserves (llama.cpp's n_outputs_max; 0: every row of a batch, "
                   "llama.cpp's default); default llama-server's: the target -np x (1 + --draft-max) (-np "
                   "without drafting), the MTP draft -np")
    p.add_argument("-fa", "--flash-attn", default="auto", choices=["auto", "on", "off"],
                   help="the target's flash attention (forced on under tensor split)")
    p.add_argument("-nkvo", "--no-kv-offload", action="store_true", help="KV cache in host memory")
    p.add_argument("-ctk", "--cache-type-k", default="f16", choices=CACHE_TYPES)
    p.add_argument("-ctv", "--cache-type-v", default="f16", choices=CACHE_TYPES)
    p.add_argument("--weight-type", default="q4_k", choices=WEIGHT_TYPES,
                   help="matrix type for a model written from --hf-config (default q4_k)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (bytes)")
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")
    return p


def run_from_args(args) -> int:
    import sys

    text = args.devices.strip()
    devices: Union[int, List[str]] = int(text) if text.isdigit() else [d.strip() for d in text.split(",") if d.strip()]
    try:
        p = plan(args.model, hf_config=args.hf_config, devices=devices, split_mode=args.split_mode,
                 tensor_split=args.tensor_split, n_ctx=args.ctx_size, n_batch=args.batch_size,
                 n_ubatch=args.ubatch_size, n_seq_max=args.parallel, mtp=args.spec_type == "draft-mtp",
                 draft_max=AUTO_DRAFT_MAX if args.draft_max == "auto" else args.draft_max, flash_attn=args.flash_attn, no_kv_offload=args.no_kv_offload,
                 cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
                 weight_type=args.weight_type, n_outputs_max=args.n_outputs_max, verbose=args.verbose)
    except ValueError as e:
        print(f"llama-metaws plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(p.to_dict(), indent=1) if args.json else format_plan(p))
    return 0
