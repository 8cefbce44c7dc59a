"""The staging pool: slots are allocated on first demand, never past the bound, reused once
released; ``fill`` pins the rest up front (warmup), its threads each their share in one call; a
failed allocation does not use up the bound."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from foxhunt_stream.engine.staging import StagingPool


def _counting(nbytes: int = 4096):
    made: list[int] = []

    def allocate(ks: range):
        made.extend(ks)
        return [(np.zeros(nbytes, np.uint8), None) for _ in ks]
    return made, allocate


def test_slots_are_allocated_on_demand_up_to_the_bound():
    made, allocate = _counting()
    pool = StagingPool(4096, 3, allocate)
    assert made == [] and pool.allocated == 0 and pool.free_count() == 3 and pool.nbytes == 3 * 4096
    a = pool.acquire()
    assert len(made) == 1 and a.array.nbytes == 4096      # the first taker waits for one slot, not three
    b, c = pool.try_acquire(), pool.try_acquire()
    assert len(made) == 3 and len({id(a), id(b), id(c)}) == 3
    assert pool.try_acquire() is None and pool.free_count() == 0 and len(made) == 3
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.01)
    pool.release(b)
    assert pool.acquire() is b and len(made) == 3          # reused, not a fourth


def test_a_waiting_taker_gets_the_slot_released_by_another_thread():
    made, allocate = _counting()
    pool = StagingPool(4096, 1, allocate)
    held = pool.acquire()
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(timeout=10)))
    t.start()
    pool.release(held)
    t.join(10)
    assert got == [held] and len(made) == 1


def test_fill_allocates_the_rest_now():
    made, allocate = _counting(8192)
    pool = StagingPool(8192, 4, allocate)
    pool.acquire()
    pool.fill()
    assert len(made) == 4 and pool.allocated == 4 and pool.free_count() == 3
    pool.fill()
    assert len(made) == 4


def _failing_once():
    """An allocator whose first call fails; the ranges it was asked for."""
    calls: list[range] = []

    def allocate(ks: range):
        calls.append(ks)
        if len(calls) == 1:
            raise MemoryError("pinned allocation failed")
        return [(np.zeros(4096, np.uint8), None) for _ in ks]
    return calls, allocate


def test_a_failed_allocation_does_not_use_up_the_bound():
    calls, allocate = _failing_once()
    pool = StagingPool(4096, 2, allocate)
    with pytest.raises(MemoryError):
        pool.acquire()
    assert pool.allocated == 0 and pool.free_count() == 2
    pool.acquire(), pool.acquire()
    assert pool.allocated == 2 and len(calls) == 3


def test_fill_makes_consecutive_slots_in_one_call_each():
    calls = []
    lock = threading.Lock()

    def allocate(ks: range):
        with lock:
            calls.append(ks)
        return [(np.zeros(4096, np.uint8), None) for _ in ks]
    pool = StagingPool(4096, 7, allocate)
    pool.acquire()                       # slot 0, alone
    pool.fill(3)
    assert calls == [range(0, 1), range(1, 4), range(4, 7)] and pool.allocated == 7


def test_fill_async_gives_each_thread_its_share_in_one_call():
    calls = []
    lock = threading.Lock()
    done = threading.Event()

    def allocate(ks: range):
        with lock:
            calls.append(ks)
            if sum(map(len, calls)) == 8:
                done.set()
        return [(np.zeros(4096, np.uint8), None) for _ in ks]
    pool = StagingPool(4096, 8, allocate)
    pool.fill_async(4)
    assert done.wait(10)
    assert sorted(calls, key=lambda r: r.start) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert sorted(s for r in calls for s in r) == list(range(8))


def test_a_failed_range_is_made_again_whole():
    calls, allocate = _failing_once()
    pool = StagingPool(4096, 4, allocate)
    with pytest.raises(MemoryError):
        pool.fill(2)
    assert pool.allocated == 0 and pool.free_count() == 4
    pool.fill(2)
    assert calls == [range(0, 2), range(0, 2), range(2, 4)] and pool.allocated == 4
