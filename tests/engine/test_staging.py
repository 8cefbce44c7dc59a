"""The staging pool: slots are allocated on first demand, never past the bound, reused once
released; ``fill`` pins the rest up front (warmup); a failed allocation does not use up the bound."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from foxhunt_stream.engine.staging import StagingPool


def _counting(nbytes: int = 4096):
    made: list[int] = []

    def allocate(k: int):
        made.append(k)
        return np.zeros(nbytes, np.uint8), None
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


def test_a_failed_allocation_does_not_use_up_the_bound():
    calls = []

    def allocate(nbytes: int):
        calls.append(nbytes)
        if len(calls) == 1:
            raise MemoryError("pinned allocation failed")
        return np.zeros(nbytes, np.uint8), None
    pool = StagingPool(4096, 2, allocate)
    with pytest.raises(MemoryError):
        pool.acquire()
    assert pool.allocated == 0 and pool.free_count() == 2
    pool.acquire(), pool.acquire()
    assert pool.allocated == 2 and len(calls) == 3
