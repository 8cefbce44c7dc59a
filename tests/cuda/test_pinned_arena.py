"""``runtime.PinnedArena.pin`` without a GPU: a slot is faulted in by writing it and registered
whole, and its array is that memory."""

from __future__ import annotations

import ctypes
import mmap
import threading

import numpy as np

from foxhunt_stream.cuda import runtime
from foxhunt_stream.io import libc as libc_module

SLOT = 5 * runtime.HUGE_PAGE // 2 + 8192   # a staging slot's shape: a chunk and room for alignment


class _Recorder:
    """The C library, its madvise and memset calls recorded."""

    def __init__(self, real) -> None:
        self.real, self.advised, self.memset_calls = real, [], []

    def madvise(self, ptr, n, advice):
        self.advised.append((ptr, n, advice))
        return self.real.madvise(ptr, n, advice)

    def memset(self, ptr, value, n):
        self.memset_calls.append((ptr, n))
        return self.real.memset(ptr, value, n)


class _Registrar:
    def __init__(self) -> None:
        self.registered = []

    def hostRegister(self, ptr, n, flags):   # noqa: N802 - the runtime's name
        self.registered.append((ptr, n, flags))


def _arena(n_slots: int):
    """An arena over a plain anonymous mapping, registering into a recorder (no GPU)."""
    mem = mmap.mmap(-1, SLOT * n_slots)
    arena = runtime.PinnedArena.__new__(runtime.PinnedArena)
    arena._rt, arena.slot_bytes, arena.n = _Registrar(), SLOT, n_slots
    arena.base = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    arena._pinned, arena._mapping = [], None
    arena._lock = threading.Lock()
    return arena, mem


def test_a_slot_is_faulted_in_by_writing_it_then_registered_whole(monkeypatch):
    """Written, not advised: ``MADV_POPULATE_WRITE`` holds the process's memory-map lock while it
    faults, and the loading thread's every mmap waited behind it."""
    rec = _Recorder(libc_module.libc())
    monkeypatch.setattr(libc_module, "libc", lambda: rec)
    arena, mem = _arena(2)
    np.frombuffer(mem, np.uint8)[:] = 9
    view = arena.pin(1)
    start = arena.base + SLOT
    assert rec.memset_calls == [(start, SLOT)]   # the whole slot, once
    assert rec.advised == []
    assert arena._rt.registered == [(start, SLOT, runtime.HOST_REGISTER_PORTABLE)]
    assert view.nbytes == SLOT and view.ctypes.data == start
    assert np.frombuffer(mem, np.uint8, SLOT, SLOT).max() == 0 and np.frombuffer(mem, np.uint8, SLOT).min() == 9
    view[:] = 7
    assert np.frombuffer(mem, np.uint8, SLOT, SLOT).min() == 7   # the slot's array is the arena's memory
    del view, arena
    mem.close()


def test_consecutive_slots_are_faulted_in_and_registered_in_one_call(monkeypatch):
    """A pinning thread's share of the pool is one memset and one registration: each registration
    is work for the driver and the kernel that slows the loading thread beside it."""
    rec = _Recorder(libc_module.libc())
    monkeypatch.setattr(libc_module, "libc", lambda: rec)
    arena, mem = _arena(4)
    np.frombuffer(mem, np.uint8)[:] = 9
    views = arena.pin_slots(range(1, 3))
    start = arena.base + SLOT
    assert rec.memset_calls == [(start, 2 * SLOT)]
    assert arena._rt.registered == [(start, 2 * SLOT, runtime.HOST_REGISTER_PORTABLE)]
    assert arena._pinned == [start]   # unregistered by the range's start
    assert [v.ctypes.data for v in views] == [start, start + SLOT] and all(v.nbytes == SLOT for v in views)
    body = np.frombuffer(mem, np.uint8)
    assert body[SLOT:3 * SLOT].max() == 0 and body[:SLOT].min() == 9 and body[3 * SLOT:].min() == 9
    views[1][:] = 5
    assert body[2 * SLOT:3 * SLOT].min() == 5 and body[SLOT:2 * SLOT].max() == 0
    del views, arena, body
    mem.close()
