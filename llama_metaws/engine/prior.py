"""``draft_max="auto"``'s cost prior: what a step costs, known before the first request.

A fresh engine that learns its costs from the steps it runs pays for it in its first requests: it
drafts to time every batch size once, from a single request of a few dozen tokens. So at load the
engine measures the curve first (:func:`calibrate`, on the engine's thread and its clock,
:func:`~.policy.engine_clock`), and the policy starts from it; what the engine measures as it
runs goes on updating it, and its explore steps are only a check.

What is timed: a target decode of ``n`` tokens, ``n`` from 1 to ``cap + 1``, at the start of an
empty sequence with every token an output row (a verification's shape; no prompt before it), the
draft context's catch-up over the same ``n`` tokens, and one draft decode over ``m`` slots (1, 2,
half and all of them). First one untimed round at the largest sizes (the compute graphs and the
workspace reach their size), then rounds of timings, the least of each size's kept: the first
round always (the one-token decode :data:`PLAIN_REPS` times in each), the others (up to
:data:`REPS`) while the time spent is under :data:`BUDGET_SHARE` of the load's (``load_s``). The token ids are spread over the vocabulary (a
mixture of experts routes them as it would routes text). The sequences used are cleared after.

The curve is saved in the user cache (:func:`costs_dir`, one JSON file per key: the model file,
the native build, the context's options, the host; :func:`cost_key`), and a later load of the same
key takes it after a check (:func:`_check`: target batches of 1 and 2 tokens, their catch-up and a
one-slot draft decode, timed again), and where one is off the saved figure by more than
:data:`DRIFT` either way the whole curve is measured again and saved. So the first load of a
model with given options pays for the whole curve (about ``(cap + 1)(cap + 2) / 2`` one-token
decodes on a CPU, where a batch costs its tokens), a later one for a few decodes.

The acceptance is kept there too (:func:`save_acceptance`, one file per model pair and draft
options, :func:`acceptance_key`; whatever the threads and the host): the per-depth estimates
(:class:`~.drafting.AdaptiveLength`) a model pair's last request left, saved as each request
that drafted (or shadow-drafted, :meth:`~.drafting.AdaptiveLength.judge`) ends. A fresh process
of the same pair starts its first request from them (:func:`read_acceptance`), as a second
request in one process does: where the head never agreed it need not probe again, and where
it always did it drafts its length from the first step. The estimates go on drifting up and
adapting to each request's content as before.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import platform
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..native.binding import llama_cpp

__all__ = ["CostPrior", "calibrate", "cost_key", "cost_options", "costs_dir", "COSTS_ENV", "DRIFT", "REPS",
           "PLAIN_REPS", "BUDGET_SHARE", "acceptance_key", "read_acceptance", "save_acceptance", "SavedAcceptance"]

#: ``LLAMA_METAWS_COSTS``: the folder of the saved curves (``off``: none read or saved)
COSTS_ENV = "LLAMA_METAWS_COSTS"
#: a checked cost off its saved figure by more than this factor, either way: measured again
DRIFT = 1.3
#: the most timed rounds (each size's least timing is kept)
REPS = 3
#: timings of the one-token decode in each round (the least kept): the plain step that every draft
#: is weighed against, and that drafting steps never time again; one timing 20% high (a CPU's
#: noise) made a draft of one token look worth it where it cost 1.9 decodes
PLAIN_REPS = 3
#: the rounds after the first run while the calibration has taken less than this share of the load
BUDGET_SHARE = 0.02
#: the saved file's layout
VERSION = 1

Curves = Tuple[Dict[int, float], Dict[int, float], Dict[int, float]]


def costs_dir() -> Optional[Path]:
    """``LLAMA_METAWS_COSTS`` (``off``: None), else ``<cache root>/costs`` (:func:`~llama_metaws.paths.cache_root`)."""
    env = os.environ.get(COSTS_ENV)
    if env:
        return None if env.strip().lower() == "off" else Path(env)
    from ..paths import cache_root

    return cache_root() / "costs"


def _build_key() -> Optional[str]:
    from ..native.runtime import current_build

    b = current_build()
    if b is None:
        return None
    shim = b.shim.parent.name if b.shim is not None else None
    return f"{b.root.name}/{shim}"


#: the context's and the model's fields that change what a decode costs (a curve's key)
CONTEXT_FIELDS = ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_threads", "n_threads_batch", "flash_attn_type",
                  "type_k", "type_v", "offload_kqv", "kv_unified", "swa_full", "n_rs_seq")
MODEL_FIELDS = ("n_gpu_layers", "split_mode", "main_gpu", "use_mmap")


def cost_options(context_params, model_params) -> dict:
    """:data:`CONTEXT_FIELDS` of ``context_params`` and :data:`MODEL_FIELDS` of ``model_params``
    (the binding's structs), as plain values."""
    out = {}
    for params, names in ((context_params, CONTEXT_FIELDS), (model_params, MODEL_FIELDS)):
        for name in names:
            value = getattr(params, name, None)
            out[name] = value if isinstance(value, (bool, int, float, str)) or value is None else repr(value)
    return out


def file_key(path: str) -> list:
    """A file as a saved figure knows it: its real path, size and modification time."""
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


def cost_key(model_path: str, context: dict, extra: Optional[dict] = None) -> dict:
    """What a saved curve belongs to: the model file (:func:`file_key`), the
    native build key, ``context`` (the options that change a decode's cost: threads, batch sizes,
    KV types, devices, ...), ``extra`` (a draft model's own file, ...) and the host (name, CPUs,
    the cores this process may use)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = None
    return dict(model=file_key(model_path), build=_build_key(),
                context=context, extra=extra or {},
                host=[platform.node(), platform.machine(), os.cpu_count(), cores])


def _key_path(folder: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return folder / f"{digest}.json"


@dataclasses.dataclass
class CostPrior:
    """The curve the policy starts from (seconds per size) and how it was had.

    ``source``: ``measured`` (nothing saved for the key), ``cache`` (the saved curve, checked),
    ``re-measured`` (the saved curve had drifted); ``seconds``: the engine's time spent at load
    (``wall_s`` on the wall clock), ``load_s``: the load's wall time before it; ``rounds``: timed
    rounds; ``check``: each checked cost's ratio to the saved one (a saved curve only)."""

    target: Dict[int, float]
    catch_up: Dict[int, float]
    draft: Dict[int, float]
    source: str = "measured"
    seconds: float = 0.0
    wall_s: float = 0.0
    load_s: Optional[float] = None
    rounds: int = 0
    check: Optional[Dict[str, Dict[int, float]]] = None
    path: Optional[str] = None

    def seed(self, costs) -> None:
        """Start ``costs`` (a :class:`~.policy.StepCosts`) from this curve."""
        costs.target.seed(self.target)
        costs.catch_up.seed(self.catch_up)
        costs.draft.seed(self.draft)

    def describe(self) -> dict:
        """The prior as ``engine_stats()["cost_prior"]`` reports it (milliseconds per size)."""
        ms = lambda d: {n: round(s * 1e3, 4) for n, s in sorted(d.items())}  # noqa: E731
        share = self.wall_s / self.load_s if self.load_s else None
        return dict(source=self.source, seconds=round(self.seconds, 4), wall_s=round(self.wall_s, 4),
                    load_s=None if self.load_s is None else round(self.load_s, 4),
                    share_of_load=None if share is None else round(share, 4), rounds=self.rounds,
                    target_ms=ms(self.target), catch_up_ms=ms(self.catch_up), draft_ms=ms(self.draft),
                    check=self.check, path=self.path)


class _Bench:
    """Timed decodes on the engine's contexts, at the start of empty sequences (cleared after)."""

    def __init__(self, engine) -> None:
        self.e = engine
        self.clock: Callable[[], float] = engine.costs.clock
        n_vocab = engine.n_vocab
        # spread over the vocabulary, never the same token twice in a row
        self.tokens = [(7919 * i + 17) % n_vocab for i in range(engine.n_batch)]

    def _clear(self, seq: int) -> None:
        for ctx in (self.e.target, self.e.draft):
            if ctx is not None:
                llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx.ctx), seq, -1, -1)

    def target(self, n: int) -> Tuple[float, float]:
        """A target decode of ``n`` tokens (each an output row) and its catch-up: their seconds."""
        e, clock = self.e, self.clock
        seq = e.slots[0].seq_id
        b = e.tbatch
        b.clear()
        b.add(self.tokens[:n], 0, seq, True)
        try:
            t0 = clock()
            e.decode_target(b, "decoding")
            llama_cpp.llama_synchronize(e.target.ctx)
            t_target = clock() - t0
            rows = e.head.target_rows(n)
            t0 = clock()
            e.head.catch_up([(seq, 0, n, None)], b.token, b.pos, rows, "decoding")
            llama_cpp.llama_synchronize(e.draft.ctx)
            t_catch = clock() - t0
        finally:
            b.clear()
            self._clear(seq)
        return t_target, t_catch

    def draft(self, m: int) -> float:
        """One draft decode over ``m`` slots (one token each): its seconds."""
        times: List[float] = []
        starts = [(s.seq_id, self.tokens[i], 0, None, 1) for i, s in enumerate(self.e.slots[:m])]
        try:
            self.e.head.propose(starts, lambda _m, seconds: times.append(seconds))
        finally:
            for s in self.e.slots[:m]:
                self._clear(s.seq_id)
        return times[0]


