"""The model's runners: ``-np N`` requests at once on the engine, the rest waiting in order.

The HTTP side never touches the model: each request is a :class:`Job` handed to the
:class:`ModelWorker`, whose runner threads (one per engine slot, ``-np``) each take the next job
and run it through ``Llama.create_completion`` / ``create_chat_completion``: the engine steps
every running job's request together (continuous batching, llama-server's ``-cb``). A runner
creates, advances and closes its job's generator itself, so a stream is never advanced or dropped
on a thread other than the one that started it; the job's results come back to the event loop
through ``call_soon_threadsafe``.

Ending a request early is a flag, never a lock: the HTTP side marks the job cancelled (the client
went away, a stream was dropped) and the server's shutdown marks every job cancelled; a running
job's engine request is cancelled too, so its slot is free at the engine's next step, and the
runner closes the generator and takes the next job. Requests that wait are counted: past
``queue_size`` a new one is refused with a 503 at once; a waiting request cancelled by its client
stops counting at once (:meth:`ModelWorker.cancel`).

What the HTTP side needs from the worker (the request layer depends on nothing else of it):
:meth:`ModelWorker.submit` and :meth:`ModelWorker.cancel` of a :class:`Job`, whose ``items`` carry
``(job, "chunk", piece)`` (``piece``: the binding's chunk, the ids of the tokens sampled since the
last one, the job's figures), ``(job, "progress", report)`` (a job made with ``progress=True``: the
engine's :class:`~llama_metaws.engine.request.PromptProgress` once the request is on a slot and
after each batch of its prompt, handed over by the engine's thread without waiting),
``(job, "done", response)`` and ``(job, "error", exception)`` (several jobs may share one queue:
the prompts of one request), and whose ``token_ids``, ``n_decoded``, ``t_started`` and
``t_first`` tell how it went;
``processing`` and ``deferred`` (metrics); :meth:`ModelWorker.slots` (GET /slots, llama-server's
fields); ``unavailable`` (why the model cannot serve any more, or None: /health answers 503);
``counters``; ``stop`` / ``close``; and ``llm``, whose public calls the request layer uses from
other threads. A job's prompt comes tokenized (``Job.tokens``): the model's ``tokenize`` answers
from there, on the runner's thread.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from ..engine.rpc import RPCServerError
from ..api.llama import Llama
from .errors import Cancelled, RequestError, shutting_down, unavailable


class _PerThread(threading.local):
    request_check: Optional[Callable[[], bool]] = None  # set by a runner around its job
    sampled: Optional[List[int]] = None                 # the job's token ids, appended as sampled
    pretokenized: Optional[Dict[tuple, List[int]]] = None  # (text, add_bos, special) -> tokens
    on_request: Optional[Callable[[Any], None]] = None  # told the job's engine request


def _per_thread(name: str):
    return property(lambda self: getattr(self._thread_state, name),
                    lambda self, value: setattr(self._thread_state, name, value))


class ServedLlama(Llama):
    """Our ``Llama`` as the runners use it: on each runner's thread, its every completion also
    stops when :attr:`request_check` says so, records the tokens it samples in :attr:`sampled`,
    tells :attr:`on_request` its engine request, and its ``tokenize`` answers from
    :attr:`pretokenized` (the job's prompt, tokenized off the runners' threads). These are the
    runner's own (thread-local): several jobs run at once."""

    _thread_state = _PerThread()
    request_check = _per_thread("request_check")
    sampled = _per_thread("sampled")
    pretokenized = _per_thread("pretokenized")
    on_request = _per_thread("on_request")

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> List[int]:
        known = self.pretokenized
        if known is not None:
            tokens = known.get((bytes(text), bool(add_bos), bool(special)))
            if tokens is not None:
                return list(tokens)
        return super().tokenize(text, add_bos, special)

    def _create_completion(self, *args, stopping_criteria=None, **kwargs):
        check = self.request_check
        if check is not None:
            from ..native.binding import llama_cpp

            ours = llama_cpp.StoppingCriteriaList([lambda input_ids, logits: check()])
            if stopping_criteria:
                ours.extend(stopping_criteria)
            stopping_criteria = ours
        inner = super()._create_completion(*args, stopping_criteria=stopping_criteria, **kwargs)
        sink = self.sampled
        return inner if sink is None else self._recorded(inner, sink)

    def _began(self, request) -> None:
        super()._began(request)
        tell = self.on_request
        if tell is not None:
            tell(request)

    def _recorded(self, inner, sink: List[int]):
        """``inner``'s items; before each, the engine request's new token ids appended to ``sink``."""
        try:
            for item in inner:
                self._sync(sink)
                yield item
            self._sync(sink)
        finally:
            inner.close()

    def _sync(self, sink: List[int]) -> None:
        r = getattr(self._local, "request", None)
        if r is not None:
            sink.extend(r.generated[len(sink):])


