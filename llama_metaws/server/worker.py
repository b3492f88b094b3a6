"""One thread runs every request on the model, one at a time, in the order they came.

The HTTP side never touches the model: each request is a :class:`Job` handed to the
:class:`ModelWorker`'s thread, which creates, advances and closes the request's generator
itself, so a stream is never advanced or dropped on a thread other than the one that started it.
The job's results come back to the event loop through ``call_soon_threadsafe``.

Ending a request early is a flag, never a lock: the HTTP side marks the job cancelled (the client
went away, a stream was dropped) and the server's shutdown marks every job cancelled; the model
sees it after the next sampled token (a stopping criterion of every generation, see
:class:`ServedLlama`), the worker closes the generator there and then, and goes on with the next
job. Requests that wait are counted: past ``queue_size`` a new one is refused with a 503 at once.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, Callable, List, Optional

from ..llama import Llama
from .errors import Cancelled, RequestError, shutting_down


class ServedLlama(Llama):
    """Our ``Llama`` whose every completion also stops when :attr:`request_check` says so."""

    request_check: Optional[Callable[[], bool]] = None  # set by the worker around each job

    def _create_completion(self, *args, stopping_criteria=None, **kwargs):
        check = self.request_check
        if check is not None:
            from ..native.binding import llama_cpp

            ours = llama_cpp.StoppingCriteriaList([lambda input_ids, logits: check()])
            if stopping_criteria:
                ours.extend(stopping_criteria)
            stopping_criteria = ours
        return super()._create_completion(*args, stopping_criteria=stopping_criteria, **kwargs)


class Job:
    """One request: ``run(llm)`` gives a response, or an iterator of chunks when ``stream``."""

    def __init__(self, run: Callable[[Any], Any], stream: bool, loop: asyncio.AbstractEventLoop):
        self.run = run
        self.stream = stream
        self.loop = loop
        self.items: asyncio.Queue = asyncio.Queue()  # ("chunk", c) ... ("done", response) | ("error", e)
        self.cancelled: Optional[str] = None         # "client" | "shutdown"; a plain attribute
        self.sampled = False                        # the model sampled a token for this job

    def cancel(self, reason: str = "client") -> None:
        if self.cancelled is None:
            self.cancelled = reason

    def put(self, kind: str, value: Any = None) -> None:
        """From the worker's thread to the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody waits for this any more
            self.cancel("shutdown")


def _finish_reason(chunk) -> Optional[str]:
    try:
        return chunk["choices"][0].get("finish_reason")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None


class Counters:
    """What ``/metrics`` reports, updated by the worker after each request."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.prompt_seconds = 0.0
        self.tokens_predicted = 0
        self.tokens_predicted_seconds = 0.0
        self.requests = 0
        self.drafts = 0
        self.draft_tokens = 0
        self.draft_accepted = 0
        self.workspace: List = []


def response_timings(llm) -> dict:
    """llama-server's ``timings`` object for the request that just ended."""
    t = llm.timings()
    last = llm.draft_stats.last
    prompt_ms, predicted_ms = t["prompt_ms"], t["predicted_ms"]
    return {
        "cache_n": t["cache_n"],
        "prompt_n": t["prompt_n"],
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": 1e3 / t["prompt_tokens_per_s"] if t["prompt_tokens_per_s"] else 0.0,
        "prompt_per_second": t["prompt_tokens_per_s"],
        "predicted_n": t["predicted_n"],
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / t["predicted_n"] if t["predicted_n"] else 0.0,
        "predicted_per_second": (t["predicted_n"] / predicted_ms * 1e3
                                 if t["predicted_n"] and predicted_ms > 0 else 0.0),
        "draft_n": last.drafted,
        "draft_n_accepted": last.accepted,
    }