def _sizes(engine) -> Tuple[List[int], List[int]]:
    """The target sizes (1 to ``cap + 1``) and the draft decodes' slot counts to time."""
    n_slots = len(engine.slots)
    return (list(range(1, engine.draft_max + 2)),
            sorted({m for m in (1, 2, n_slots // 2, n_slots) if 1 <= m <= n_slots}))


def _measure(bench: _Bench, sizes: Sequence[int], slots: Sequence[int], rounds: int,
             keep_going: Callable[[], bool]) -> Tuple[Curves, int]:
    """The least of up to ``rounds`` timings of every size (the one-token one :data:`PLAIN_REPS`
    times a round; the first round always, the others while ``keep_going()``), after an untimed
    round at the largest sizes; and the rounds timed."""
    bench.target(max(sizes))
    bench.draft(max(slots))
    target: Dict[int, float] = {}
    catch_up: Dict[int, float] = {}
    draft: Dict[int, float] = {}
    done = 0
    while done < rounds and (done == 0 or keep_going()):
        for n in sizes:
            for _ in range(PLAIN_REPS if n == 1 else 1):
                t, c = bench.target(n)
                target[n] = min(t, target.get(n, t))
                catch_up[n] = min(c, catch_up.get(n, c))
        for m in slots:
            d = bench.draft(m)
            draft[m] = min(d, draft.get(m, d))
        done += 1
    return (target, catch_up, draft), done


def _check(bench: _Bench) -> Curves:
    """A saved curve's check, each size timed as :func:`_measure` times it: after an untimed
    target batch of one token and an untimed draft decode (their graphs reach their size; a first
    draft decode took 1.6x the saved figure), the least of :data:`PLAIN_REPS` timings of a
    one-token target batch and its catch-up, one of 2 tokens, and the least of as many one-slot
    draft decodes."""
    bench.target(1)
    bench.draft(1)
    ones = [bench.target(1) for _ in range(PLAIN_REPS)]
    t2, c2 = bench.target(2)
    d1 = min(bench.draft(1) for _ in range(PLAIN_REPS))
    return ({1: min(t for t, _ in ones), 2: t2}, {1: min(c for _, c in ones), 2: c2}, {1: d1})


def _read(path: Path, key: dict) -> Optional[Curves]:
    try:
        doc = json.loads(path.read_text())
        if doc.get("version") != VERSION or doc.get("key") != json.loads(json.dumps(key, default=str)):
            return None
        curves = tuple({int(n): float(s) for n, s in doc[name].items()} for name in ("target", "catch_up", "draft"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return curves if all(curves) else None  # type: ignore[return-value]


def _write(path: Path, key: dict, curves: Curves) -> None:
    doc = dict(version=VERSION, key=key, measured=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               **{name: {str(n): s for n, s in sorted(c.items())} for name, c in zip(("target", "catch_up", "draft"), curves)})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache: the next load measures again


def acceptance_key(model_path: str, draft: Optional[dict] = None) -> dict:
    """What a saved acceptance belongs to: the model file (:func:`file_key`; the MTP head is in it,
    or ``draft`` names its own file) and ``draft`` (the options that change what a draft is:
    ``p_min``, a synthetic acceptance, a draft model's file)."""
    return dict(kind="acceptance", model=file_key(model_path), draft=draft or {})


def _acceptance_path(key: dict) -> Optional[Path]:
    folder = costs_dir()
    if folder is None:
        return None
    path = _key_path(folder, key)
    return path.with_name(f"acceptance-{path.name}")


def read_acceptance(key: dict) -> Optional[Tuple[dict, str]]:
    """The acceptance state saved under ``key`` (:meth:`~.drafting.AdaptiveLength.state`) and its
    file; None where none is (or ``LLAMA_METAWS_COSTS=off``, or the file is not ours)."""
    path = _acceptance_path(key)
    if path is None or not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
        if doc.get("version") != VERSION or doc.get("key") != json.loads(json.dumps(key, default=str)):
            return None
        state = doc["state"]
        if not isinstance(state, dict):
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return state, str(path)


def save_acceptance(key: dict, state: dict) -> Optional[str]:
    """Save ``state`` under ``key`` (atomically; a read-only cache: nothing saved); its file."""
    path = _acceptance_path(key)
    if path is None:
        return None
    doc = dict(version=VERSION, key=key, saved=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               state=state)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(tmp, path)
    except OSError:
        return None
    return str(path)


class SavedAcceptance:
    """draft_max="auto": where a model pair's acceptance (the engine's ``length_prior``, an
    :class:`~.drafting.AdaptiveLength`) is kept between processes, under ``key``
    (:func:`acceptance_key`): :meth:`load` is where a fresh process's first request starts (as a
    second request in one process does), :meth:`save` runs as each request ends."""

    def __init__(self, key: dict):
        self.key = key
        self.path: Optional[str] = None  # the saved file the first request started from, if any
        self.dirty = False               # a draft (or a shadow draft) was judged since the last save

    def load(self):
        """The saved acceptance (an :class:`~.drafting.AdaptiveLength`), or None: none saved, or
        a file not ours to read (a fresh start)."""
        from .drafting import AdaptiveLength

        got = read_acceptance(self.key)
        if got is None:
            return None
        try:
            length = AdaptiveLength.from_state(got[0])
        except (KeyError, TypeError, ValueError):
            return None
        self.path = got[1]
        return length

    def save(self, length) -> None:
        """``length``'s state saved, if a draft (or a shadow draft) was judged since the last save."""
        if self.dirty and length is not None:
            self.dirty = False
            save_acceptance(self.key, length.state())


def calibrate(engine, key: Optional[dict] = None, load_s: Optional[float] = None) -> CostPrior:
    """The prior for ``engine`` (see the module docstring), on the calling thread (the engine's,
    no slot busy: the slots' sequences are cleared); ``key``: :func:`cost_key`'s (None: nothing
    read or saved). It seeds ``engine.costs``."""
    for slot in engine.slots:  # what they held would change the timings, and the timings it
        if slot.n:
            engine.clear_sequence(slot)
    bench = _Bench(engine)
    clock = bench.clock
    wall0, t0 = time.perf_counter(), clock()
    budget = BUDGET_SHARE * load_s if load_s else 0.0
    sizes, slots = _sizes(engine)
    folder = costs_dir() if key is not None else None
    path = _key_path(folder, key) if folder is not None else None
    saved = _read(path, key) if path is not None and path.exists() else None
    source, check = "measured", None
    curves: Optional[Curves] = None
    rounds = 0
    if saved is not None:
        got = _check(bench)
        check = {name: {n: round(s / saved[i][n], 3) for n, s in got[i].items() if saved[i].get(n)}
                 for i, name in enumerate(("target", "catch_up", "draft"))}
        ratios = [r for d in check.values() for r in d.values()]
        if len(ratios) == 5 and all(1 / DRIFT <= r <= DRIFT for r in ratios):
            source, curves = "cache", saved
        else:
            source = "re-measured"
    if curves is None:
        curves, rounds = _measure(bench, sizes, slots, REPS, lambda: time.perf_counter() - wall0 < budget)
        if path is not None:
            _write(path, key, curves)
    prior = CostPrior(*curves, source=source, seconds=clock() - t0, wall_s=time.perf_counter() - wall0,
                      load_s=load_s, rounds=rounds, check=check, path=str(path) if path is not None else None)
    prior.seed(engine.costs)
    return prior
