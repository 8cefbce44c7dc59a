"""The GPU target's bookkeeping on a host-only stand-in for cupy (tests/fakecuda): every chunk
lands where it belongs (contiguous and 2-D runs, and runs a source gathers: packed, one contiguous
copy), each worker's ring comes from the device pool (slots of one registered mapping) and goes
back to it whole, and a settings change that replaces the pool mid-load does not mix slots of two
sizes. Runs in a subprocess so the stand-in never shadows a real cupy."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE = os.path.join(REPO, "tests", "fakecuda")

SCRIPT = textwrap.dedent("""
    import sys, os
    import numpy as np
    import cupy
    assert cupy.__version__ == "fake"
    from foxhunt_stream.cuda import devices as device
    from foxhunt_stream.format import plan
    from foxhunt_stream.io import source
    from foxhunt_stream.engine import targets as target
    from foxhunt_stream.engine.frameworks import Buffer
    from foxhunt_stream import errors as fs_errors

    path = sys.argv[1]
    data = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    data.tofile(path)
    src = source.FileSource(path)
    dev_mem = np.zeros(1 << 16, np.uint8)              # the "device" buffer
    buf = Buffer(device.Device("cuda", 0), dev_mem.nbytes, None, dev_mem.ctypes.data)

    from foxhunt_stream.cuda import runtime as cudart
    assert cudart.runtime() is cupy.cuda.runtime         # the stand-in's, through its cupy_backends
    t = target.CudaTarget(0, 4096, 8, threads=2)       # 8 slots, 4 per worker
    assert t.per_worker == 4 and t.pool().allocated == 0   # pinned on demand, not up front
    runs = [plan.Run(src=o, pitch=4096, width=4096, height=1, dst=o) for o in range(0, 32768, 4096)]
    runs.append(plan.Run(src=32768, pitch=512, width=128, height=8, dst=40000))   # 8 rows of 128 of 512
    for i, run in enumerate(runs):
        t.land(i % 2, src, run, buf)
    assert t.pool().free_count() == 0                 # both rings out
    # each slot registered on its own out of one mapping (no cudaHostAlloc)
    assert t.pool().allocated == 8 and len(cupy.cuda.runtime.registered) == 8 and not cupy.cuda.runtime._host
    assert all(isinstance(ev, cudart.Event) for r in t._rings.values() for ev in r.events)
    t.release_worker(0); t.release_worker(1); t.release_worker(7)
    assert t.pool().free_count() == 8                 # all back, none twice
    assert np.array_equal(dev_mem[:32768], data[:32768])
    want = np.concatenate([data[32768 + r * 512:32768 + r * 512 + 128] for r in range(8)])
    assert np.array_equal(dev_mem[40000:40000 + 1024], want)
    assert cupy.cuda.runtime.copies == len(runs) and cupy.cuda.runtime.records == len(runs)

    # a load with other settings replaces the device pool while a ring is out
    t.land(0, src, runs[0], buf)
    old = t.pool()
    t2 = target.CudaTarget(0, 8192, 4, threads=1)
    t2.land(0, src, plan.Run(src=0, pitch=8192, width=8192, height=1, dst=0), buf)
    assert t2.pool() is not old
    t.release_worker(0); t2.release_worker(0)
    assert old.free_count() == 8 and t2.pool().free_count() == 4
    assert all(s.array.nbytes == old.slot_bytes for s in list(old._free))

    # a failure while a ring is being built gives its slots back (the pool is process-wide)
    t3 = target.CudaTarget(0, 8192, 4, threads=1)
    real_event = cupy.cuda.runtime.eventCreateWithFlags
    cupy.cuda.runtime.eventCreateWithFlags = None        # calling it raises TypeError
    for s in t3.pool()._free:
        s.cuda_event = None
    try:
        t3.land(0, src, plan.Run(src=0, pitch=8192, width=8192, height=1, dst=0), buf)
    except TypeError:
        pass
    else:
        raise AssertionError("expected the ring to fail")
    cupy.cuda.runtime.eventCreateWithFlags = real_event
    assert t3.pool().free_count() == 4

    dev_mem[:] = 0

    # a source that gathers (backend "auto"): a 2-D run's rows are packed into the slot and go to
    # the device with one contiguous copy, not a 2-D one
    gsrc = source.open_source(path, "auto")
    t5 = target.CudaTarget(0, 4096, 2, threads=1)
    two_d = []
    real_2d = cupy.cuda.runtime.memcpy2DAsync
    cupy.cuda.runtime.memcpy2DAsync = lambda *a: two_d.append(a) or real_2d(*a)
    dev_mem[:] = 0
    t5.land(0, gsrc, plan.Run(src=1000, pitch=3000, width=300, height=12, dst=64), buf)
    cupy.cuda.runtime.memcpy2DAsync = real_2d
    t5.release_worker(0)
    gsrc.close()
    want = np.concatenate([data[1000 + r * 3000:1000 + r * 3000 + 300] for r in range(12)])
    assert np.array_equal(dev_mem[64:64 + 3600], want) and two_d == []

    # a read that comes back short (the file shorter than its header says) is reported naming the
    # file, and so is one a test's fault hook cuts short; the ring's slots all go back
    short_path = path + ".short"
    data[:10000].tofile(short_path)
    short = source.FileSource(short_path)
    t6 = target.CudaTarget(0, 4096, 2, threads=1)
    for hook in (None, lambda s, off, n: n // 2):
        source.fault_hook = hook
        try:
            t6.land(0, short, plan.Run(8192, 4096, 4096, 1, 0), buf)
        except fs_errors.FormatError as e:
            assert e.rule == "file-truncated" and short_path in str(e), e
        else:
            raise AssertionError("a short read went unreported")
        finally:
            source.fault_hook = None
            t6.release_worker(0)
    short.close()
    assert t6.pool().free_count() == 2

    # a whole Landing onto the stand-in "GPU": more threads than slots are capped, the data lands,
    # checksums are checked on the way, every slot comes back
    import foxhunt_stream as fs
    from foxhunt_stream import settings
    from foxhunt_stream.engine import destinations, inflight, loader, staging
    from foxhunt_stream.io.checkpoint import open_checkpoint
    rng = np.random.default_rng(1)
    tensors = {f"t{i}": rng.standard_normal(3000 + 977 * i).astype(np.float32) for i in range(6)}
    ck_path = path + ".safetensors"
    fs.save_file(tensors, ck_path, checksum="xxh3-64", checksum_block=4096)
    ck = open_checkpoint(ck_path)
    names = sorted(tensors)
    gpu = device.Device("cuda", 0)
    for verify in (False, True):
        s = settings.merge(chunk_bytes=4096, staging_bytes=3 * 4096, threads=8, verify_on="read")   # 3 slots, 8 threads asked
        plan_, s2, policies, verifier = loader.prepare(ck, loader.selections(ck, names), s, gpu, verify=verify)
        arrays = [np.zeros(tensors[n].shape, np.float32) for n in names]
        bufs = [Buffer(gpu, a.nbytes, None, a.ctypes.data) for a in arrays]
        sources = loader.open_sources(ck, policies)
        before = source.total_bytes_read()
        landing = inflight.LoadInFlight(plan_, sources, destinations.Destinations.fixed(bufs, arrays), s2, check=verifier)
        landing.finish()
        loader.close_all(sources)
        assert landing.job.workers == 3, landing.job.workers
        assert source.total_bytes_read() - before == sum(c.run.span for c in plan_.chunks)
        assert all(np.array_equal(a, tensors[n]) for a, n in zip(arrays, names))
        pool = staging.pinned_pool(0, s2.chunk_bytes + 2 * 4096, s2.n_slots)
        assert pool.free_count() == pool.n_slots

    # a progress bar is told every byte
    from foxhunt_stream.engine.progress import Progress

    class Bar:
        n, closed = 0, False

        def update(self, n):
            self.n += n

        def close(self):
            self.closed = True
    bar = Bar()
    s = settings.merge(chunk_bytes=4096, staging_bytes=3 * 4096, threads=3)
    plan_, s2, policies, _ = loader.prepare(ck, loader.selections(ck, names), s, gpu)
    arrays = [np.zeros(tensors[n].shape, np.float32) for n in names]
    bufs = [Buffer(gpu, a.nbytes, None, a.ctypes.data) for a in arrays]
    sources = loader.open_sources(ck, policies)
    landing = inflight.LoadInFlight(plan_, sources, destinations.Destinations.fixed(bufs, arrays), s2,
                                    progress=Progress(bar))
    landing.finish()
    loader.close_all(sources)
    assert bar.n == plan_.nbytes and bar.closed, (bar.n, plan_.nbytes)
    assert all(np.array_equal(a, tensors[n]) for a, n in zip(arrays, names))

    # a column slice of a file in the page cache, the whole way: chunks carry at most a chunk of
    # the slice though their rows span more than a pinned slot holds, and land packed
    x = rng.standard_normal((64, 1000)).astype(np.float32)
    col_path = path + ".col.safetensors"
    fs.save_file({"x": x}, col_path)
    ck = open_checkpoint(col_path)
    s = settings.merge(chunk_bytes=4096, staging_bytes=4 * 4096, threads=2, backend="auto")   # the gathering backend
    from foxhunt_stream.io import pagecache
    pagecache.resident_fraction = lambda p, samples=64: 1.0   # even if the caches were dropped meanwhile
    sels = loader.selections(ck, ["x"], {"x": (slice(None), slice(250, 500))})
    plan_, s2, policies, _ = loader.prepare(ck, sels, s, gpu)
    assert [p.gather for p in policies] == [True]
    assert max(c.run.nbytes for c in plan_.chunks) <= 4096 < 4096 + 2 * 4096 < max(c.run.span for c in plan_.chunks)
    out = np.zeros((64, 250), np.float32)
    sources = loader.open_sources(ck, policies)
    dest = destinations.Destinations.fixed([Buffer(device.Device("cuda", 0), out.nbytes, None, out.ctypes.data)], [out])
    inflight.LoadInFlight(plan_, sources, dest, s2).finish()
    loader.close_all(sources)
    assert np.array_equal(out, x[:, 250:500])
    print("ok")
""")


def test_cuda_target_rings_on_a_host_stand_in(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FOXHUNT_CUDART"}   # the stand-in's runtime, as chosen by default
    env["PYTHONPATH"] = os.pathsep.join([FAKE, REPO])
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "f.bin")], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ok")


FIRST_LOAD = textwrap.dedent("""
    import sys
    import numpy as np
    import foxhunt_stream as fs
    from foxhunt_stream.engine import staging
    x = np.arange(50000, dtype=np.float32)
    fs.save_file({"x": x}, sys.argv[1])
    assert "foxhunt_stream.engine.loader" not in sys.modules
    loader_then = []
    prepare = staging.prepare
    def spy(*a):
        loader_then.append("foxhunt_stream.engine.loader" in sys.modules)
        return prepare(*a)
    staging.prepare = spy
    out = fs.load_file(sys.argv[1], device="cuda:0", chunk_bytes=4096, staging_bytes=4 * 4096)
    assert np.array_equal(np.asarray(out["x"]), x)
    assert loader_then == [False, True], loader_then   # the front door's start, then the loader's (a no-op)
    print("ok")
""")


def test_a_first_load_starts_pinning_before_the_loader_is_imported(tmp_path):
    """The pinning of a process's first GPU load runs beside the rest of the loader's import (a
    TP=8 rank's load came 3-4 ms sooner in every round: RESULTS.md)."""
    env = {k: v for k, v in os.environ.items() if k != "FOXHUNT_CUDART"}
    env["PYTHONPATH"] = os.pathsep.join([FAKE, REPO])
    r = subprocess.run([sys.executable, "-c", FIRST_LOAD, str(tmp_path / "f.safetensors")], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ok")