class ModelWorker:
    """The thread that owns the model (see the module docstring)."""

    def __init__(self, llm: ServedLlama, queue_size: int = 16):
        if queue_size < 0:
            raise ValueError(f"--queue-size must be >= 0, got {queue_size}")
        self.llm = llm
        self.queue_size = queue_size
        self.counters = Counters()
        self.stopping = False
        self._jobs: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running: Optional[Job] = None
        self._snapshot()
        self._thread = threading.Thread(target=self._loop, name="llama-metaws-model", daemon=True)
        self._thread.start()

    # the event loop's side ----------------------------------------------------------------

    @property
    def processing(self) -> int:
        return 1 if self._running is not None else 0

    @property
    def deferred(self) -> int:
        return self._waiting

    def submit(self, job: Job) -> None:
        """Queue a job, or refuse it (503) when the server stops or the queue is full."""
        with self._lock:
            if self.stopping:
                raise shutting_down()
            if (self._running is not None or self._waiting) and self._waiting >= self.queue_size:
                raise RequestError(503, f"the server is busy: one request runs and {self._waiting} wait "
                                   f"(--queue-size {self.queue_size}); retry later", type="server_error",
                                   code="server_busy", headers={"Retry-After": "1"})
            self._waiting += 1
        self._jobs.put(job)

    def stop(self) -> None:
        """Cancel the running job and every waiting one; refuse new ones. Only sets flags, so a
        signal handler may call it."""
        self.stopping = True
        running = self._running
        if running is not None:
            running.cancel("shutdown")

    def close(self, timeout: float) -> bool:
        """Stop, end the thread; True when it ended within ``timeout`` seconds."""
        self.stop()
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # the worker's thread --------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                self._waiting -= 1
                self._running = job
            try:
                self._run(job)
            except BaseException as e:  # noqa: BLE001 - never lose the thread, always answer
                self._end(job, "error", e)
            finally:
                self.llm.request_check = None
                with self._lock:
                    if self._running is job:
                        self._running = None

    def _end(self, job: Job, kind: str, value: Any = None) -> None:
        """The job's last item. The job stops counting as running first: a client that sends
        its next request as soon as it has this answer finds the model free."""
        with self._lock:
            if self._running is job:
                self._running = None
        job.put(kind, value)

    def _check(self, job: Job) -> bool:
        """The stopping criterion of the job's generation: True stops it."""
        job.sampled = True
        if self.stopping:
            job.cancel("shutdown")
        return job.cancelled is not None

    def _run(self, job: Job) -> None:
        if self.stopping:
            job.cancel("shutdown")
        if job.cancelled:
            self._end(job, "error", Cancelled(job.cancelled))
            return
        self.llm.request_check = lambda: self._check(job)
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
        try:
            for chunk in out:
                if job.cancelled:
                    break
                if _finish_reason(chunk) is not None or held:
                    held.append(chunk)
                else:
                    job.put("chunk", chunk)
        finally:
            close = getattr(out, "close", None)
            if close is not None:
                close()  # here, on this thread: the model is free when this returns
        timings = self._record(job)
        if job.cancelled:
            self._end(job, "error", Cancelled(job.cancelled))
            return
        if held:
            held[-1] = dict(held[-1], timings=timings)
        for chunk in held:
            job.put("chunk", chunk)
        self._end(job, "done", None)

    def _record(self, job: Job) -> Optional[dict]:
        """The request's timings, added to the counters; a fresh workspace snapshot."""
        if not job.sampled:
            return None
        t = response_timings(self.llm)
        c = self.counters
        c.requests += 1
        c.prompt_tokens += t["prompt_n"]
        c.prompt_seconds += t["prompt_ms"] / 1e3
        c.tokens_predicted += t["predicted_n"]
        c.tokens_predicted_seconds += t["predicted_ms"] / 1e3
        self._snapshot()
        return t

    def _snapshot(self) -> None:
        """Draft totals and workspace entries, read on the thread that runs the model."""
        c, total = self.counters, self.llm.draft_stats.total
        c.drafts, c.draft_tokens, c.draft_accepted = total.steps, total.drafted, total.accepted
        c.workspace = list(self.llm.workspace_stats())

