"""Small helpers the benchmark scripts share: dropping the page cache, and a few threads taking
jobs off one list (the shape of every reader in these measurements)."""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Iterable, TypeVar

J = TypeVar("J")


def drop_caches() -> None:
    """Write back, then drop the page cache, dentries and inodes (root only)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def run_jobs(jobs: Iterable[J], threads: int, work: Callable[[J], None],
             setup: Callable[[], object] | None = None) -> float:
    """Seconds for ``threads`` threads to run ``work(job)`` over ``jobs``, each taking the next
    job as it finishes one. ``setup()``, if given, runs on each thread first (its per-thread
    state is passed as ``work(job, state)``)."""
    it = iter(jobs)
    lock = threading.Lock()

    def loop():
        state = setup() if setup is not None else None
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return
            if setup is not None:
                work(job, state)
            else:
                work(job)
    ts = [threading.Thread(target=loop) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0