class Job:
    """One request: ``run(llm)`` gives a response, or an iterator of chunks when ``stream``.

    ``tokens``: its prompt, tokenized by the request layer; ``n_prompt``: its length; ``info``:
    what GET /slots shows as its parameters; ``n_predict``: its token budget (None: unbounded)."""

    def __init__(self, run: Callable[[Any], Any], stream: bool, loop: asyncio.AbstractEventLoop, *,
                 tokens: Optional[Dict[tuple, List[int]]] = None, n_prompt: Optional[int] = None,
                 info: Optional[dict] = None, n_predict: Optional[int] = None, progress: bool = False,
                 items: Optional[asyncio.Queue] = None):
        self.run = run
        self.stream = stream
        self.loop = loop
        # (job, kind, value): ("chunk", piece) and ("progress", report) ... ("done", response) | ("error", e)
        self.items: asyncio.Queue = items if items is not None else asyncio.Queue()
        self.progress = progress                    # hand the engine's prompt progress reports over
        self.cancelled: Optional[str] = None         # "client" | "shutdown"; a plain attribute
        self.sampled = False                        # the model sampled a token for this job
        self.tokens = tokens or {}
        self.n_prompt = n_prompt
        self.info = info or {}
        self.n_predict = n_predict
        self.id = -1                                # the task id, given by submit
        self.state = "new"                          # new | waiting | dropped | running | ended
        self.token_ids: List[int] = []               # every token sampled, in order
        self.t_submitted = self.t_started = self.t_first = None
        self.has_new_line = False
        self.request = None                          # its engine request, once it runs

    @property
    def n_decoded(self) -> int:
        return len(self.token_ids)

    def cancel(self, reason: str = "client") -> None:
        if self.cancelled is None:
            self.cancelled = reason
        r = self.request
        if r is not None:  # its slot is free at the engine's next step
            r.cancel(reason)

    def put(self, kind: str, value: Any = None) -> None:
        """From the worker's thread (or the engine's, a progress report) to the event loop: never waits."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, (self, kind, value))
        except RuntimeError:  # the event loop is closed: nobody waits for this any more
            self.cancel("shutdown")


def _finish_reason(chunk) -> Optional[str]:
    try:
        return chunk["choices"][0].get("finish_reason")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None


class Counters:
    """What ``/metrics`` reports, updated by the runners after each request. N runner threads
    update it at once: every change and every read holds its lock (``+=`` on an attribute is a
    read and a write, and two threads between them lose a count)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.prompt_seconds = 0.0
        self.tokens_predicted = 0
        self.tokens_predicted_seconds = 0.0
        self.requests = 0
        self.prompt_tokens_cached = 0
        self.n_tokens_max = 0       # the most tokens one request held in its slot
        self.drafts = 0
        self.draft_tokens = 0
        self.draft_accepted = 0
        self.draft_lengths: Dict[int, int] = {}  # draft length chosen -> steps (0: plain)
        self.shadow_drafts = 0  # draft_max="auto"'s scouts drafted on the side of a plain step
        self.engine: Dict[str, int] = {}          # Llama.engine_stats()
        self.workspace: List = []

    def add_request(self, timings: dict) -> None:
        """One request that ran, with its ``timings`` (:func:`response_timings`)."""
        with self._lock:
            self.requests += 1
            self.prompt_tokens += timings["prompt_n"]
            self.prompt_tokens_cached += timings["cache_n"]
            self.n_tokens_max = max(self.n_tokens_max,
                                    timings["cache_n"] + timings["prompt_n"] + timings["predicted_n"])
            self.prompt_seconds += timings["prompt_ms"] / 1e3
            self.tokens_predicted += timings["predicted_n"]
            self.tokens_predicted_seconds += timings["predicted_ms"] / 1e3

    def set_snapshot(self, **values) -> None:
        """Replace the figures read from the model (draft totals, lengths, engine, workspace)."""
        with self._lock:
            for name, value in values.items():
                getattr(self, name)  # only declared figures
                setattr(self, name, value)

    def read(self) -> "Counters":
        """A consistent copy, for ``/metrics``."""
        copy = Counters()
        with self._lock:
            for name, value in vars(self).items():
                if name != "_lock":
                    setattr(copy, name, value)
        return copy


