"""The pipeline: parked worker threads (``workers``) drain one list of work items in order, calling
``work(worker, item)`` then ``on_done``; the first error cancels the rest and ``wait`` re-raises it;
``on_end`` runs once, on the last worker to stop.
"""

from __future__ import annotations

import functools
import itertools
import threading
from typing import Any, Callable, Sequence

from ..errors import CancelledError
from . import workers


class Job:
    """Runs ``work(worker, item)`` for every item on ``threads`` threads."""

    def __init__(self, items: Sequence[Any], work: Callable[[int, Any], Any], threads: int,
                 on_done: Callable[[int, Any, Any], None] | None = None, name: str = "foxhunt",
                 keepalive: Any = None, setup: Callable[[int], Any] | None = None,
                 teardown: Callable[[int], Any] | None = None,
                 on_end: Callable[[BaseException | None], None] | None = None) -> None:
        self.items = items
        self._work = work
        self._on_done = on_done
        self._on_end = on_end   # on_end(error or None), once, as the job ends (an error it raises fails the job)
        self._setup = setup
        self._teardown = teardown   # runs on each worker thread as it stops, error or not
        self._next = itertools.count()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._done = threading.Event()
        self.keepalive = keepalive
        n = max(1, min(threads, len(items))) if items else 0
        self._alive = n
        self._name = name
        self._n = n
        self._tasks: list[workers.Task] = []
        if not n:
            self._end()

    def start(self) -> "Job":
        """Start the workers."""
        for w in range(self._n):
            task = workers.run(functools.partial(self._run, w), f"{self._name}-{w}")
            with self._lock:
                self._tasks.append(task)
        return self

    def _run(self, worker: int) -> None:
        try:
            if self._setup is not None:
                self._setup(worker)
            while not self._cancel.is_set():
                i = next(self._next)
                if i >= len(self.items):
                    break
                result = self._work(worker, self.items[i])
                if self._on_done is not None:
                    self._on_done(i, self.items[i], result)
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            self.fail(e)
        finally:
            if self._teardown is not None:
                try:
                    self._teardown(worker)
                except BaseException as e:  # noqa: BLE001
                    self.fail(e)
            with self._lock:
                self._alive -= 1
                last = self._alive == 0
            if last:
                self._end()

    def _end(self) -> None:
        """The job is over: ``on_end``, the references to the work and its buffers dropped, waiters woken."""
        try:
            if self._on_end is not None:
                self._on_end(self._error)
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            self.fail(e)
        finally:
            self._work = self._on_done = self._setup = self._teardown = self._on_end = None
            self.keepalive = None
            self._done.set()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
        self._cancel.set()

    def cancel(self) -> None:
        """Stop taking items; the job then ends with ``CancelledError`` (unless already over)."""
        if not self._done.is_set():
            self.fail(CancelledError("cancelled"))

    def cancelled(self) -> bool:
        """True once the job was cancelled or failed: long work items may stop early (by raising)."""
        return self._cancel.is_set()

    @property
    def workers(self) -> int:
        """How many worker threads this job runs (at most one per item)."""
        return self._n

    @property
    def stopping(self) -> threading.Event:
        """Set once the job is cancelled or failed: side work beside the workers stops with them."""
        return self._cancel

    def finished(self, timeout: float | None = None) -> bool:
        """Block up to ``timeout`` seconds for every worker to stop; True if they have (raises nothing)."""
        return self._done.wait(timeout)

    @property
    def error(self) -> BaseException | None:
        return self._error

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every worker has stopped; re-raise the first error. A waiter interrupted
        (KeyboardInterrupt...) cancels and joins the workers first: none may still use the
        files and buffers its caller frees on the way out."""
        try:
            finished = self._done.wait(timeout)
        except BaseException:
            self.cancel()
            self._done.wait()
            raise
        if not finished:
            raise TimeoutError("pipeline did not finish in time")
        with self._lock:
            tasks = list(self._tasks)
        for t in tasks:   # each worker has returned to its parking place, holding nothing of the job
            t.join()
        if self._error is not None:
            raise self._error
