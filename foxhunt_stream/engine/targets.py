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

from typing import Callable, Iterable

import numpy as np

from ..cuda import runtime as cudart
from ..cuda.devices import context, use_device
from ..format.plan import Run
from ..io.source import FileSource
from .frameworks import Buffer
from .staging import StagingPool, host_pool, pinned_pool, slot_bytes

H2D = cudart.H2D
# verify=True: a chunk is read and hashed in pieces of this size. Small pieces are hashed while
# still in the CPU cache, but every read and every hash call releases the GIL, and with 16 workers
# each hand-back costs far more than the cache saves: on the H200 one 3.9 GB shard loaded in
# 0.388 s with 1 MiB pieces, 0.184 s with 4 MiB and 0.171 s with whole chunks (no checksums: 0.116 s).
PIECE_BYTES = 64 << 20


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
        self.scratch_bytes = slot_bytes(chunk_bytes)
        self.n_slots = n_slots
        self._pool: StagingPool | None = None

    def pool(self) -> StagingPool:
        if self._pool is None:
            self._pool = host_pool(self.scratch_bytes, self.n_slots)
        return self._pool

    def land(self, worker: int, source: FileSource, run: Run, buf: Buffer, inspect=None):
        """Read the chunk into its destination (or through a scratch slot); returns None (no copy
        is left in flight)."""
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

    def land_packed(self, worker: int, source: FileSource, run: Run, land: Callable[[np.ndarray], None]):
        """Read a span holding whole tensors back to back (``run``, of height 1) into a scratch
        slot and hand its bytes to ``land`` (``Destinations.land_shared``), which copies each
        tensor out of them; returns None."""
        pool = self.pool()
        slot = pool.acquire()
        try:
            land(source.read_span(run.src, run.width, slot.array))
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
        self.slot_bytes = slot_bytes(chunk_bytes)
        self.n_slots = n_slots
        self.per_worker = max(1, n_slots // max(1, threads))   # defaults: 32 slots / 14 workers = 2
        self._rt = cudart.runtime()
        self._rings: dict[int, _Ring] = {}

    def pool(self) -> StagingPool:
        return pinned_pool(self.index, self.slot_bytes, self.n_slots)

    def _ring(self, worker: int) -> _Ring:
        """This worker's ring: the first slot waits for one to come free, the rest are taken only
        if free or being pinned (so concurrent loads sharing the pool never wait on each other in
        a cycle)."""
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

    def land(self, worker: int, source: FileSource, run: Run, buf: Buffer, inspect=None):
        """Read the chunk into the worker's next slot, queue its copy and return the slot's event,
        which completes after it. The event is the slot's own, re-recorded by this worker's later
        chunks from that slot: a wait on it may over-wait (by at most a ring's worth of copies),
        never under-wait, and no event is made per chunk."""
        rt = self._rt
        ring, k = self._next_slot(worker)
        event = ring.events[k]
        slot = ring.slots[k]
        src = ring.ptrs[k]
        if run.height > 1 and source.gather(run, slot.array):    # mapped source: rows packed
            rt.memcpyAsync(buf.ptr + run.dst, src, run.nbytes, H2D, ring.stream_ptr)
        else:
            if inspect is not None:
                view = read_inspected(source, run.src, run.span, slot.array, inspect)
            else:
                view = source.read_span(run.src, run.span, slot.array)
            if not source.direct_reads:   # O_DIRECT: the bytes start inside the aligned span
                src = view.ctypes.data
            if run.height == 1:
                rt.memcpyAsync(buf.ptr + run.dst, src, run.nbytes, H2D, ring.stream_ptr)
            else:
                rt.memcpy2DAsync(buf.ptr + run.dst, run.width, src, run.pitch, run.width, run.height,
                                 H2D, ring.stream_ptr)
        self._record(ring, k)
        return event

    def land_packed(self, worker: int, source: FileSource, run: Run, buffers: Callable[[], Iterable[Buffer]]):
        """``land`` for a span holding whole tensors back to back (``run``, of height 1): one read
        into the worker's next slot, then one copy per tensor, ``buffers()`` in file order."""
        ring, k = self._next_slot(worker)
        view = source.read_span(run.src, run.width, ring.slots[k].array)
        src = view.ctypes.data
        memcpy, stream = self._rt.memcpyAsync, ring.stream_ptr
        try:
            for buf in buffers():
                memcpy(buf.ptr, src, buf.nbytes, H2D, stream)
                src += buf.nbytes
        finally:   # the event stands for the copies queued, even if a later allocation failed
            self._record(ring, k)
        return ring.events[k]

    def _next_slot(self, worker: int) -> tuple[_Ring, int]:
        """The worker's ring and its next slot, whose previous copy is done; from here on a copy
        may be in flight (the slot goes back with its event)."""
        ring = self._rings.get(worker)
        if ring is None:
            ring = self._ring(worker)
        k = ring.next
        ring.next = (k + 1) % len(ring.slots)
        if ring.pending[k]:
            # the slot's previous copy must be done before we overwrite it
            self._rt.eventSynchronize(ring.events[k].ptr)
        ring.pending[k] = True
        return ring, k

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
