"""Targets: land a chunk of file bytes in its destination.

``HostTarget`` reads straight into the destination array when a chunk is one contiguous run
(no staging), and through a scratch slot for strided (2-D) runs and O_DIRECT. A source with a
mapping (``auto`` backend for files in the page cache, ``mmap``) packs a strided run's rows
itself (``gather``), touching only their pages, straight into the destination or the slot.
``CudaTarget`` reads into a pinned slot of the worker's own ring, enqueues ``cudaMemcpyAsync``
(or ``cudaMemcpy2DAsync`` for strided runs read as whole spans) on the worker's own non-blocking
stream and records the slot's event, so the slot is reused as soon as its copy is done. With
checksums, a chunk is read and hashed in cache-hot pieces (``read_inspected``). ``fetch`` runs
the saver's direction (device bytes -> pinned memory, for writing).
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Callable, Iterable, Sequence

import numpy as np

from ..cuda import native
from ..cuda import runtime as cudart
from ..cuda.devices import context, use_device
from ..format.plan import Chunk, Run
from ..io.source import ALIGN, FileSource
from .frameworks import Buffer
from .staging import StagingPool, host_pool, pinned_pool

H2D = cudart.H2D
# verify=True: a chunk is read and hashed in pieces of this size. Small pieces are hashed while
# still in the CPU cache, but every read and every hash call releases the GIL, and with 16 workers
# each hand-back costs far more than the cache saves: on the H200 one 3.9 GB shard loaded in
# 0.388 s with 1 MiB pieces, 0.184 s with 4 MiB and 0.171 s with whole chunks (no checksums: 0.116 s).
PIECE_BYTES = 64 << 20
# land_all tells a progress bar of its bytes in steps of this (a bar's lock per chunk is a place
# where workers queue)
PROGRESS_BYTES = 256 << 20


def read_inspected(source: FileSource, offset: int, length: int, scratch: np.ndarray, inspect) -> np.ndarray:
    """``source.read_span`` that also feeds ``inspect`` (a checksum ChunkHasher, or None) the bytes
    piece by piece right after each piece is read, while it is still in the CPU cache."""
    if inspect is None:
        return source.read_span(offset, length, scratch)
    if not source.direct_reads:   # O_DIRECT reads whole aligned spans: hash the span after
        view = source.read_span(offset, length, scratch)
        inspect.update(view)
    else:
        view = scratch[:length]
        for p in range(0, length, PIECE_BYTES):
            piece = view[p:p + PIECE_BYTES]
            source.read_into(piece, offset + p)
            inspect.update(piece)
    inspect.done()
    return view


def copy_2d(src: np.ndarray, run: Run, dst: np.ndarray) -> None:
    """Copy ``height`` rows of ``width`` bytes, ``pitch`` apart in ``src``, packed into ``dst``."""
    if run.height == 1:
        dst[run.dst:run.dst + run.width] = src[:run.width]
        return
    rows = np.lib.stride_tricks.as_strided(src, (run.height, run.width), (run.pitch, 1), writeable=False)
    dst[run.dst:run.dst + run.nbytes].reshape(run.height, run.width)[...] = rows


class HostTarget:
    def __init__(self, chunk_bytes: int, n_slots: int) -> None:
        self.scratch_bytes = chunk_bytes + 2 * ALIGN
        self.n_slots = n_slots
        self._pool: StagingPool | None = None

    def pool(self) -> StagingPool:
        if self._pool is None:
            self._pool = host_pool(self.scratch_bytes, self.n_slots)
        return self._pool

    def land(self, worker: int, source: FileSource, run: Run, buf: Buffer, inspect=None, track: bool = False):
        if run.height == 1 and source.direct_reads:
            dst = buf.host[run.dst:run.dst + run.width]
            if inspect is not None:   # checksums: hashed piece by piece as they land, on this thread
                read_inspected(source, run.src, run.width, dst, inspect)
            else:
                source.read_into(dst, run.src)
            return None
        if run.height > 1 and source.gather(run, buf.host[run.dst:run.dst + run.nbytes]):
            return None   # a mapped source copied only the selected columns, no scratch
        pool = self.pool()
        slot = pool.acquire()
        try:
            copy_2d(read_inspected(source, run.src, run.span, slot.array, inspect), run, buf.host)
        finally:
            pool.release(slot)
        return None


class _Ring:
    """One worker's pinned slots, used in turn; each slot's event marks its last copy."""

    __slots__ = ("pool", "slots", "ptrs", "events", "pending", "next", "stream_ptr", "stream")

    def __init__(self, pool, slots, stream, events) -> None:
        self.pool = pool    # the pool the slots go back to (a settings change may replace the device's)
        self.slots = slots
        self.ptrs = [slot.ptr for slot in slots]
        self.events = events
        self.pending = [False] * len(slots)
        self.next = 0
        self.stream = stream
        self.stream_ptr = stream.ptr


class _Address:
    """A destination known by its device address alone (a queued record's)."""
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class CudaTarget:
    """Lands chunks on one GPU through pinned slots.

    Each worker takes a small ring of slots from the device's pool on its first chunk and gives
    it back when it has no more work (``release_worker``): per chunk there is no queue, lock,
    device switch or event creation, only the read, one async copy and one event record. Per
    chunk Python work is serialized by the GIL across all workers, so it is what bounds a load
    of many small chunks (a tensor-parallel shard): measured on the H200 (16 threads, 417 chunks)
    as ~1 ms of waiting per chunk outside the reads before this ring.
    """

    def __init__(self, device_index: int, chunk_bytes: int, n_slots: int, threads: int = 1) -> None:
        self.index = device_index
        self.ctx = context(device_index)
        self.slot_bytes = chunk_bytes + 2 * ALIGN
        self.n_slots = n_slots
        self.per_worker = max(1, n_slots // max(1, threads))   # defaults: 32 slots / 16 workers = 2
        self._rt = cudart.runtime()
        self._native = native.lander_for(self._rt)   # None: a contiguous chunk's steps run in Python
        self._rings: dict[int, _Ring] = {}

    def pool(self) -> StagingPool:
        return pinned_pool(self.index, self.slot_bytes, self.n_slots)

    def _ring(self, worker: int) -> _Ring:
        """This worker's ring: the first slot waits for one to come free, the rest are taken only
        if free (so concurrent loads sharing the pool never wait on each other in a cycle)."""
        pool = self.pool()
        use_device(self.index)
        slots = [pool.acquire()]
        try:
            for _ in range(self.per_worker - 1):
                slot = pool.try_acquire()
                if slot is None:
                    break
                slots.append(slot)
            events = []
            for slot in slots:
                if slot.cuda_event is None:
                    slot.cuda_event = cudart.Event()
                events.append(slot.cuda_event)
            ring = self._rings[worker] = _Ring(pool, slots, self.ctx.stream(worker), events)
        except BaseException:   # nothing may keep a slot of the process-wide pool
            for slot in slots:
                pool.release(slot)
            raise
        return ring

    def release_worker(self, worker: int) -> None:
        """Give the worker's ring back to the pool; a slot's copy may still be running, so the next
        taker waits on its event."""
        ring = self._rings.pop(worker, None)
        if ring is None:
            return
        for slot, ev, pending in zip(ring.slots, ring.events, ring.pending):
            ring.pool.release(slot, ev if pending else None)

    def land(self, worker: int, source: FileSource, run: Run, buf: Buffer | Callable[[], Buffer], inspect=None,
             track: bool = False):
        """Queue the chunk's copy and return an event that completes after it: with ``track`` (a
        caller waits for single destinations) a fresh event for this chunk alone, else the slot's
        reused event, which later chunks of this worker re-record (a wait on it may over-wait).

        ``buf`` may be a function giving the destination: it is called after the read, so the
        destination's allocation (on a GPU: the framework allocator, under the GIL) overlaps the
        read instead of preceding it."""
        rt = self._rt
        ring = self._rings.get(worker)
        if ring is None:
            ring = self._ring(worker)
        k = ring.next
        ring.next = (k + 1) % len(ring.slots)
        event = ring.events[k]
        if ring.pending[k]:
            rt.eventSynchronize(event.ptr)   # the slot's previous copy must be done before we overwrite it
            ring.pending[k] = False
        slot = ring.slots[k]
        src = ring.ptrs[k]
        ring.pending[k] = True   # from here on a copy may be in flight: the slot goes back with its event
        if run.height > 1 and source.gather(run, slot.array):    # mapped source: rows packed
            if callable(buf):
                buf = buf()
            rt.memcpyAsync(buf.ptr + run.dst, src, run.nbytes, H2D, ring.stream_ptr)
        else:
            if inspect is not None:
                view = read_inspected(source, run.src, run.span, slot.array, inspect)
            else:
                view = source.read_span(run.src, run.span, slot.array)
            if not source.direct_reads:   # O_DIRECT: the bytes start inside the aligned span
                src = view.ctypes.data
            if callable(buf):
                buf = buf()
            if run.height == 1:
                rt.memcpyAsync(buf.ptr + run.dst, src, run.nbytes, H2D, ring.stream_ptr)
            else:
                rt.memcpy2DAsync(buf.ptr + run.dst, run.width, src, run.pitch, run.width, run.height,
                                 H2D, ring.stream_ptr)
        self._record(ring, k)
        if not track:
            return event   # re-recorded by this worker's later chunks: waiting on it may over-wait, never under-wait
        use_device(self.index)   # with device_map a worker serves several GPUs: the event's device must be the stream's
        mine = cudart.Event()
        rt.eventRecord(mine.ptr, ring.stream_ptr)
        return mine

    def land_all(self, worker: int, chunks: Iterable[Chunk], sources: Sequence[FileSource],
                 buffers: list[Buffer | None], buffer_of: Callable[[int], Buffer],
                 progress: Callable[[int], None] | None = None) -> None:
        """``land`` every chunk of ``chunks`` (a load nobody waits on chunk by chunk), with nothing
        per contiguous chunk of a ``plain`` source but its steps: wait for the slot, one positional
        read, one async copy, one event record, in one native call where the library was built
        (``cuda.native``). Bytes read are counted once per source at the end.

        Per-chunk Python runs under the GIL that every worker shares, and what one worker spends
        there the others wait for inside their next runtime call; other chunks (strided spans,
        gathers, O_DIRECT, a test's fault hook) go through ``land``. ``buffers[d]`` is the
        destination once it exists, ``buffer_of(d)`` makes it (after the chunk's read: such a
        chunk takes the Python steps); ``progress(nbytes)`` is told of the bytes queued every
        ``PROGRESS_BYTES`` or so."""
        rt = self._rt
        lander = self._native
        native_land, driver = (lander.land, lander.driver) if lander is not None else (None, 0)
        ring = self._rings.get(worker) or self._ring(worker)
        arrays = [slot.array for slot in ring.slots]
        views = [memoryview(a) for a in arrays]
        ptrs, events, pending = ring.ptrs, [ev.ptr for ev in ring.events], ring.pending
        n_slots, stream = len(ring.slots), ring.stream_ptr
        plain = [src.plain for src in sources]
        fds = [src.fd for src in sources]
        counted = [0] * len(sources)
        untold = 0   # bytes queued since progress was last told
        preadv = os.preadv
        k = ring.next
        try:
            for chunk in chunks:
                run, f, d = chunk.run, chunk.file, chunk.dest
                if run.height != 1 or not plain[f]:
                    ring.next = k
                    buf = buffers[d]
                    self.land(worker, sources[f], run, buf if buf is not None else functools.partial(buffer_of, d))
                    k = ring.next
                    untold += run.nbytes
                    continue
                n = run.width
                buf = buffers[d]
                if native_land is not None and buf is not None:
                    got = native_land(driver, fds[f], run.src, n, ptrs[k], events[k], pending[k], buf.ptr + run.dst,
                                      stream)
                    pending[k] = True
                    counted[f] += n if got == n else self._resume(ring, k, sources[f], run, buf, got)
                else:
                    if pending[k]:
                        rt.eventSynchronize(events[k])   # the slot's last copy is done: overwrite it
                    pending[k] = True
                    try:
                        got = preadv(fds[f], [views[k][:n]], run.src)
                    except OSError:
                        got = 0
                    if got != n:   # short or failed: read_into finishes it or says why, naming the file
                        sources[f].read_into(arrays[k][got:n], run.src + got)
                    counted[f] += got
                    if buf is None:
                        buf = buffer_of(d)
                    rt.memcpyAsync(buf.ptr + run.dst, ptrs[k], n, H2D, stream)
                    self._record(ring, k)
                k = (k + 1) % n_slots
                untold += n
                if progress is not None and untold >= PROGRESS_BYTES:
                    progress(untold)
                    untold = 0
        finally:
            ring.next = k
            for src, n in zip(sources, counted):
                if n:
                    src.count(n)
            if progress is not None and untold:
                progress(untold)

    @property
    def lands_queues(self) -> bool:
        """Whether ``land_queue`` can run here (the native library, a real CUDA runtime)."""
        return self._native is not None and self._native.land_queue is not None

    def land_queue(self, worker: int, queue: native.Queue, source_of_fd: dict[int, FileSource]) -> None:
        """Land ``queue``'s records until it is sealed and drained, or stopped: the loop runs in C
        with the GIL released (``native_land.c``), so a caller filling the queue runs beside it.
        A record the native call could not finish (a short read, a failed CUDA step) is finished
        or reported here, naming the file, and the loop goes on; an error stops the queue."""
        lander = self._native
        use_device(self.index)
        ring = self._rings.get(worker) or self._ring(worker)
        n = len(ring.slots)
        slots = (ctypes.c_void_p * n)(*ring.ptrs)
        events = (ctypes.c_void_p * n)(*[ev.ptr for ev in ring.events])
        pending = (ctypes.c_int32 * n)(*ring.pending)
        slot, failed, code = ctypes.c_int32(ring.next), ctypes.c_int64(), ctypes.c_int64()
        try:
            while True:
                lander.land_queue(lander.driver, queue.ptr, slots, events, pending, n, ctypes.byref(slot),
                                  ring.stream_ptr, ctypes.byref(failed), ctypes.byref(code))
                if failed.value < 0:
                    return
                fd, src, nbytes, dst = queue.records[failed.value].tolist()
                k = slot.value
                ring.pending[k] = bool(pending[k])
                self._resume(ring, k, source_of_fd[fd], Run(src, nbytes, nbytes, 1, 0), _Address(dst), code.value)
                pending[k] = 1
                slot.value = (k + 1) % n
        except BaseException:
            queue.stop()
            raise
        finally:
            ring.pending[:] = [bool(p) for p in pending]
            ring.next = slot.value

    def _resume(self, ring: _Ring, k: int, source: FileSource, run: Run, buf: Buffer, got: int) -> int:
        """Finish a contiguous chunk the native call left undone: ``got`` bytes read (a short or
        failed read), or the CUDA step that failed. The same step in Python completes it or raises
        the error, naming the file or the call. Returns the bytes the native call read (the
        caller counts them; ``read_into`` counts its own)."""
        rt = self._rt
        n = run.width
        counted = n
        if got == native.SYNC_FAILED:
            rt.eventSynchronize(ring.events[k].ptr)
            got = counted = 0
        if 0 <= got < n:
            source.read_into(ring.slots[k].array[got:n], run.src + got)
            counted = got
        if got >= 0 or got == native.COPY_FAILED:
            rt.memcpyAsync(buf.ptr + run.dst, ring.ptrs[k], n, H2D, ring.stream_ptr)
        self._record(ring, k)
        return counted

    def _record(self, ring: _Ring, k: int) -> None:
        """Record slot ``k``'s event after the copy just queued from it on the ring's stream."""
        try:
            self._rt.eventRecord(ring.events[k].ptr, ring.stream_ptr)
        except BaseException:
            ring.stream.synchronize()   # the event cannot stand for the copy: wait for it here
            ring.pending[k] = False
            raise

    def fetch(self, worker: int, src_ptr: int, nbytes: int):
        """Device bytes -> a pinned slot; returns (slot, view) once the copy is complete."""
        rt = self._rt
        stream = self.ctx.stream(worker)
        pool = self.pool()
        slot = pool.acquire()
        try:
            with cudart.on_device(self.index):
                rt.memcpyAsync(slot.ptr, src_ptr, nbytes, cudart.D2H, stream.ptr)
                stream.synchronize()
        except BaseException:
            pool.release(slot)
            raise
        return pool, slot, slot.array[:nbytes]
