"""Small helpers the benchmark scripts share: dropping the page cache, and a few threads taking
jobs off one list (the shape of every reader in these measurements)."""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Iterable, TypeVar

import numpy as np

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


def memcpy_rate(threads: int, nbytes: int = 1 << 30, repeat: int = 3) -> float:
    """GB/s copied between two anonymous buffers by ``threads`` threads (numpy releases the GIL)."""
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    bounds = np.linspace(0, nbytes, threads + 1).astype(np.int64) // 4096 * 4096
    bounds[-1] = nbytes
    parts = [(int(bounds[i]), int(bounds[i + 1])) for i in range(threads)]
    best = min(run_jobs(parts, threads, lambda ab: np.copyto(dst[ab[0]:ab[1]], src[ab[0]:ab[1]]))
               for _ in range(repeat))
    return nbytes / best / 1e9


def h2d_rate(gpu: int, nbytes: int = 1 << 30, ready=None) -> float:
    """GB/s of pinned -> device copies in 16 MiB pieces on one stream, best of 3; ``ready()``
    runs after the buffers exist and before the timing (a barrier between processes)."""
    import cupy as cp
    with cp.cuda.Device(gpu):
        mem = cp.cuda.alloc_pinned_memory(nbytes)
        host = np.frombuffer(mem, np.uint8, nbytes)
        host[:] = 1
        dst = cp.empty(nbytes, np.uint8)
        stream = cp.cuda.Stream(non_blocking=True)
        if ready is not None:
            ready()
        best = float("inf")
        for _ in range(3):
            stream.synchronize()
            t0 = time.perf_counter()
            for off in range(0, nbytes, 16 << 20):
                cp.cuda.runtime.memcpyAsync(dst.data.ptr + off, host.ctypes.data + off, min(16 << 20, nbytes - off),
                                            cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
            stream.synchronize()
            best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9
