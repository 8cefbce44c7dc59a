"""A load in flight: one plan executed by the pipeline into its destinations.

``LoadInFlight`` is the one route of every load: workers take the plan's chunks in order and a
target lands each; per destination it counts the chunks in and keeps their copies' events, so a
caller may wait for one tensor or all. It makes the destinations before the workers start, runs
cancellation, and ``finish`` leaves nothing half-done. When the last worker stops the files are
checked and ``on_end`` runs. An optional ``LoadCheck`` (checksums) is called per chunk and per destination.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
import threading
import time
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


class LoadInFlight:
    """A load plan in flight: per-destination readiness, cancellation, one wait for all."""

    def __init__(self, plan: LoadPlan, sources: Sequence[FileSource], dests: Destinations,
                 s: _settings.Settings, keepalive: Any = None, check: LoadCheck | None = None,
                 progress: Progress = NO_PROGRESS, per_dest: bool = False,
                 on_end: Callable[[], None] | None = None) -> None:
        self.plan = plan
        # per_dest: the caller takes tensors as they land, so a check hashes each as it lands
        self.per_dest = per_dest
        self.progress = progress
        self.check = check
        self.dests = dests
        self.sources = sources
        self._on_end = on_end
        self._lock = threading.Lock()
        self._remaining = list(plan.chunks_per_dest)
        self._events: dict[int, list] = {}   # per destination with copies on a GPU: their events
        # per destination, 1 once all its chunks are in; one condition, cheaper than an Event each
        self._landed = bytearray(map(operator.not_, self._remaining))
        self._landing = threading.Condition(self._lock)
        threads = s.threads
        if any(dev.is_cuda for dev in dests.devices):
            # each GPU worker holds at least one pinned slot until its work runs out: no more workers than slots
            threads = min(threads, s.n_slots)
        # a host worker holds one scratch slot at a time: more than `threads` is waste
        self._targets: dict[Device, Any] = {
            dev: (CudaTarget(dev.index, s.chunk_bytes, s.n_slots, threads) if dev.is_cuda
                  else HostTarget(s.chunk_bytes, min(s.n_slots, threads)))
            for dev in dests.devices}
        # per destination (no hashing per chunk, nor per destination for one device)
        self._target_of = ([*self._targets.values()] * len(dests.devices_of) if len(self._targets) == 1
                           else [self._targets[dev] for dev in dests.devices_of])
        self._waiting = 0   # callers in wait_dest: only then is a landed destination announced
        self.started = time.perf_counter()
        log.debug("load: %d tensors, %d bytes, %d chunks, %d threads, chunk %d, staging %d, backends %s",
                  len(plan.destinations), plan.nbytes, len(plan.chunks), threads, s.chunk_bytes,
                  s.staging_bytes, sorted({src.backend for src in sources}))
        # every destination with chunks of its own is made here, before the workers start: made
        # beside them, each took the GIL and the driver from them (RESULTS.md). A shared chunk's
        # small tensors are made by the worker landing it.
        dests.make(plan)
        self.job = Job(plan.chunks, self._work, threads, self._on_done, keepalive=keepalive,
                       teardown=self._worker_done, on_end=self._end).start()

    def _work(self, worker: int, chunk):
        d = chunk.dest
        if type(d) is range:   # small whole tensors read together (no checksum blocks: no inspector)
            target = self._target_of[d.start]   # a GPU's copies them out of pinned memory, the host's out of its bytes
            land = self.dests.shared_chunk if isinstance(target, CudaTarget) else self.dests.land_shared
            return target.land_packed(worker, self.sources[chunk.file], chunk.run, functools.partial(land, d))
        inspect = self.check.inspector(d, chunk.run) if self.check is not None else None
        buf = self.dests.buffers[d]
        return self._target_of[d].land(worker, self.sources[chunk.file], chunk.run, buf, inspect=inspect)

    def _worker_done(self, worker: int) -> None:
        for t in self._targets.values():
            if isinstance(t, CudaTarget):
                t.release_worker(worker)

    def _end(self, error: BaseException | None) -> None:
        """As the job ends (on the last worker to stop): the files are still the ones whose headers
        were read (a file rewritten or resized while it was read may have fed us two versions),
        then ``on_end``, whether the load succeeded or not."""
        try:
            if error is None:
                self._check_unchanged()
        finally:
            if self._on_end is not None:
                self._on_end()

    def _on_done(self, i: int, chunk, event) -> None:
        d = chunk.dest
        if type(d) is range:   # each of its tensors is in: its one chunk
            complete = d
            if event is not None:
                events = [event]
                for m in d:
                    self._events[m] = events
        else:
            with self._lock:
                if event is not None:
                    self._events.setdefault(d, []).append(event)
                self._remaining[d] -= 1
                complete = (d,) if self._remaining[d] == 0 else ()
        if complete:
            if self.check is not None:
                for m in complete:
                    self.check.landed(m, self.dests.buffer(m), self._copies(m), self.per_dest)
            with self._landing:
                for m in complete:
                    self._landed[m] = 1
                if self._waiting:
                    self._landing.notify_all()
        self.progress.update(chunk.run.nbytes)

    def _copies(self, d: int) -> list:
        """The events that complete after every copy of destination ``d`` (each slot's once)."""
        return list(dict.fromkeys(self._events.get(d, ())))

    def wait_dest(self, d: int) -> None:
        """Block until destination ``d`` has fully landed (its copies complete; a copy's event may
        also stand for a few later copies of the same worker)."""
        with self._landing:
            self._waiting += 1
            try:
                while not self._landed[d] and not self.job.done():
                    self._landing.wait(0.05)
            finally:
                self._waiting -= 1
            landed = self._landed[d]
        if not landed:
            self.finish()   # raises the job's error
            raise RuntimeError("load ended before every chunk landed")
        for ev in self._copies(d):
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
        self._drain()
        self.progress.close()
        if self.check is not None:
            try:
                self.check.finish(self.dests.buffer)
            except BaseException:
                self._stop_everything()   # a corrupt load hands nothing back
                raise
        elapsed = time.perf_counter() - self.started
        if elapsed > 0:
            log.debug("load: %.3f s, %.2f GB/s", elapsed, self.plan.nbytes / elapsed / 1e9)

    def cancel(self) -> None:
        self.job.cancel()

    def abandon(self) -> None:
        """Stop the load and drop what it made, whatever became of it: the caller takes nothing
        more of it (a ``tensors()`` iterator stopped early, or failed after every read was done)."""
        self.job.cancel()
        with contextlib.suppress(BaseException):
            self.job.wait()
        self._stop_everything()

    def _stop_everything(self) -> None:
        """After a failure: no copy or check still running, no array kept alive."""
        with contextlib.suppress(Exception):   # the error being raised is the one to report
            self._drain()
        self.dests.release()
        self.progress.close()

    def _check_unchanged(self) -> None:
        for src in self.sources:
            src.check_unchanged()

    def _drain(self) -> None:
        for dev in self._targets:
            if dev.is_cuda:
                context(dev.index).synchronize()
        if self.check is not None:   # checks queued on the GPU still reading destinations
            self.check.drain()
