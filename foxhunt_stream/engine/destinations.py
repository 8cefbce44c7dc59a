"""Destinations: the arrays a load fills (one per ``plan.Destination``), made by the framework
before the workers start or handed in by ``load_into``; the pipeline sees only ``Buffer`` s.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator, Sequence

from ..cuda.devices import Device
from ..format.plan import LoadPlan
from .frameworks import Buffer, Framework


class Destinations:
    """Where each destination of a plan lands. ``allocate`` makes new arrays (``make`` makes them,
    a shared chunk's as it lands); ``fixed`` wraps existing buffers."""

    def __init__(self, n: int, devices_of: list[Device], make=None, buffers: list[Buffer] | None = None,
                 arrays: list | None = None, devices: set[Device] | None = None, copies=None,
                 buffer_of=None) -> None:
        self.devices_of = devices_of   # per destination, known before anything is allocated
        self.devices = set(devices_of) if devices is None else devices
        self._make = make
        self._copies = copies   # copies(ds, view): new host arrays of a shared chunk's tensors, or None
        self._buffer_of = buffer_of   # the Buffer of an array made so (asked for after it landed, if ever)
        self.buffers: list[Buffer | None] = buffers if buffers is not None else [None] * n
        self.arrays: list = arrays if arrays is not None else [None] * n
        # one for all: which destinations are being made (each once, whichever thread asks first)
        self._made = threading.Condition(threading.Lock())
        self._making: set[int] = set()

    @classmethod
    def allocate(cls, framework: Framework, plan: LoadPlan, device: Device | Sequence[Device]) -> "Destinations":
        """``device``: one for all destinations, or one per destination (``device_map``)."""
        per_dest = [device] * len(plan.destinations) if isinstance(device, Device) else list(device)
        devices = {device} if isinstance(device, Device) else set(per_dest)
        for dev in sorted(devices, key=str):
            if dev.is_cuda:
                # blocks the allocator hands back may still be read by work queued on its stream
                framework.settle(dev)
                framework.reserve(dev, [d.nbytes for d, on in zip(plan.destinations, per_dest) if on == dev])

        def make(d: int):
            name, dtype, shape, _ = plan.destinations[d]
            return framework.new(dtype, shape, per_dest[d], name)

        def copies(ds: range, view):
            return framework.copies(view, plan.destinations[ds.start:ds.stop], per_dest[ds.start])
        return cls(len(plan.destinations), per_dest, make, devices=devices, copies=copies,
                   buffer_of=framework.buffer)

    @classmethod
    def fixed(cls, buffers: list[Buffer], arrays: list) -> "Destinations":
        return cls(len(buffers), [b.device for b in buffers], buffers=buffers, arrays=arrays)

    def buffer(self, d: int) -> Buffer:
        """Destination ``d``'s buffer, made outside the lock by the first thread that needs it."""
        b = self.buffers[d]
        if b is not None:
            return b
        arr = self.arrays[d]
        if arr is not None and self._buffer_of is not None:   # made from a shared chunk's bytes
            b = self.buffers[d] = self._buffer_of(arr)
            return b
        with self._made:
            while (b := self.buffers[d]) is None and d in self._making:
                self._made.wait()
            if b is not None:
                return b
            self._making.add(d)
        try:
            arr, b = self._make(d)
            self.arrays[d] = arr
            self.buffers[d] = b
        finally:   # made, or failed: a waiter then tries itself (and reports the error)
            with self._made:
                self._making.discard(d)
                self._made.notify_all()
        return b

    def shared_chunk(self, ds: range) -> Iterator[Buffer]:
        """The buffers of the tensors of a shared chunk, made as they are reached, without the lock:
        only the worker landing that chunk makes them."""
        buffers = self.buffers
        for d in ds:
            b = buffers[d]
            if b is None:
                arr, b = self._make(d)
                self.arrays[d] = arr
                buffers[d] = b
            yield b

    def land_shared(self, ds: range, view) -> None:
        """The tensors of a shared chunk from its host bytes ``view`` (back to back, in file order):
        new arrays made from them where the framework can (``Framework.copies``), else copied into
        each destination's buffer (only by the chunk's worker)."""
        arrays = self._copies(ds, view) if self._copies is not None else None
        if arrays is not None:
            self.arrays[ds.start:ds.stop] = arrays
            return
        pos = 0
        for b in self.shared_chunk(ds):
            end = pos + b.nbytes
            b.host[:] = view[pos:end]
            pos = end

    def make(self, plan: LoadPlan) -> None:
        """Make the destinations with chunks of their own, in the order the workers reach them, on
        this thread (a load's caller, before its workers start); nothing for ``fixed`` buffers."""
        if self._make is not None:
            for d in plan.dest_order():
                self.buffer(d)

    def array(self, d: int):
        a = self.arrays[d]
        if a is None:
            self.buffer(d)   # zero-byte destinations have no chunk: allocate them here
            a = self.arrays[d]
        return a

    def all_arrays(self) -> list:
        return [self.array(d) if a is None else a for d, a in enumerate(self.arrays)]

    def release(self) -> None:
        """Drop every array (after a failure: nothing partial is kept alive)."""
        self.arrays = [None] * len(self.arrays)
        self.buffers = [None] * len(self.buffers)
