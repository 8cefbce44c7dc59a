"""Staging: a bounded pool of fixed-size host buffers shared by the loader and the saver.

A slot is handed out, filled (file -> slot, or device -> slot), drained (slot -> device, or
slot -> file) and handed back with the event of its last asynchronous copy; the next taker waits
on that event, so a buffer is reused as soon as its copy is done and never sooner.
Pinned pools are allocated once per process and device and reused across loads and saves.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..io.source import ALIGN


@dataclass(eq=False, slots=True)
class Slot:
    array: np.ndarray       # uint8, page-aligned
    event: Any = None       # the last async copy reading/writing this slot, if any
    owner: Any = None       # keeps the allocation alive
    cuda_event: Any = None  # a reusable CUDA event for this slot's copies (made by the GPU target)

    @property
    def ptr(self) -> int:
        return self.array.ctypes.data


class StagingPool:
    """Up to ``n_slots`` buffers of ``slot_bytes``; ``acquire`` blocks while all are in use.

    Slots are allocated on first demand, not up front: pinning 256 MiB takes 0.1-0.19 s on the
    H200 machine, and a first load that had to wait for all of it before its first copy now
    starts after one slot while the other workers pin theirs. ``fill`` allocates the rest now
    (``fs.warmup``: pay it before the load).
    """

    def __init__(self, slot_bytes: int, n_slots: int, allocate: Callable[[int], tuple[np.ndarray, Any]],
                 kind: str = "host") -> None:
        if slot_bytes <= 0 or n_slots <= 0:
            raise ValueError("staging needs at least one slot of at least one byte")
        self.slot_bytes = slot_bytes
        self.n_slots = n_slots
        self.kind = kind
        self._allocate = allocate
        self._made = 0
        self._grow = threading.Lock()
        self._free: queue.LifoQueue[Slot] = queue.LifoQueue()

    @property
    def nbytes(self) -> int:
        """The most it will hold (the bound), whether or not allocated yet."""
        return self.slot_bytes * self.n_slots

    @property
    def allocated(self) -> int:
        """How many slots exist so far."""
        return self._made

    def _new_slot(self) -> Slot | None:
        """A freshly allocated slot, or None if the pool is at its bound."""
        with self._grow:
            if self._made >= self.n_slots:
                return None
            self._made += 1
        try:
            arr, owner = self._allocate(self.slot_bytes)
        except BaseException:
            with self._grow:
                self._made -= 1
            raise
        return Slot(arr, None, owner)

    def fill(self) -> None:
        """Allocate every slot not yet made."""
        while (slot := self._new_slot()) is not None:
            self._free.put(slot)

    def acquire(self, timeout: float | None = None) -> Slot:
        slot = self.try_acquire()
        if slot is not None:
            return slot
        try:
            slot = self._free.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError("no staging buffer came free in time") from None
        return self._ready(slot)

    def try_acquire(self) -> Slot | None:
        """A free slot (a new one while under the bound), or None at once if none is free."""
        try:
            slot = self._free.get_nowait()
        except queue.Empty:
            return self._new_slot()
        return self._ready(slot)

    @staticmethod
    def _ready(slot: Slot) -> Slot:
        if slot.event is not None:
            slot.event.synchronize()
            slot.event = None
        return slot

    def release(self, slot: Slot, event: Any = None) -> None:
        slot.event = event
        self._free.put(slot)

    def free_count(self) -> int:
        """Slots to be had without waiting: the free ones and those not yet allocated."""
        return self._free.qsize() + self.n_slots - self._made


def host_allocate(nbytes: int) -> tuple[np.ndarray, Any]:
    """Page-aligned pageable host memory (O_DIRECT needs the alignment)."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    pad = (-raw.ctypes.data) % ALIGN
    return raw[pad:pad + nbytes], raw


_host_pools: dict[tuple[int, int], StagingPool] = {}
_lock = threading.Lock()


def host_pool(slot_bytes: int, n_slots: int) -> StagingPool:
    """A process-wide pool of pageable scratch buffers (host target's strided and direct reads)."""
    key = (slot_bytes, n_slots)
    with _lock:
        pool = _host_pools.get(key)
        if pool is None:
            _host_pools.clear()   # one size at a time: a settings change drops the old buffers
            pool = _host_pools[key] = StagingPool(slot_bytes, n_slots, host_allocate, "host")
        return pool


def pool_cache() -> dict:
    return _host_pools


_pinned_pools: dict[int, StagingPool] = {}


def current_pinned_pool(device_index: int) -> StagingPool | None:
    """The pinned pool GPU ``device_index`` has now (None before its first load, save or warmup)."""
    with _lock:
        return _pinned_pools.get(device_index)


def pinned_pool(device_index: int, slot_bytes: int, n_slots: int) -> StagingPool:
    """The process-wide pool of pinned slots of one GPU, shared by its loads and saves; a new size
    (a settings change) replaces it (slots of the old pool go back to it and are freed with it)."""
    from ..cuda import runtime

    with _lock:
        pool = _pinned_pools.get(device_index)
        if pool is None or pool.slot_bytes != slot_bytes or pool.n_slots != n_slots:
            def allocate(nbytes: int):
                with runtime.on_device(device_index):
                    return runtime.pinned(nbytes)

            pool = _pinned_pools[device_index] = StagingPool(slot_bytes, n_slots, allocate, f"pinned:{device_index}")
        return pool
