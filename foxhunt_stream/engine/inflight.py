"""A load in flight: one plan executed by the pipeline into its destinations.

``LoadInFlight`` owns the bookkeeping every front end shares (``load_file``, ``load_into``,
``safe_open``, a background ``LoadHandle``): per-destination readiness, the targets (host or
GPU) chunks land through, the allocating thread that runs ahead of the workers, cancellation,
and one ``finish`` that waits for everything and leaves nothing half-done behind. An optional
``LoadCheck`` (checksums: ``integrity.verifier.Verifier``) is a step the load calls per chunk
and per destination; the load itself knows nothing of hashing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Protocol, Sequence

from .. import settings as _settings
from ..cuda.devices import Device, context
from ..format.plan import LoadPlan, Run
from ..io.source import FileSource
from .destinations import Destinations
from .frameworks import Buffer
from .pipeline import Job
from .progress import NO_PROGRESS, Progress
from .targets import CudaTarget, HostTarget

log = logging.getLogger("foxhunt_stream")


class LoadCheck(Protocol):
    """A check the load runs as its bytes pass (``integrity.verifier.Verifier`` is one).

    ``inspector`` is asked on the worker before a chunk is read and may return an object fed the
    chunk's host bytes as they are read; ``landed`` is told when every chunk of a destination is in
    (``events``: the copies still in flight on a GPU; ``waited``: someone waits for this one
    destination); ``settle`` waits for queued checks (one destination, or all) and raises the first
    failure; ``finish`` runs once all copies are done; ``drain`` makes sure no check still reads
    the destinations (after a failure)."""

    def inspector(self, dest: int, run: Run) -> Any: ...
    def landed(self, dest: int, buffer: Buffer, events: Sequence[Any], waited: bool) -> None: ...
    def settle(self, dest: int | None = None) -> None: ...
    def finish(self, buffer_of: Callable[[int], Buffer]) -> None: ...
    def drain(self) -> None: ...


def held_workers(threads: int, cpus: int | None = None) -> int:
    """Workers to hold back while the allocating thread runs: enough to leave two CPUs free."""
    if cpus is None:
        cpus = _settings.available_cpus()
    return max(0, min(threads - 1, threads + 2 - cpus))


class LoadInFlight:
    """A load plan in flight: per-destination readiness, cancellation, one wait for all."""

    def __init__(self, plan: LoadPlan, sources: list[FileSource], dests: Destinations,
                 s: _settings.Settings, keepalive: Any = None, check: LoadCheck | None = None,
                 progress: Progress = NO_PROGRESS, per_dest: bool = False) -> None:
        self.plan = plan
        # per_dest: someone waits for single destinations (tensors(), a background handle), so
        # each GPU chunk gets an event of its own; otherwise chunks share their slot's reused
        # event (a landed check may start a little late) and finish() drains the streams
        self.per_dest = per_dest
        self.progress = progress
        self.check = check
        self.dests = dests
        self.sources = sources
        self._lock = threading.Lock()
        self._remaining = list(plan.chunks_per_dest)
        self._events: list[list] = [[] for _ in plan.destinations]
        # per destination, 1 once all its chunks are in; one condition for whoever waits on one
        # (not an Event each: 291 of them cost ~1 ms of the caller before the first worker starts)
        self._landed = bytearray(1 if n == 0 else 0 for n in self._remaining)
        self._landing = threading.Condition(self._lock)
        if any(dev.is_cuda for dev in dests.devices):
            # every GPU worker holds a ring of at least one pinned slot until it runs out of work:
            # more workers than slots would leave some waiting for a slot until the others finish
            s = replace(s, threads=min(s.threads, s.n_slots))
        # a host worker holds one scratch slot at a time: more than `threads` is waste (and
        # staging/chunk of them, e.g. 131072 with 4 KiB chunks, took seconds to allocate)
        self._targets: dict[Device, Any] = {
            dev: (CudaTarget(dev.index, s.chunk_bytes, s.n_slots, s.threads) if dev.is_cuda
                  else HostTarget(s.chunk_bytes, min(s.n_slots, s.threads)))
            for dev in dests.devices}
        self.started = time.perf_counter()
        # one GPU and nobody waiting chunk by chunk (for single destinations, or a check told as
        # each lands): each worker runs the target's own loop over the chunks it claims
        only = next(iter(self._targets.values())) if len(self._targets) == 1 else None
        tracked = per_dest or check is not None
        self._streamed: CudaTarget | None = only if isinstance(only, CudaTarget) and not tracked else None
        self.job = Job(plan.chunks, self._work, s.threads, None if self._streamed else self._on_done,
                       keepalive=keepalive, teardown=self._worker_done,
                       drain=self._drain_chunks if self._streamed else None)
        log.debug("load: %d tensors, %d bytes, %d chunks, %d threads, chunk %d, staging %d, backends %s",
                  len(plan.destinations), plan.nbytes, len(plan.chunks), s.threads, s.chunk_bytes,
                  s.staging_bytes, sorted({src.backend for src in sources}))
        # the allocator starts first so that it leads the workers; while it runs, the workers
        # leave it a CPU (and one for the caller and the driver): on the 16-CPU H200 machine a
        # row shard with 16 workers beside the allocator took 0.186-0.194 of a full load, with 14
        # workers 0.159-0.161, and 16 workers with nothing to allocate (load_into) ~0.16 as well
        self._allocator = (dests.allocate_ahead(plan.dest_order(), self.job.stopping, then=self.job.release)
                           if len(plan.destinations) > 1 else None)
        self.job.start(hold=held_workers(s.threads) if self._allocator is not None else 0)

    def _work(self, worker: int, chunk):
        d = chunk.dest
        dev = self.dests.devices_of[d]
        inspect = self.check.inspector(d, chunk.run) if self.check is not None else None
        # a GPU chunk is read into pinned staging before its destination is needed: the
        # allocation (if this worker overtook the allocating thread) overlaps the read
        buf = functools.partial(self.dests.buffer, d) if dev.is_cuda else self.dests.buffer(d)
        return self._targets[dev].land(worker, self.sources[chunk.file], chunk.run, buf, inspect=inspect,
                                       track=self.per_dest)

    def _drain_chunks(self, worker: int, chunks) -> None:
        self._streamed.land_all(worker, chunks, self.sources, self.dests.buffers, self.dests.buffer,
                                progress=self.progress.update if self.progress.active else None)

    def _worker_done(self, worker: int) -> None:
        for t in self._targets.values():
            if isinstance(t, CudaTarget):
                t.release_worker(worker)

    def _on_done(self, i: int, chunk, event) -> None:
        d = chunk.dest
        with self._lock:
            if event is not None:
                self._events[d].append(event)
            self._remaining[d] -= 1
            complete = self._remaining[d] == 0
            events = list(self._events[d]) if complete else ()
        if complete and self.check is not None:
            self.check.landed(d, self.dests.buffer(d), events, self.per_dest)
        if complete:
            with self._landing:
                self._landed[d] = 1
                self._landing.notify_all()
        self.progress.update(chunk.run.nbytes)

    def wait_dest(self, d: int) -> None:
        """Block until destination ``d`` has fully landed (its copies complete); without
        ``per_dest`` the wait may include later chunks of the same workers, and a load whose
        workers run the target's own loop (nothing tracked per chunk) waits for all of them."""
        if self._streamed is not None:
            self.finish()
            return
        with self._landing:
            while not self._landed[d] and not self.job.done():
                self._landing.wait(0.05)
            landed = self._landed[d]
        if not landed:
            self.finish()   # raises the job's error
            raise RuntimeError("load ended before every chunk landed")
        for ev in self._events[d]:
            ev.synchronize()
        if self.check is not None:
            self.check.settle(d)

    def finished(self, timeout: float | None = None) -> bool:
        """Whether the workers have stopped, waiting up to ``timeout`` (no error raised here)."""
        return self.job.finished(timeout)

    def finish(self) -> None:
        """Wait for everything; on error, make sure no copy is still writing before raising."""
        try:
            self.job.wait()
        except BaseException:
            self._stop_everything()
            raise
        self._join_allocator()
        self._drain()
        self.progress.close()
        try:
            if self.check is not None:
                self.check.finish(self.dests.buffer)
            self._check_unchanged()
        except BaseException:
            self._stop_everything()   # a mixed-version or corrupt load hands nothing back
            raise
        elapsed = time.perf_counter() - self.started
        if elapsed > 0:
            log.debug("load: %.3f s, %.2f GB/s", elapsed, self.plan.nbytes / elapsed / 1e9)

    def cancel(self) -> None:
        self.job.cancel()

    def _stop_everything(self) -> None:
        """After a failure: no allocation, copy or check still running, no array kept alive."""
        self._join_allocator()
        with contextlib.suppress(Exception):   # the error being raised is the one to report
            self._drain()
        self.dests.release()
        self.progress.close()

    def _join_allocator(self) -> None:
        if self._allocator is not None:
            self._allocator.join()   # every destination it started is allocated or failed
            self._allocator = None

    def _check_unchanged(self) -> None:
        """A file rewritten or resized while it was read may have fed us a mix of two versions."""
        for src in self.sources:
            if src.fd >= 0:
                src.check_unchanged()

    def _drain(self) -> None:
        for dev in self._targets:
            if dev.is_cuda:
                context(dev.index).synchronize()
        if self.check is not None:   # checks queued on the GPU still reading destinations
            self.check.drain()
