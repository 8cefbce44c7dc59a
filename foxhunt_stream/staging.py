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

from .source import ALIGN


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
    """``n_slots`` buffers of ``slot_bytes``; ``acquire`` blocks while all are in use."""

    def __init__(self, slot_bytes: int, n_slots: int, allocate: Callable[[int], tuple[np.ndarray, Any]],
                 kind: str = "host") -> None:
        if slot_bytes <= 0 or n_slots <= 0:
            raise ValueError("staging needs at least one slot of at least one byte")
        self.slot_bytes = slot_bytes
        self.n_slots = n_slots
        self.kind = kind
        self._free: queue.LifoQueue[Slot] = queue.LifoQueue()
        for _ in range(n_slots):
            arr, owner = allocate(slot_bytes)
            self._free.put(Slot(arr, None, owner))

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.n_slots

    def acquire(self, timeout: float | None = None) -> Slot:
        try:
            slot = self._free.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError("no staging buffer came free in time") from None
        if slot.event is not None:
            slot.event.synchronize()
            slot.event = None
        return slot

    def try_acquire(self) -> Slot | None:
        """A free slot, or None at once if none is free."""
        try:
            slot = self._free.get_nowait()
        except queue.Empty:
            return None
        if slot.event is not None:
            slot.event.synchronize()
            slot.event = None
        return slot

    def release(self, slot: Slot, event: Any = None) -> None:
        slot.event = event
        self._free.put(slot)

    def free_count(self) -> int:
        return self._free.qsize()


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
