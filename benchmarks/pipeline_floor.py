"""The floor under a load: the pipeline's data movement alone, without the load around it.

``Floor(ckpt, shard, device)`` plans a load with the library's own planner (untimed), then each
call moves that plan's chunks the way the pipeline does and nothing else: ``threads`` threads take
chunks in plan order, each reads its chunk with one ``os.preadv`` into one of its two pinned slots
and queues one ``cudaMemcpyAsync`` and one event record on its own stream, waiting on the slot's
event before reusing it. The destination is one buffer allocated before the first call. No header
is parsed, nothing is planned, allocated or checked during a call; threads are started per call,
as a load starts them. On the CPU the copy is a memcpy into a host buffer, on the worker.

It measures what the hardware and a Python pipeline give a plan's bytes, so that a load's figure
can be split into that floor and what the load adds (setup, allocation, bookkeeping). Only plans
of contiguous runs (the full load, a dim-0 shard) are supported: strided runs are the library's
own business (gathers or whole row spans).
"""

from __future__ import annotations

import itertools
import os
import threading

import numpy as np

from foxhunt_stream import settings as _settings
from foxhunt_stream.cuda.devices import parse_device
from foxhunt_stream.engine import loader
from foxhunt_stream.io.checkpoint import open_checkpoint, select

SLOTS_PER_THREAD = 2


class Floor:
    """One plan's chunks, ready to be moved again and again (``__call__``)."""

    def __init__(self, ckpt: str, shard, device: str, threads: int = 16, chunk_bytes: int = 8 << 20) -> None:
        self.device = parse_device(device)
        self.threads = threads
        s = _settings.merge(chunk_bytes=chunk_bytes, backend="pread")
        ck = open_checkpoint(ckpt)
        plan, _, _, sources = loader.plan_and_open(ck, select(ck, None), shard, s, False, self.device, whole=True)
        loader.close_all(sources)
        if any(c.run.height != 1 for c in plan.chunks):
            raise ValueError("the floor moves contiguous runs only (a full load or a dim-0 shard)")
        starts, total = [], 0
        for d in plan.destinations:
            starts.append(total)
            total += d.nbytes
        self.nbytes = total
        self.chunks = [(c.file, c.run.src, c.run.width, starts[c.dest] + c.run.dst) for c in plan.chunks]
        self.fds = [os.open(p, os.O_RDONLY) for p in ck.paths]
        n = threads * SLOTS_PER_THREAD
        if self.device.is_cuda:
            import torch
            from foxhunt_stream.cuda import runtime
            self.rt = runtime.runtime()
            with runtime.on_device(self.device.index):
                self.slots = [runtime.pinned(chunk_bytes) for _ in range(n)]
                self.streams = [runtime.Stream() for _ in range(threads)]
                self.events = [runtime.Event() for _ in range(n)]
            self.dest = torch.empty(total, dtype=torch.uint8, device=str(self.device))
            self.dest_ptr = self.dest.data_ptr()
        else:
            self.slots = [(np.empty(chunk_bytes, np.uint8), None) for _ in range(n)]
            self.dest = np.empty(total, np.uint8)

    def __call__(self) -> None:
        counter = itertools.count()
        errors: list[BaseException] = []
        work = self._gpu_worker if self.device.is_cuda else self._host_worker

        def run(w: int) -> None:
            try:
                work(w, counter)
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                errors.append(e)
        threads = [threading.Thread(target=run, args=(w,)) for w in range(self.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _gpu_worker(self, w: int, counter) -> None:
        from foxhunt_stream.cuda.devices import use_device
        use_device(self.device.index)
        rt, chunks, fds, base = self.rt, self.chunks, self.fds, self.dest_ptr
        mine = range(w * SLOTS_PER_THREAD, (w + 1) * SLOTS_PER_THREAD)
        views = [memoryview(self.slots[i][0]) for i in mine]
        ptrs = [self.slots[i][0].ctypes.data for i in mine]
        events = [self.events[i].ptr for i in mine]
        pending = [False] * SLOTS_PER_THREAD
        stream = self.streams[w]
        k = 0
        for i in counter:
            if i >= len(chunks):
                break
            f, src, n, dst = chunks[i]
            if pending[k]:
                rt.eventSynchronize(events[k])
            if os.preadv(fds[f], [views[k][:n]], src) != n:
                raise OSError(f"short read at {src} of file {f}")
            rt.memcpyAsync(base + dst, ptrs[k], n, 1, stream.ptr)
            rt.eventRecord(events[k], stream.ptr)
            pending[k] = True
            k = (k + 1) % SLOTS_PER_THREAD
        stream.synchronize()

    def _host_worker(self, w: int, counter) -> None:
        chunks, fds, dest = self.chunks, self.fds, self.dest
        slot = self.slots[w * SLOTS_PER_THREAD][0]
        view = memoryview(slot)
        for i in counter:
            if i >= len(chunks):
                break
            f, src, n, dst = chunks[i]
            if os.preadv(fds[f], [view[:n]], src) != n:
                raise OSError(f"short read at {src} of file {f}")
            dest[dst:dst + n] = slot[:n]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        self.dest = None
