"""``RequestGuard``: one request at a time on a ``Llama``, whichever threads run it."""

from __future__ import annotations

import contextlib
import threading
from typing import Optional

__all__ = ["RequestGuard"]


class RequestGuard:
    """One request at a time on an instance, whichever threads run it.

    A plain ``threading.Lock``, owned by no thread: a request takes it when it starts and gives
    it back when it ends, on whatever thread that happens (a server advances a stream on any
    free worker thread, and a dropped stream is closed or garbage-collected on any thread). The
    ticket :meth:`acquire` returns is the request's; :meth:`release` with a stale ticket does
    nothing, so a request cannot free another's hold. While a thread runs a step of the request
    (:meth:`running`) it is marked with the ticket, so an :meth:`hold` from inside that step
    (``generate`` calling ``eval``) goes on without waiting for itself.

    A request waits for the one before it to end, whoever ends it: a thread that starts a second
    request while a stream it holds is still open waits until that stream is finished, closed or
    dropped elsewhere, so finish or close a stream before starting another on the same thread.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ticket: Optional[object] = None
        self._local = threading.local()

    def acquire(self, timeout: float = -1) -> Optional[object]:
        """Wait for the instance (``timeout`` seconds; -1: no limit); the ticket, or None."""
        if not self._lock.acquire(timeout=timeout):
            return None
        ticket = self._ticket = object()
        return ticket

    def release(self, ticket: Optional[object]) -> None:
        """Give the instance back, if ``ticket`` still holds it."""
        if ticket is not None and self._ticket is ticket:
            self._ticket = None
            self._lock.release()

    @property
    def busy(self) -> bool:
        """A request holds the instance."""
        return self._lock.locked()

    def inside(self) -> bool:
        """This thread is running a step of the request that holds the instance."""
        ticket = getattr(self._local, "ticket", None)
        return ticket is not None and ticket is self._ticket

    @contextlib.contextmanager
    def running(self, ticket: object):
        """Mark this thread as running a step of the request ``ticket``."""
        previous = getattr(self._local, "ticket", None)
        self._local.ticket = ticket
        try:
            yield
        finally:
            self._local.ticket = previous

    @contextlib.contextmanager
    def hold(self):
        """Hold the instance for a block, unless this thread already runs the holding request."""
        if self.inside():
            yield
            return
        ticket = self.acquire()
        try:
            with self.running(ticket):
                yield
        finally:
            self.release(ticket)
