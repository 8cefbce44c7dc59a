"""Worker threads kept between jobs: waking a parked thread costs one lock release, where
``Thread.start`` waits for the new thread's bootstrap under the GIL. A thread idle for
``KEEP_IDLE_S`` exits; there is no upper bound (a task may wait on another); a forked child has none.
"""

from __future__ import annotations

import _thread
import logging
import os
import threading
from typing import Callable

log = logging.getLogger("foxhunt_stream")

# the name a parked worker carries while it waits for a task
IDLE_NAME = "foxhunt-idle"
# how long a parked worker waits for its next task before it exits
KEEP_IDLE_S = 30.0


class Task:
    """One function running on a worker thread; ``join`` waits until it has returned and the
    thread holds nothing of it any more (as ``Thread.join`` did for a thread of its own)."""

    __slots__ = ("_fn", "_finished")

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn
        self._finished = threading.Event()

    def join(self, timeout: float | None = None) -> bool:
        return self._finished.wait(timeout)

    def done(self) -> bool:
        return self._finished.is_set()


class _Parked:
    """A worker thread's slot: the task handed to it and the lock it sleeps on."""

    __slots__ = ("task", "name", "wake")

    def __init__(self) -> None:
        self.task: Task | None = None
        self.name = IDLE_NAME
        self.wake = threading.Lock()
        self.wake.acquire()   # held while parked: a release hands the thread its task


_lock = threading.Lock()
_parked: list[_Parked] = []


def run(fn: Callable[[], None], name: str) -> Task:
    """Run ``fn()`` on the worker parked last, or a new one, named ``name`` while it runs (an error
    escaping ``fn`` is logged)."""
    task = Task(fn)
    with _lock:
        slot = _parked.pop() if _parked else None
    if slot is None:   # a new thread, whose start the caller does not wait for (Thread.start waits for
        # the new thread's bootstrap under the GIL: a process's first load started 16 in turn)
        slot = _Parked()
        slot.task, slot.name = task, name
        _thread.start_new_thread(_serve, (slot,))
    else:
        slot.task, slot.name = task, name
        slot.wake.release()
    return task


def parked() -> int:
    """How many worker threads wait for work now."""
    with _lock:
        return len(_parked)


def _serve(slot: _Parked) -> None:
    me = threading.current_thread()
    while True:
        task, slot.task = slot.task, None
        me.name = slot.name
        fn, task._fn = task._fn, None
        try:
            fn()
        except BaseException:  # noqa: BLE001 - a task reports its own errors; this one escaped
            log.exception("foxhunt worker task %s failed", slot.name)
        del fn
        me.name = IDLE_NAME
        with _lock:
            _parked.append(slot)
        task._finished.set()   # joined: this thread is parked (and may already have its next task)
        del task
        if not slot.wake.acquire(timeout=KEEP_IDLE_S):
            with _lock:
                if slot in _parked:
                    _parked.remove(slot)
                    return
            slot.wake.acquire()   # a task was handed over just as the wait ran out


def _forget_parked() -> None:
    """In a forked child: the parent's parked threads do not exist here."""
    global _lock
    _lock = threading.Lock()
    _parked.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parked)
