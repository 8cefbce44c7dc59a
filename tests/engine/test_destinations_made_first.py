"""A load makes its destinations on the caller before its workers start (``Destinations.make``):
each exactly once, in the order the pipeline reaches them, none beside a read, and a failure there
surfaces from the load naming the tensor, with nothing returned and nothing hung."""

from __future__ import annotations

import threading
import time
import weakref

import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream.engine import frameworks
from foxhunt_stream.io import source
from foxhunt_stream.format.plan import Selection, plan_load
from foxhunt_stream.io.checkpoint import open_checkpoint


@pytest.fixture
def ckpt(tmp_path):
    rng = np.random.default_rng(3)
    tensors = {f"t{i:03d}": rng.standard_normal((i % 7 + 1, 33)).astype(np.float32) for i in range(120)}
    p = tmp_path / "m.safetensors"
    fs.save_file(tensors, p)
    return p, tensors


def test_dest_order_follows_first_chunks(ckpt):
    p, _ = ckpt
    ck = open_checkpoint(p)
    names = ck.file_order()[::-1]   # destinations listed in reverse file order
    sels = [Selection(0, ck.headers[0].data_start, ck.names[n][1]) for n in names]
    plan = plan_load(sels, 64)
    order = plan.dest_order()
    assert sorted(order) == list(range(len(names)))
    firsts = {}
    for i, c in enumerate(plan.chunks):
        firsts.setdefault(c.dest, i)
    assert order == sorted(firsts, key=firsts.get)


def test_each_destination_made_once_on_the_caller_before_any_read(ckpt, monkeypatch):
    """Made beside the workers, each allocation took the GIL (and on a GPU the driver) from them:
    every destination is made by the caller's thread, and all of them before the first read."""
    p, tensors = ckpt
    events: list[tuple[str, str, str]] = []
    lock = threading.Lock()
    real_empty = frameworks.NumpyFramework.empty
    real_read = source.FileSource.read_into

    def noted_empty(self, dtype, shape, device, tensor=""):
        time.sleep(0.0005)   # slow allocations: a worker started beside them would read meanwhile
        with lock:
            events.append(("alloc", tensor, threading.current_thread().name))
        return real_empty(self, dtype, shape, device, tensor)

    def noted_read(self, out, offset):
        with lock:
            events.append(("read", "", threading.current_thread().name))
        return real_read(self, out, offset)
    monkeypatch.setattr(frameworks.NumpyFramework, "empty", noted_empty)
    monkeypatch.setattr(source.FileSource, "read_into", noted_read)
    out = fs.load_file(p, threads=4, chunk_bytes=4096)
    allocs = [(t, th) for kind, t, th in events if kind == "alloc"]
    assert sorted(t for t, _ in allocs) == sorted(tensors)                   # once each
    assert {th for _, th in allocs} == {threading.current_thread().name}     # on the caller
    kinds = [kind for kind, _, _ in events]
    assert "read" in kinds and "alloc" not in kinds[kinds.index("read"):]    # all before the first read
    for k, v in tensors.items():
        np.testing.assert_array_equal(out[k], v)


def test_allocation_failure_surfaces_naming_the_tensor(ckpt, monkeypatch):
    """The error names the tensor, no read starts, and the arrays made before it are let go."""
    p, _ = ckpt
    real = frameworks.NumpyFramework.empty
    made: list[weakref.ref] = []
    reads: list[int] = []
    real_read = source.FileSource.read_into

    def failing(self, dtype, shape, device, tensor=""):
        if tensor == "t050":
            raise MemoryError(f"cannot allocate {tensor}")
        arr = real(self, dtype, shape, device, tensor)
        made.append(weakref.ref(arr))
        return arr
    monkeypatch.setattr(frameworks.NumpyFramework, "empty", failing)
    monkeypatch.setattr(source.FileSource, "read_into",
                        lambda self, out, off: reads.append(off) or real_read(self, out, off))
    with pytest.raises(MemoryError, match="t050"):
        fs.load_file(p, threads=4, chunk_bytes=4096)
    assert len(made) == 50 and not reads
    assert all(r() is None for r in made), "arrays of a failed load are still alive"
    monkeypatch.setattr(frameworks.NumpyFramework, "empty", real)
    assert len(fs.load_file(p, threads=4)) == 120    # the process is fine for the next load


def test_a_destination_is_made_without_waiting_for_another_ones_allocation():
    """A thread that needs destination 1 makes it while another thread is still making destination
    0 (held by the lock through the allocation, it waited for that whole allocation)."""
    from foxhunt_stream.cuda.devices import CPU
    from foxhunt_stream.engine.destinations import Destinations
    entered, gate = threading.Event(), threading.Event()
    made: list[int] = []

    def make(d):
        made.append(d)
        if d == 0:
            entered.set()
            gate.wait(10)
        return f"array{d}", f"buffer{d}"
    dests = Destinations(2, [CPU, CPU], make)
    first = threading.Thread(target=dests.buffer, args=(0,))
    first.start()
    assert entered.wait(10)
    second = threading.Thread(target=dests.buffer, args=(1,))
    second.start()
    second.join(5)
    try:
        assert not second.is_alive(), "destination 1 waited for destination 0's allocation"
        same = threading.Thread(target=dests.buffer, args=(0,))   # the same one: waits for it, never makes it twice
        same.start()
        same.join(0.2)
        assert same.is_alive()
    finally:
        gate.set()
        first.join(5)
    same.join(5)
    assert dests.buffer(0) == "buffer0" and dests.buffer(1) == "buffer1" and dests.array(0) == "array0"
    assert sorted(made) == [0, 1]