def response_timings(llm) -> dict:
    """llama-server's ``timings`` object for the request this thread ran last."""
    t = llm.timings()
    prompt_ms, predicted_ms, n_decode = t["prompt_ms"], t["predicted_ms"], t["decode_tokens"]
    return {
        "cache_n": t["cache_n"],
        "prompt_n": t["prompt_n"],
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": 1e3 / t["prompt_tokens_per_s"] if t["prompt_tokens_per_s"] else 0.0,
        "prompt_per_second": t["prompt_tokens_per_s"],
        "predicted_n": t["predicted_n"],
        "predicted_ms": predicted_ms,
        # over the decode phase's tokens, as llama-server rates them: without drafting the first
        # token comes from the prompt's last batch and costs no decode step
        "predicted_per_token_ms": predicted_ms / n_decode if n_decode else 0.0,
        "predicted_per_second": 1e3 / predicted_ms * n_decode if n_decode and predicted_ms > 0 else 0.0,
        "draft_n": t["draft_n"],
        "draft_n_accepted": t["draft_n_accepted"],
        "plain_steps_share": t["plain_steps_share"],
        "queue_ms": t["queue_ms"],
    }


class ModelWorker:
    """The runners that serve the model (see the module docstring): ``n_parallel`` at once
    (default: the engine's slots, ``-np``)."""

    def __init__(self, llm: ServedLlama, queue_size: int = 16, n_parallel: Optional[int] = None):
        if queue_size < 0:
            raise ValueError(f"--queue-size must be >= 0, got {queue_size}")
        self.llm = llm
        self.queue_size = queue_size
        self.n_parallel = n_parallel or len(llm.slots())
        self.counters = Counters()
        self.stopping = False
        self.unavailable: Optional[str] = None  # why the model cannot serve any more (a lost RPC server)
        self._ids = itertools.count()
        self._jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running: List[Job] = []
        self._last: Dict[int, Job] = {}      # engine slot -> the job that ran there last
        self._snapshot()
        self._threads = [threading.Thread(target=self._loop, name=f"llama-metaws-runner-{i}", daemon=True)
                         for i in range(self.n_parallel)]
        for th in self._threads:
            th.start()

    # the event loop's side ----------------------------------------------------------------

    @property
    def processing(self) -> int:
        return len(self._running)

    @property
    def deferred(self) -> int:
        return self._waiting

    def submit(self, job: Job) -> None:
        """Queue a job, or refuse it (503) when the server stops, cannot serve, or the queue is full."""
        with self._lock:
            if self.stopping:
                raise shutting_down()
            if self.unavailable is not None:
                raise unavailable(self.unavailable)
            if len(self._running) + self._waiting >= self.n_parallel + self.queue_size:
                raise RequestError(503, f"the server is busy: {len(self._running)} requests run and {self._waiting} "
                                   f"wait (-np {self.n_parallel}, --queue-size {self.queue_size}); retry later",
                                   type="server_error", code="server_busy", headers={"Retry-After": "1"})
            self._waiting += 1
            job.state = "waiting"
            job.id = next(self._ids)
            job.t_submitted = time.perf_counter()
        self._jobs.put(job)

    def cancel(self, job: Job, reason: str = "client") -> None:
        """Cancel a job: a waiting one gives its place in the queue back at once, a running one's
        slot is free at the engine's next step."""
        job.cancel(reason)
        with self._lock:
            if job.state == "waiting":
                job.state = "dropped"
                self._waiting -= 1

    def slots(self) -> List[dict]:
        """GET /slots in llama-server's fields (but ``n_ctx``, the request layer's): one per engine
        slot, with the job that runs there (or ran there last)."""
        out = []
        by_slot = {}
        with self._lock:
            for job in self._running:
                if job.request is not None and job.request.slot is not None:
                    by_slot[job.request.slot] = job
            last = dict(self._last)
        for state in self.llm.slots():
            sid = state["id"]
            job = by_slot.get(sid) or last.get(sid)
            slot = {"id": sid, "id_task": -1, "speculative": bool(self.llm.drafting),
                    "is_processing": state["is_processing"], "state": state["state"], "n_past": state["n_past"]}
            if job is not None:
                running = job.state == "running" and state["is_processing"]
                remain = -1 if job.n_predict is None else max(job.n_predict - job.n_decoded, 0)
                # an idle slot keeps its last task's id and parameters, not its budget (llama-server)
                slot.update({
                    "id_task": job.id, "n_prompt_tokens": job.n_prompt, "params": dict(job.info),
                    "next_token": [{"has_next_token": running, "has_new_line": job.has_new_line and running,
                                    "n_remain": remain if running else -1,
                                    "n_decoded": job.n_decoded if running else 0}],
                })
            out.append(slot)
        return out

    def stop(self) -> None:
        """Cancel the running jobs and every waiting one; refuse new ones. Only sets flags, so a
        signal handler may call it."""
        self.stopping = True
        for job in list(self._running):
            job.cancel("shutdown")

    def close(self, timeout: float) -> bool:
        """Stop, end the runners; True when they ended within ``timeout`` seconds."""
        self.stop()
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for th in self._threads:
            th.join(max(0.0, deadline - time.monotonic()))
        return not any(th.is_alive() for th in self._threads)

    # a runner's thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                if job.state == "dropped":  # cancelled while it waited: its place is given back
                    job.state = "ended"
                    job.put("error", Cancelled(job.cancelled or "client"))
                    continue
                self._waiting -= 1
                self._running.append(job)
                job.state = "running"
            try:
                self._run(job)
            except BaseException as e:  # noqa: BLE001 - never lose the thread, always answer
                if isinstance(e, RPCServerError):  # the model's memory is gone with the server
                    self.unavailable = str(e)
                self._end(job, "error", e)
            finally:
                job.state = "ended"
                self.llm.request_check = self.llm.on_request = None
                self.llm.sampled = self.llm.pretokenized = None
                with self._lock:
                    if job in self._running:
                        self._running.remove(job)
                    if job.request is not None and job.request.slot is not None:
                        self._last[job.request.slot] = job

    def _end(self, job: Job, kind: str, value: Any = None) -> None:
        """The job's last item. The job stops counting as running first: a client that sends
        its next request as soon as it has this answer finds its place free, and its slot's
        last job in ``GET /slots`` (the answer may reach the client before the runner is done)."""
        with self._lock:
            if job in self._running:
                self._running.remove(job)
            if job.request is not None and job.request.slot is not None:
                self._last[job.request.slot] = job
        job.put(kind, value)

    def _check(self, job: Job) -> bool:
        """The stopping criterion of the job's generation: True stops it."""
        if not job.sampled:  # the first token: the prompt is done
            job.sampled = True
            job.t_first = time.perf_counter()
        if self.stopping:
            job.cancel("shutdown")
        return job.cancelled is not None

    def _piece(self, job: Job, chunk, sent: int) -> dict:
        """A stream's item: the binding's chunk, the tokens sampled since the last one, figures."""
        try:
            choice = chunk["choices"][0]
            text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        except (KeyError, IndexError, TypeError, AttributeError):
            text = ""
        if "\n" in text:
            job.has_new_line = True
        return {"chunk": chunk, "tokens": job.token_ids[sent:], "n_decoded": job.n_decoded,
                "t_started": job.t_started, "t_first": job.t_first, "t": time.perf_counter()}

    def _run(self, job: Job) -> None:
        if self.stopping:
            job.cancel("shutdown")
        if job.cancelled:
            self._end(job, "error", Cancelled(job.cancelled))
            return
        job.t_started = time.perf_counter()
        self.llm.request_check = lambda: self._check(job)
        self.llm.sampled, self.llm.pretokenized = job.token_ids, job.tokens

        def began(request):
            job.request = request
            if job.progress:
                request.on_progress = lambda report: job.put("progress", report)
            if job.cancelled:  # cancelled just before: the request ends at once
                request.cancel(job.cancelled)

        self.llm.on_request = began
        out = job.run(self.llm)
        if not job.stream:
            timings = self._record(job)
            if job.cancelled:
                self._end(job, "error", Cancelled(job.cancelled))
                return
            out["timings"] = timings
            self._end(job, "done", out)
            return
        held = []  # the last chunk(s), with the finish reason: they carry the timings
        sent = 0
        try:
            for chunk in out:
                if job.cancelled:
                    break
                piece = self._piece(job, chunk, sent)
                sent = job.n_decoded
                if _finish_reason(chunk) is not None or held:
                    held.append(piece)
                else:
                    job.put("chunk", piece)
        finally:
            close = getattr(out, "close", None)
            if close is not None:
                close()  # here, on this thread: the model is free when this returns
        timings = self._record(job)
        if job.cancelled:
            self._end(job, "error", Cancelled(job.cancelled))
            return
        if held:
            held[-1]["chunk"] = dict(held[-1]["chunk"], timings=timings)
            held[-1]["tokens"] = held[-1]["tokens"] + job.token_ids[sent:]
        for piece in held:
            job.put("chunk", piece)
        self._end(job, "done", None)

    def _record(self, job: Job) -> Optional[dict]:
        """The request's timings, added to the counters; a fresh workspace snapshot."""
        if not job.sampled:
            return None
        t = response_timings(self.llm)
        self.counters.add_request(t)
        self._snapshot()
        return t

    def _snapshot(self) -> None:
        """Draft totals, the draft lengths chosen and workspace entries (read on the engine's
        thread between two steps)."""
        total = self.llm.draft_stats.total
        self.counters.set_snapshot(drafts=total.steps, draft_tokens=total.drafted, draft_accepted=total.accepted,
                                   shadow_drafts=total.shadows,
                                   draft_lengths=dict(self.llm.draft_lengths()), engine=self.llm.engine_stats(),
                                   workspace=list(self.llm.workspace_stats()))

