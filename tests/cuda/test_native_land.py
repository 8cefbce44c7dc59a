"""The native chunk landing (``cuda/native_land.c`` through ``cuda.native``), on the host: the C
function runs against a stand-in driver table (ctypes callbacks that copy into host memory), and
``CudaTarget.land_all`` takes it for the contiguous chunks of a load on the fake-cupy stand-in,
finishing in Python whatever the native call left undone. The real GPU path is in
``test_gpu_loads.py``."""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from foxhunt_stream.cuda import native

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE = os.path.join(REPO, "tests", "fakecuda")

needs_library = pytest.mark.skipif(native.library() is None, reason="the native library is not built here")


def test_the_install_built_the_library_where_a_compiler_is():
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine: the package runs the Python steps")
    assert native.library_path() is not None, "pip install -e . should have compiled cuda/native_land.c"
    assert native.library() is not None


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("FOXHUNT_NATIVE", "0")
    assert not native.enabled() and native.lander(native.Driver()) is None
    monkeypatch.setenv("FOXHUNT_NATIVE", "1")
    assert native.enabled()


@needs_library
def test_only_a_real_runtime_gets_the_native_landing(monkeypatch, tmp_path):
    """The driver must never be handed a stand-in's streams and events (host memory): only cupy's
    compiled runtime or a ``LibCudart`` on a library file that exists gets the native landing."""
    from types import SimpleNamespace

    from foxhunt_stream.cuda.libcudart import LibCudart
    spec = importlib.util.spec_from_file_location("cudart_standin", os.path.join(FAKE, "cudart_standin.py"))
    standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)
    monkeypatch.setattr(native, "_cuda_driver", lambda: native.Driver())   # as on a machine with a GPU
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    assert native.lander_for(SimpleNamespace(__file__="/x/cupy_backends/cuda/api/runtime" + suffix)) is not None
    assert native.lander_for(SimpleNamespace(__file__="/x/fakecuda/cupy_backends/cuda/api/runtime.py")) is None
    assert native.lander_for(SimpleNamespace()) is None
    lib = standin.StandIn()
    assert native.lander_for(LibCudart(lib, "/site-packages/nvidia/cu13/lib/libcudart.so.13")) is None
    assert native.lander_for(LibCudart(lib, "")) is None
    real = tmp_path / "libcudart.so.13"
    real.write_bytes(b"")
    assert native.lander_for(LibCudart(lib, str(real))) is not None


