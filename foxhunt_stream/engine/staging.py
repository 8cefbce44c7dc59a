"""Staging: a bounded pool of fixed-size host buffers shared by the loader and the saver.

A slot is handed out, filled (file -> slot, or device -> slot), drained (slot -> device, or
slot -> file) and handed back with the event of its last asynchronous copy; the next taker waits
on that event, so a buffer is reused as soon as its copy is done and never sooner.

Pinned pools are made once per process and device and reused by every later load and save. A
process's first load starts pinning its GPU's pool as soon as it knows the device
(``prepare``): several threads pin their share of the slots at once, each share in one call,
while the caller reads the headers and plans; a worker's ring takes its slots as they are pinned
(``CudaTarget``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..io.source import ALIGN
from ..cuda.devices import Device
from . import workers

if TYPE_CHECKING:
    from ..settings import Settings


class Slot:
    """One staging buffer and what its last copy left behind."""

    __slots__ = ("array", "event", "owner", "cuda_event")

    def __init__(self, array: np.ndarray, event: Any = None, owner: Any = None) -> None:
        self.array = array      # uint8, page-aligned
        self.event = event      # the last async copy reading/writing this slot, if any
        self.owner = owner      # keeps the allocation alive
        self.cuda_event: Any = None   # a reusable CUDA event for this slot's copies (made by the GPU target)

    @property
    def ptr(self) -> int:
        return self.array.ctypes.data


class StagingPool:
    """Up to ``n_slots`` buffers of ``slot_bytes``; ``acquire`` blocks while all are in use.

    Slots are made on demand (``allocate(k)`` makes slot ``k``), by whichever thread asks first
    or by ``fill_async``'s threads; a taker waits only for a slot that exists or is being made.
    """

    def __init__(self, slot_bytes: int, n_slots: int, allocate: Callable[[range], list[tuple[np.ndarray, Any]]],
                 kind: str = "host") -> None:
        if slot_bytes <= 0 or n_slots <= 0:
            raise ValueError("staging needs at least one slot of at least one byte")
        self.slot_bytes = slot_bytes
        self.n_slots = n_slots
        self.kind = kind
        self._allocate = allocate
        self._todo = list(range(n_slots - 1, -1, -1))   # slots not made yet (popped from the end: 0 first)
        self._making = 0                                 # slots being made now
        self._free: list[Slot] = []
        self._cond = threading.Condition()
        self._filling = False

    @property
    def nbytes(self) -> int:
        """The most it will hold (the bound), whether or not allocated yet."""
        return self.slot_bytes * self.n_slots

    @property
    def allocated(self) -> int:
        """How many slots exist so far."""
        with self._cond:
            return self.n_slots - len(self._todo) - self._making

    def _make(self, most: int = 1) -> list[Slot]:
        """Up to ``most`` slots of consecutive numbers, made at once (``allocate`` of their range);
        none if every slot is made or being made."""
        with self._cond:
            if not self._todo:
                return []
            ks = range(self._todo[-1], self._todo[-1] + 1)
            while len(ks) < most and len(self._todo) > len(ks) and self._todo[-1 - len(ks)] == ks.stop:
                ks = range(ks.start, ks.stop + 1)
            del self._todo[len(self._todo) - len(ks):]
            self._making += len(ks)
        try:
            made = self._allocate(ks)
        except BaseException:
            with self._cond:
                self._todo.extend(reversed(ks))
                self._making -= len(ks)
                self._cond.notify_all()
            raise
        with self._cond:
            self._making -= len(ks)
            self._cond.notify_all()
        return [Slot(arr, None, owner) for arr, owner in made]

    def fill(self, most: int = 1) -> None:
        """Make every slot not yet made, here, ``most`` at a time."""
        while slots := self._make(most):
            for slot in slots:
                self.release(slot)

    def fill_async(self, threads: int) -> None:
        """Make the slots not yet made on ``threads`` worker threads, beside the caller (once), each
        thread its share of consecutive slots in one ``allocate``: every registration of pinned memory
        slows the caller's thread while it runs (16 threads registering 2 slots each slowed a TP rank's
        291 ``torch.empty`` from 4 to 23 ms, one registration each to 11 ms: RESULTS)."""
        with self._cond:
            if self._filling or not self._todo:
                return
            self._filling = True
            most = -(-len(self._todo) // max(1, threads))   # each thread its share, in one call
            n_threads = -(-len(self._todo) // most)

        def fill() -> None:
            try:
                self.fill(most)
            except BaseException:  # noqa: BLE001 - a taker that needs the slot makes it and reports the error
                pass
        for w in range(n_threads):
            workers.run(fill, f"foxhunt-pin-{w}")

    def acquire(self, timeout: float | None = None) -> Slot:
        """A free slot: one handed back, one made now, or the next to be handed back or made."""
        while True:
            with self._cond:
                if self._free:
                    return self._ready(self._free.pop())
                can_make = bool(self._todo)
                if not can_make and not self._cond.wait_for(lambda: self._free or self._todo, timeout):
                    raise TimeoutError("no staging buffer came free in time")
            if can_make:
                made = self._make()
                if made:
                    return made[0]

    def try_acquire(self) -> Slot | None:
        """A free slot, one made now, or one being made; None at once if every slot is made and
        taken (so that loads sharing the pool never wait on each other in a cycle)."""
        while True:
            with self._cond:
                if self._free:
                    return self._ready(self._free.pop())
                if not self._todo:
                    if not self._making:
                        return None
                    self._cond.wait()
                    continue
            made = self._make()
            if made:
                return made[0]

    @staticmethod
    def _ready(slot: Slot) -> Slot:
        if slot.event is not None:
            slot.event.synchronize()
            slot.event = None
        return slot

    def release(self, slot: Slot, event: Any = None) -> None:
        slot.event = event
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def free_count(self) -> int:
        """Slots to be had without waiting: the free ones and those not yet made."""
        with self._cond:
            return len(self._free) + len(self._todo)


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
            pool = _host_pools[key] = StagingPool(slot_bytes, n_slots,
                                                  lambda ks: [host_allocate(slot_bytes) for _ in ks], "host")
        return pool


def pool_cache() -> dict:
    return _host_pools


_pinned_pools: dict[int, StagingPool] = {}


def current_pinned_pool(device_index: int) -> StagingPool | None:
    """The pinned pool GPU ``device_index`` has now (None before its first load, save or warmup)."""
    with _lock:
        return _pinned_pools.get(device_index)


def _pinned_allocator(device_index: int, slot_bytes: int, n_slots: int) -> Callable[[range], list[tuple[np.ndarray, Any]]]:
    """Slots ``ks`` of one arena of registered memory (``runtime.PinnedArena``), made on first use
    and registered in one call; where the runtime cannot register host memory, each slot is its own
    ``cudaHostAlloc``."""
    from ..cuda import runtime

    arena: list[Any] = []
    made = threading.Lock()

    def allocate(ks: range) -> list[tuple[np.ndarray, Any]]:
        with runtime.on_device(device_index):
            with made:
                if not arena:
                    try:
                        arena.append(runtime.PinnedArena(slot_bytes, n_slots))
                    except OSError:
                        arena.append(None)
            if arena[0] is None:
                return [runtime.pinned(slot_bytes) for _ in ks]
            return [(view, arena[0]) for view in arena[0].pin_slots(ks)]
    return allocate


def pinned_pool(device_index: int, slot_bytes: int, n_slots: int) -> StagingPool:
    """The process-wide pool of pinned slots of one GPU, shared by its loads and saves; a new size
    (a settings change) replaces it (slots of the old pool go back to it and are freed with it)."""
    with _lock:
        pool = _pinned_pools.get(device_index)
        if pool is None or pool.slot_bytes != slot_bytes or pool.n_slots != n_slots:
            pool = _pinned_pools[device_index] = StagingPool(
                slot_bytes, n_slots, _pinned_allocator(device_index, slot_bytes, n_slots), f"pinned:{device_index}")
        return pool


def slot_bytes(chunk_bytes: int) -> int:
    """The size of a staging slot for chunks of ``chunk_bytes``: room for an O_DIRECT read's
    alignment on both sides."""
    return chunk_bytes + 2 * ALIGN


def prepare(device_index: int, chunk_bytes: int, n_slots: int, threads: int) -> None:
    """Start pinning GPU ``device_index``'s pool for chunks of ``chunk_bytes`` on ``threads``
    threads, beside the caller; nothing when it is pinned already. A load calls this first thing,
    so that its workers find their slots pinned, or being pinned, when they start."""
    pinned_pool(device_index, slot_bytes(chunk_bytes), n_slots).fill_async(threads)


def start_pinning(devices: Device | Sequence[Device], s: Settings) -> None:
    """Start pinning the staging memory of the GPUs a load will use, beside its setup (a no-op
    once pinned: a process's first load is the one that pays)."""
    for dev in sorted({devices} if isinstance(devices, Device) else set(devices), key=str):
        if dev.is_cuda:
            prepare(dev.index, s.chunk_bytes, s.n_slots, s.threads)
