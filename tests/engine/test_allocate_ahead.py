"""Destinations are allocated ahead of the workers on one thread (destinations.Destinations.allocate_ahead):
each exactly once, in the order the pipeline reaches them, and a failure there still surfaces from
the load naming the tensor, with nothing returned and nothing hung."""

from __future__ import annotations

import threading
import time

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


def test_each_destination_allocated_once(ckpt, monkeypatch):
    p, tensors = ckpt
    calls: list[tuple[str, str]] = []
    lock = threading.Lock()
    real = frameworks.NumpyFramework.empty

    def counting(self, dtype, shape, device, tensor=""):
        with lock:
            calls.append((tensor, threading.current_thread().name))
        return real(self, dtype, shape, device, tensor)
    monkeypatch.setattr(frameworks.NumpyFramework, "empty", counting)
    monkeypatch.setattr(source, "fault_hook", lambda src, off, n: time.sleep(0.002))   # slow reads
    out = fs.load_file(p, threads=4, chunk_bytes=4096)
    assert sorted(t for t, _ in calls) == sorted(tensors)          # once each
    assert any(th == "foxhunt-alloc" for _, th in calls)           # the allocator ran ahead
    for k, v in tensors.items():
        np.testing.assert_array_equal(out[k], v)


def test_allocation_failure_surfaces_naming_the_tensor(ckpt, monkeypatch):
    p, _ = ckpt
    real = frameworks.NumpyFramework.empty

    def failing(self, dtype, shape, device, tensor=""):
        if tensor == "t050":
            raise MemoryError(f"cannot allocate {tensor}")
        return real(self, dtype, shape, device, tensor)
    monkeypatch.setattr(frameworks.NumpyFramework, "empty", failing)
    with pytest.raises(MemoryError, match="t050"):
        fs.load_file(p, threads=4, chunk_bytes=4096)
    monkeypatch.setattr(frameworks.NumpyFramework, "empty", real)
    assert len(fs.load_file(p, threads=4)) == 120    # the process is fine for the next load


def test_workers_held_back_start_when_the_allocator_is_done(ckpt, monkeypatch):
    """While the allocating thread runs, the last workers wait (leaving it a CPU); they start as
    soon as it finishes, and the load lands everything."""
    p, tensors = ckpt
    from foxhunt_stream.engine import inflight
    events: list[tuple[str, str, float]] = []
    lock = threading.Lock()
    real_empty = frameworks.NumpyFramework.empty
    real_read = source.FileSource.read_into

    def slow_empty(self, dtype, shape, device, tensor=""):
        time.sleep(0.001)   # the allocator runs ~0.12 s: longer than a busy machine takes to start a thread
        with lock:
            events.append(("alloc", threading.current_thread().name, time.perf_counter()))
        return real_empty(self, dtype, shape, device, tensor)

    def noted_read(self, out, offset):
        with lock:
            events.append(("read", threading.current_thread().name, time.perf_counter()))
        time.sleep(0.003)   # reads slower than allocations: work is left when the allocator is done
        return real_read(self, out, offset)
    monkeypatch.setattr(frameworks.NumpyFramework, "empty", slow_empty)
    monkeypatch.setattr(source.FileSource, "read_into", noted_read)
    monkeypatch.setattr(inflight, "held_workers", lambda threads: 2)
    out = fs.load_file(p, threads=4, chunk_bytes=4096)
    for k, v in tensors.items():
        np.testing.assert_array_equal(out[k], v)
    allocator_done = max(t for kind, th, t in events if kind == "alloc" and th == "foxhunt-alloc")
    first_read = {}
    for kind, th, t in events:
        if kind == "read":
            first_read.setdefault(th, t)
    assert {"foxhunt-2", "foxhunt-3"} <= set(first_read)            # the held workers did work...
    assert min(first_read["foxhunt-2"], first_read["foxhunt-3"]) >= allocator_done   # ...only after it
    assert min(first_read["foxhunt-0"], first_read["foxhunt-1"]) < allocator_done    # the others overlapped it


def test_held_workers_leave_two_cpus():
    from foxhunt_stream.engine.inflight import held_workers
    assert held_workers(16, cpus=16) == 2
    assert held_workers(14, cpus=16) == 0
    assert held_workers(16, cpus=32) == 0
    assert held_workers(2, cpus=2) == 1        # never all of them
    assert held_workers(1, cpus=1) == 0


def test_job_release_before_or_after_start():
    from foxhunt_stream.engine.pipeline import Job
    seen = []
    lock = threading.Lock()

    def work(worker, item):
        with lock:
            seen.append(worker)
    job = Job(list(range(40)), work, 4).start(hold=2)
    time.sleep(0.05)
    assert not job.done() or set(seen) <= {0, 1}
    job.release()
    job.wait(10)
    assert len(seen) == 40 and set(seen) <= {0, 1, 2, 3}
    early = Job(list(range(10)), work, 4)
    early.release()                      # before start: nothing is held
    early.start(hold=3).wait(10)
    assert early.done()


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