HTOD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
SYNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class FakeDriver:
    """A driver table whose copy is a memmove into host memory; each call is logged, and any may
    be told to fail (a nonzero CUresult)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail: set[str] = set()

        def htod(dst, src, n, stream):
            self.calls.append(("htod", n, stream))
            if "htod" in self.fail:
                return 1
            ctypes.memmove(dst, src, n)
            return 0

        def record(event, stream):
            self.calls.append(("record", event, stream))
            return 700 if "record" in self.fail else 0

        def sync(event):
            self.calls.append(("sync", event))
            return 700 if "sync" in self.fail else 0
        self._fns = (HTOD(htod), RECORD(record), SYNC(sync))
        self.table = native.Driver(*(ctypes.cast(f, ctypes.c_void_p).value for f in self._fns))

    def lander(self) -> native.Lander:
        got = native.lander(self.table, keep=self)
        assert got is not None
        return got


@needs_library
def test_land_chunk_reads_copies_and_records(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    path = tmp_path / "f.bin"
    data.tofile(path)
    fake = FakeDriver()
    lander = fake.lander()
    land, driver = lander.land, lander.driver
    slot, device = np.zeros(8192, np.uint8), np.zeros(1 << 16, np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        before = native.landed_chunks()
        # no copy in flight: no wait; the chunk lands at its offset, the event is recorded on the stream
        assert land(driver, fd, 4096, 8192, slot.ctypes.data, 11, 0, device.ctypes.data + 100, 22) == 8192
        assert np.array_equal(device[100:100 + 8192], data[4096:4096 + 8192])
        assert fake.calls == [("htod", 8192, 22), ("record", 11, 22)]
        # a copy in flight from the slot: its event is waited for first
        fake.calls.clear()
        assert land(driver, fd, 0, 100, slot.ctypes.data, 11, 1, device.ctypes.data, 22) == 100
        assert fake.calls[0] == ("sync", 11) and np.array_equal(device[:100], data[:100])
        assert native.landed_chunks() - before == 2
        # a read past the end comes back short with nothing queued: the caller finishes it
        fake.calls.clear()
        assert land(driver, fd, (1 << 16) - 1000, 4096, slot.ctypes.data, 11, 0, device.ctypes.data, 22) == 1000
        assert fake.calls == [] and np.array_equal(slot[:1000], data[-1000:])
        # a failed CUDA step says which
        failures = (("sync", native.SYNC_FAILED), ("htod", native.COPY_FAILED), ("record", native.RECORD_FAILED))
        for step, code in failures:
            fake.fail = {step}
            assert land(driver, fd, 0, 4096, slot.ctypes.data, 11, 1, device.ctypes.data, 22) == code
        assert native.landed_chunks() - before == 2
    finally:
        os.close(fd)
    # a closed descriptor: a failed read, nothing read
    assert land(driver, fd, 0, 4096, slot.ctypes.data, 11, 0, device.ctypes.data, 22) == 0


SCRIPT = textwrap.dedent("""
    import ctypes, sys
    import numpy as np
    import cupy
    assert cupy.__version__ == "fake"
    sys.path.insert(0, sys.argv[2])
    from test_native_land import FakeDriver
    from foxhunt_stream import errors
    from foxhunt_stream.cuda import devices, native
    from foxhunt_stream.engine import targets
    from foxhunt_stream.engine.frameworks import Buffer
    from foxhunt_stream.format import plan
    from foxhunt_stream.io import source

    path = sys.argv[1]
    data = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    data.tofile(path)
    src = source.FileSource(path)
    dev_mem = np.zeros(1 << 16, np.uint8)
    buf = Buffer(devices.Device("cuda", 0), dev_mem.nbytes, None, dev_mem.ctypes.data)
    rt = cupy.cuda.runtime
    fake = FakeDriver()
    t = targets.CudaTarget(0, 4096, 2, threads=1)
    t._native = fake.lander()
    runs = [plan.Run(src=o, pitch=4096, width=4096, height=1, dst=o) for o in range(0, 32768, 4096)]
    strided = plan.Run(src=32768, pitch=512, width=128, height=8, dst=40000)
    chunks = [plan.Chunk(0, 0, r) for r in runs] + [plan.Chunk(0, 0, strided), plan.Chunk(0, 1, runs[0])]
    made = []
    before, native_before, copies_before = src.bytes_read, native.landed_chunks(), rt.copies
    # destination 0 is made; destination 1 is not yet: its chunk takes the Python steps (read, then make it)
    t.land_all(0, iter(chunks), [src], [buf, None], lambda d: made.append(d) or buf)
    assert native.landed_chunks() - native_before == len(runs)
    assert sum(c[0] == "htod" for c in fake.calls) == len(runs) and made == [1]
    assert rt.copies - copies_before == 2                  # the strided chunk and the unmade destination's
    assert np.array_equal(dev_mem[:32768], data[:32768])
    rows = np.concatenate([data[32768 + r * 512:32768 + r * 512 + 128] for r in range(8)])
    assert np.array_equal(dev_mem[40000:40000 + 1024], rows)
    assert src.bytes_read - before == 32768 + strided.span + 4096   # counted once each
    # the slots' events: each natively recorded one is waited for before its slot is reused
    ring = t._rings[0]
    assert all(ring.pending)
    t.release_worker(0)

    # a failed copy or event record is repeated by the Python step (here it succeeds)
    for step in ("htod", "record"):
        fake.fail = {step}
        dev_mem[:] = 0
        copies_before, records_before = rt.copies, rt.records
        t.land_all(0, iter([plan.Chunk(0, 0, runs[1])]), [src], [buf], None)
        t.release_worker(0)
        assert np.array_equal(dev_mem[4096:8192], data[4096:8192]), step
        assert rt.records - records_before == 1 and rt.copies - copies_before == (step == "htod")
    fake.fail = set()

    # a short read (the file shorter than its header says) is reported naming the file
    short_path = path + ".short"
    data[:10000].tofile(short_path)
    short = source.FileSource(short_path)
    try:
        t.land_all(0, iter([plan.Chunk(0, 0, plan.Run(8192, 4096, 4096, 1, 0))]), [short], [buf], None)
    except errors.FormatError as e:
        assert e.rule == "file-truncated" and short_path in str(e), e
    else:
        raise AssertionError("a short read went unreported")
    finally:
        t.release_worker(0)
    assert t.pool().free_count() == 2
    print("ok")
""")


@needs_library
def test_land_all_takes_the_native_call_and_finishes_in_python(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("FOXHUNT_CUDART", "FOXHUNT_NATIVE")}
    env["PYTHONPATH"] = os.pathsep.join([FAKE, REPO])
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "f.bin"), os.path.dirname(__file__)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ok")
