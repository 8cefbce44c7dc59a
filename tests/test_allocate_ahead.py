"""Destinations are allocated ahead of the workers on one thread (loader.Destinations.allocate_ahead):
each exactly once, in the order the pipeline reaches them, and a failure there still surfaces from
the load naming the tensor, with nothing returned and nothing hung."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import foxhunt_stream as fs
from foxhunt_stream import frameworks, source
from foxhunt_stream.plan import Selection, plan_load
from foxhunt_stream.checkpoint import open_checkpoint


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
