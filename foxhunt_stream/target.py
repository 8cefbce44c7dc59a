"""Targets: land a chunk of file bytes in its destination.

``HostTarget`` reads straight into the destination array when a chunk is one contiguous run
(no staging), and through a scratch slot for strided (2-D) runs and O_DIRECT. A mapped source
(``mmap`` backend) packs a strided run's rows itself (``gather``), touching only those bytes.
``CudaTarget`` reads into a pinned slot, enqueues ``cudaMemcpyAsync`` (or ``cudaMemcpy2DAsync``
for strided runs read as whole spans) on the worker's own non-blocking stream, records an event and returns the slot
with it, so the slot is reused as soon as the copy is done. Both also run the saver's direction
(``fetch``: destination bytes -> host memory for writing).
"""

from __future__ import annotations

import numpy as np

from .device import context, cupy
from .frameworks import Buffer
from .plan import Run
from .source import ALIGN, FileSource
from .staging import StagingPool, host_pool


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

    def land(self, worker: int, source: FileSource, run: Run, buf: Buffer, inspect=None):
        if run.height == 1 and source.direct_reads:
            source.read_into(buf.host[run.dst:run.dst + run.width], run.src)
            if inspect is not None:   # checksums: hash the landed bytes on this worker thread
                inspect(buf.host[run.dst:run.dst + run.width])
            return None
        if run.height > 1 and source.gather(run, buf.host[run.dst:run.dst + run.nbytes]):
            return None   # a mapped source copied only the selected columns, no scratch
        pool = self.pool()
        slot = pool.acquire()
        try:
            copy_2d(source.read_span(run.src, run.span, slot.array), run, buf.host)
        finally:
            pool.release(slot)
        if inspect is not None:
            inspect(buf.host[run.dst:run.dst + run.nbytes])
        return None


class CudaTarget:
    def __init__(self, device_index: int, chunk_bytes: int, n_slots: int) -> None:
        self.index = device_index
        self.ctx = context(device_index)
        self.slot_bytes = chunk_bytes + 2 * ALIGN
        self.n_slots = n_slots
        self.cp = cupy()
        self._rt = self.cp.cuda.runtime

    def pool(self) -> StagingPool:
        return self.ctx.pool(self.slot_bytes, self.n_slots)

    def land(self, worker: int, source: FileSource, run: Run, buf: Buffer, inspect=None):
        cp, rt = self.cp, self._rt
        stream = self.ctx.stream(worker)
        pool = self.pool()
        slot = pool.acquire()
        event = None
        try:
            packed = run.height > 1 and source.gather(run, slot.array)   # mapped source: rows packed
            view = slot.array[:run.nbytes] if packed else source.read_span(run.src, run.span, slot.array)
            src = view.ctypes.data
            with cp.cuda.Device(self.index):
                if run.height == 1 or packed:
                    rt.memcpyAsync(buf.ptr + run.dst, src, run.nbytes, rt.memcpyHostToDevice, stream.ptr)
                else:
                    rt.memcpy2DAsync(buf.ptr + run.dst, run.width, src, run.pitch, run.width, run.height,
                                     rt.memcpyHostToDevice, stream.ptr)
                event = cp.cuda.Event(block=False, disable_timing=True)
                event.record(stream)
            if inspect is not None:   # checksums: hash the pinned bytes while the copy runs
                inspect(view)
        finally:
            pool.release(slot, event)
        return event

    def fetch(self, worker: int, src_ptr: int, nbytes: int):
        """Device bytes -> a pinned slot; returns (slot, view) once the copy is complete."""
        cp, rt = self.cp, self._rt
        stream = self.ctx.stream(worker)
        pool = self.pool()
        slot = pool.acquire()
        try:
            with cp.cuda.Device(self.index):
                rt.memcpyAsync(slot.ptr, src_ptr, nbytes, rt.memcpyDeviceToHost, stream.ptr)
                stream.synchronize()
        except BaseException:
            pool.release(slot)
            raise
        return pool, slot, slot.array[:nbytes]
