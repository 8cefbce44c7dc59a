"""``runtime.PinnedArena.pin`` without a GPU: a slot is faulted in by writing it and registered
whole, in slot order, the faulted slots after the first unregistered one in the same call; its
array is that memory."""

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
    arena._rt, arena._mapping = _Registrar(), None
    arena._setup(ctypes.addressof(ctypes.c_char.from_buffer(mem)), SLOT, n_slots)
    return arena, mem


def test_a_slot_is_faulted_in_by_writing_it_then_registered_whole(monkeypatch):
    """Written, not advised: ``MADV_POPULATE_WRITE`` holds the process's memory-map lock while it
    faults, and the loading thread's every mmap waited behind it."""
    rec = _Recorder(libc_module.libc())
    monkeypatch.setattr(libc_module, "libc", lambda: rec)
    arena, mem = _arena(2)
    np.frombuffer(mem, np.uint8)[:] = 9
    arena.pin(0)
    view = arena.pin(1)
    start = arena.base + SLOT
    assert rec.memset_calls == [(arena.base, SLOT), (start, SLOT)]   # each slot whole, once
    assert rec.advised == []
    assert arena._rt.registered == [(arena.base, SLOT, runtime.HOST_REGISTER_PORTABLE),
                                    (start, SLOT, runtime.HOST_REGISTER_PORTABLE)]
    assert view.nbytes == SLOT and view.ctypes.data == start
    assert np.frombuffer(mem, np.uint8, 2 * SLOT).max() == 0
    view[:] = 7
    assert np.frombuffer(mem, np.uint8, SLOT, SLOT).min() == 7   # the slot's array is the arena's memory
    del view, arena
    mem.close()


def test_a_slot_asked_for_out_of_order_faults_in_the_untouched_ones_before_it(monkeypatch):
    """Registration goes in slot order, so a caller that finds an earlier slot untouched faults it
    in itself rather than wait for a caller that may never come."""
    rec = _Recorder(libc_module.libc())
    monkeypatch.setattr(libc_module, "libc", lambda: rec)
    arena, mem = _arena(3)
    view = arena.pin(1)
    assert sorted(rec.memset_calls) == [(arena.base, SLOT), (arena.base + SLOT, SLOT)]
    assert arena._rt.registered == [(arena.base, 2 * SLOT, runtime.HOST_REGISTER_PORTABLE)]
    assert view.ctypes.data == arena.base + SLOT and arena._pinned == [arena.base]
    arena.pin(0)                                   # registered already: nothing more to do
    assert len(rec.memset_calls) == 2 and len(arena._rt.registered) == 1
    del view, arena
    mem.close()


def test_slots_faulted_while_the_first_is_slow_are_registered_with_it_in_one_call(monkeypatch):
    """Eight callers at once, the first slot's fault held back until the other seven are faulted:
    no caller gets its slot before the first is registered, and one call registers all eight."""
    real = libc_module.libc()
    others_done, count, lock = threading.Event(), [0], threading.Lock()
    arena, mem = _arena(8)

    class Gated(_Recorder):
        def memset(self, ptr, value, n):
            if ptr == arena.base:
                assert others_done.wait(10)
            out = real.memset(ptr, value, n)
            with lock:
                count[0] += 1
                if count[0] == 7:
                    others_done.set()
            return out
    monkeypatch.setattr(libc_module, "libc", lambda: Gated(real))
    got: dict[int, tuple[int, int]] = {}

    def take(k: int) -> None:
        view = arena.pin(k)
        got[k] = (view.ctypes.data, len(arena._rt.registered))
    threads = [threading.Thread(target=take, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert got == {k: (arena.base + k * SLOT, 1) for k in range(8)}
    assert arena._rt.registered == [(arena.base, 8 * SLOT, runtime.HOST_REGISTER_PORTABLE)]
    del arena
    mem.close()
