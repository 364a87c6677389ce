"""The bounded FIFO between the event loop (many requests) and the one decoding thread.

The model decodes one sequence at a time (or one per slot with ``--parallel``), so requests wait
here in arrival order.
A plain ``queue.Queue`` cannot take back a request whose client left or whose wait ran
out, and then its slot would stay counted; this one can, under the same lock as ``take``,
so a request is either withdrawn or running, never both.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any


class QueueFull(Exception):
    """``max_queue`` requests are already waiting."""


class QueueClosed(Exception):
    """The server is shutting down."""


@dataclass(eq=False)
class Job:
    """One request on its way through the worker; events flow back to the handler's loop.

    ``events`` is an asyncio.Queue owned by the handler's loop; the worker thread posts
    with ``post`` (thread-safe).  ``cancelled`` is read by the generation after every round.
    """

    request_id: str
    spec: Any  # the worker's description of the work (engine.Work)
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None  # set by ``take``
    result: Any = None  # the terminal event (Finished or Failed), once delivered on the loop
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set with ``result``

    def post(self, event: Any) -> None:
        """From the worker thread: hand an event to the handler (dropped if its loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:  # loop closed: the server is shutting down, nobody is listening
            pass

    def _deliver(self, event: Any) -> None:
        self.events.put_nowait(event)
        if event.terminal:
            self.result = event
            self.ended.set()

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def queue_s(self) -> float:
        return (self.started_at or time.perf_counter()) - self.submitted_at


class RequestQueue:
    """FIFO of waiting jobs with a bound; ``active`` are the jobs the worker holds (one per slot)."""

    def __init__(self, max_waiting: int, slots: int = 1) -> None:
        self.max_waiting = max_waiting
        self.slots = slots
        self._waiting: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self.active: list[Job] = []

    @property
    def depth(self) -> int:
        """Requests waiting (the running ones not counted)."""
        return len(self._waiting)

    @property
    def busy(self) -> int:
        """Requests the worker holds now."""
        return len(self.active)

    @property
    def running(self) -> Job | None:
        """The oldest job the worker holds (the only one without slots)."""
        return self.active[0] if self.active else None

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closed:
                raise QueueClosed()
            # room for max_waiting behind the running ones; an idle slot takes the next at once
            if len(self._waiting) + len(self.active) >= self.max_waiting + self.slots:
                raise QueueFull()
            self._waiting.append(job)
            self._cond.notify()

    def take(self, block: bool = True) -> Job | None:
        """Worker: the oldest waiting job, now running; blocks while empty (unless ``block`` is False);
        None once closed, or when nothing waits and ``block`` is False."""
        with self._cond:
            while block and not self._waiting and not self._closed:
                self._cond.wait()
            if self._closed or not self._waiting:
                return None
            job = self._waiting.popleft()
            job.started_at = time.perf_counter()
            self.active.append(job)
            return job

    def withdraw(self, job: Job) -> bool:
        """Take back a job that has not started; False if the worker already holds it (or held it)."""
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return False
            return True

    def done(self, job: Job) -> None:
        """Worker: the job has finished; its slot is free."""
        with self._cond:
            if job in self.active:
                self.active.remove(job)

    def close(self) -> list[Job]:
        """Stop taking work; returns the jobs that never started (their handlers get a 503)."""
        with self._cond:
            self._closed = True
            left = list(self._waiting)
            self._waiting.clear()
            for job in self.active:
                job.cancel()
            self._cond.notify_all()
            return left
