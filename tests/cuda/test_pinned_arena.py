"""``runtime.PinnedArena.pin`` without a GPU: a slot is faulted in (``MADV_POPULATE_WRITE``, or
touched where the kernel lacks it) and registered whole, and its array is that memory."""

from __future__ import annotations

import ctypes
import mmap
import threading

import numpy as np

from foxhunt_stream.cuda import runtime
from foxhunt_stream.io import libc as libc_module

SLOT = 5 * runtime.HUGE_PAGE // 2 + 8192   # a staging slot's shape: a chunk and room for alignment


class _Recorder:
    """The C library, its madvise recorded (and failed on request)."""

    def __init__(self, real, fail_populate: bool = False) -> None:
        self.real, self.fail_populate, self.advised, self.memset_calls = real, fail_populate, [], []

    def madvise(self, ptr, n, advice):
        self.advised.append((ptr, n, advice))
        if self.fail_populate and advice == runtime.MADV_POPULATE_WRITE:
            return -1
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


def test_a_slot_is_faulted_in_then_registered_whole(monkeypatch):
    rec = _Recorder(libc_module.libc())
    monkeypatch.setattr(libc_module, "libc", lambda: rec)
    arena, mem = _arena(2)
    view = arena.pin(1)
    start = arena.base + SLOT
    assert [(p, n) for p, n, a in rec.advised if a == runtime.MADV_POPULATE_WRITE] == [(start, SLOT)]
    assert not rec.memset_calls
    assert arena._rt.registered == [(start, SLOT, runtime.HOST_REGISTER_PORTABLE)]
    assert view.nbytes == SLOT and view.ctypes.data == start
    view[:] = 7
    assert np.frombuffer(mem, np.uint8, SLOT, SLOT).min() == 7   # the slot's array is the arena's memory
    del view, arena
    mem.close()


def test_without_populate_the_rest_of_the_slot_is_touched_instead(monkeypatch):
    rec = _Recorder(libc_module.libc(), fail_populate=True)
    monkeypatch.setattr(libc_module, "libc", lambda: rec)
    arena, mem = _arena(1)
    arena.pin(0)
    assert rec.memset_calls == [(arena.base, SLOT)]   # the whole slot, once
    assert len(arena._rt.registered) == 1
    arena._pinned.clear()
