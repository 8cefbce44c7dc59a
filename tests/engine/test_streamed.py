"""The streamed load (``engine.streamed``): which loads take it, and on the host stand-in for cupy
(tests/fakecuda) with the native queue loop against a stand-in driver table (host memmoves), that
it lands every tensor and TP row slice where it belongs while the caller is still planning, and
that an error found on the way (a truncated shard, an index the headers contradict) stops the
workers and is raised, naming the file. The real GPU path is in ``tests/cuda/test_gpu_loads.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import foxhunt_stream as fs
from foxhunt_stream import settings
from foxhunt_stream.cuda import native
from foxhunt_stream.cuda.devices import CPU, Device
from foxhunt_stream.engine import streamed
from foxhunt_stream.io.checkpoint import resolve
from sharded_support import make_tensors, write_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE = os.path.join(REPO, "tests", "fakecuda")
CUDA_TESTS = os.path.join(REPO, "tests", "cuda")
GPU = Device("cuda", 0)

needs_library = pytest.mark.skipif(native.library() is None, reason="the native library is not built here")


@needs_library
def test_which_loads_stream(tmp_path):
    d = write_checkpoint(str(tmp_path / "ck"), make_tensors())
    resolved, s = resolve(d), settings.merge()
    rows = fs.TPSlice(0, 2, {"*": 0})
    common = dict(background=False, verify=False, progress=False, device_map=None)

    def takes(names=None, shard=None, s=s, device=GPU, source=resolved, **kw):
        return streamed.eligible(source, names, shard, s, device, **{**common, **kw})
    assert takes() and takes("layers.*") and takes(lambda n: True) and takes(shard=rows)
    assert takes(shard=fs.TPSlice(0, 2, {"*.norm": None, "*": 0}))
    assert not takes(["scale"])                                       # a list: the caller's order
    assert not takes(shard=fs.TPSlice(0, 2, {"*.o_proj.weight": 1, "*": 0}))   # column slices gather
    assert not takes(shard=fs.TPSlice(0, 2, {"scale": 0}))           # a rule that fails: said the general way
    assert not takes(device=CPU) and not takes(device=None)
    assert not takes(background=True) and not takes(verify=True) and not takes(progress=True)
    assert not takes(device_map={"": "cuda:0"})
    assert not takes(s=settings.merge(direct_io="on")) and not takes(s=settings.merge(backend="mmap"))
    files = [os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith(".safetensors")]
    assert not takes(source=resolve(files))                           # no index: the names come from headers
    os.environ["FOXHUNT_NATIVE"] = "0"
    try:
        assert not takes()
    finally:
        del os.environ["FOXHUNT_NATIVE"]


SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    import cupy
    assert cupy.__version__ == "fake"
    sys.path.insert(0, sys.argv[2]); sys.path.insert(0, sys.argv[3])
    from test_native_land import FakeDriver
    from sharded_support import write_checkpoint
    import foxhunt_stream as fs
    from foxhunt_stream import errors, settings
    from foxhunt_stream.cuda import native
    from foxhunt_stream.cuda.devices import Device
    from foxhunt_stream.engine import streamed
    from foxhunt_stream.engine.frameworks import Buffer
    from foxhunt_stream.io.checkpoint import INDEX_NAME, open_checkpoint, resolve

    fake = FakeDriver()
    native.lander_for = lambda rt: fake.lander()   # the stand-in runtime is host memory: so is the driver's
    GPU = Device("cuda", 0)

    class HostAsDevice:
        # the stand-in's "device" arrays: host numpy arrays, known to the pipeline by address
        made = []
        def new(self, dtype, shape, device, name):
            arr = np.empty(shape, dtype.numpy)
            self.made.append(name)
            return arr, Buffer(device, arr.nbytes, None, arr.ctypes.data)
        def settle(self, device):
            pass

    d = sys.argv[1]
    rng = np.random.default_rng(0)
    want = {"layers.0.a.weight": rng.standard_normal((96, 128)).astype(np.float32),
            "layers.0.norm": rng.standard_normal(13).astype(np.float32),
            "layers.0.b.weight": rng.standard_normal((40, 100)).astype(np.float16),
            "scale": np.array(2.5, np.float32), "empty": np.zeros((0, 3), np.float32),
            "layers.1.a.weight": rng.integers(-9, 9, (77, 64), dtype=np.int64),
            "lm_head.weight": rng.standard_normal((50, 40)).astype(np.float64)}
    shards = {"model-00001-of-00003.safetensors": ["layers.0.a.weight", "layers.0.norm", "layers.0.b.weight"],
              "model-00002-of-00003.safetensors": ["scale", "empty"],
              "model-00003-of-00003.safetensors": ["layers.1.a.weight", "lm_head.weight"]}
    write_checkpoint(d, want, shards=shards)
    s = settings.merge(threads=3, chunk_bytes=8192, read_bytes=4096, staging_bytes=6 * 8192)
    before = native.landed_chunks()
    published, started = [], []                   # the workers start once the first chunks are queued
    publish, run = native.Queue.publish, streamed.workers.run
    native.Queue.publish = lambda q: (published.append(1), publish(q))[1]
    streamed.workers.run = lambda *a: (started.append(len(published)), run(*a))[1]
    out = streamed.load(resolve(d), None, None, s, GPU, HostAsDevice())
    native.Queue.publish, streamed.workers.run = publish, run
    assert len(started) == 3 and min(started) >= 1, started
    for n, x in want.items():
        assert out[n].shape == x.shape and out[n].tobytes() == x.tobytes(), n
    assert native.landed_chunks() - before >= 30                 # 4 KiB pieces, all through the queue
    assert sum(c[0] == "htod" for c in fake.calls) == native.landed_chunks() - before
    assert list(out) == open_checkpoint(d).file_order()           # the general way's order

    # rank 1 of 2, every tensor sliced along dim 0 (0-d and empty ones whole)
    rule = fs.TPSlice(1, 2, {"scale": None, "empty": None, "*": 0})
    out = streamed.load(resolve(d), "layers.*", rule, s, GPU, HostAsDevice())
    for n, x in want.items():
        if not n.startswith("layers."):
            assert n not in out
            continue
        part = np.array_split(x, 2, axis=0)[1] if x.ndim else x
        assert out[n].shape == part.shape and out[n].tobytes() == part.tobytes(), n

    # a failed copy is repeated by the Python step and the load goes on
    fake.fail = {"htod"}
    out = streamed.load(resolve(d), None, None, s, GPU, HostAsDevice())
    fake.fail = set()
    for n, x in want.items():
        assert out[n].tobytes() == x.tobytes(), n

    # a shard shorter than its header says: the workers stop, the error names the file
    path = os.path.join(d, "model-00003-of-00003.safetensors")
    blob = open(path, "rb").read()
    try:
        open(path, "wb").write(blob[:-5000])
        streamed.load(resolve(d), None, None, s, GPU, HostAsDevice())
    except errors.FormatError as e:
        assert path in str(e), e
    else:
        raise AssertionError("a truncated shard went unreported")
    open(path, "wb").write(blob)

    # an index the headers contradict, found once every header is read: raised as open_checkpoint does
    import json
    index = json.load(open(os.path.join(d, INDEX_NAME)))
    index["weight_map"]["scale"] = "model-00001-of-00003.safetensors"
    json.dump(index, open(os.path.join(d, INDEX_NAME), "w"))
    try:
        streamed.load(resolve(d), None, None, s, GPU, HostAsDevice())
    except errors.FormatError as e:
        assert e.rule == "index-mismatch" and e.tensor == "scale", e
    else:
        raise AssertionError("an index mismatch went unreported")

    print("ok")
""")


@needs_library
def test_streamed_load_lands_everything_and_stops_on_errors(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("FOXHUNT_CUDART", "FOXHUNT_NATIVE")}
    env["PYTHONPATH"] = os.pathsep.join([FAKE, REPO])
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ck"), CUDA_TESTS,
                        os.path.dirname(os.path.dirname(os.path.abspath(__file__)))],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ok")

