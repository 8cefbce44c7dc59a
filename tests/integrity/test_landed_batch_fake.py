"""verify_on="auto" for GPU destinations, on the host stand-in for cupy (tests/fakecuda): a plain
load queues one batched digest launch per device and block size once all copies are done
(Landing.finish -> Verifier.landed_batch -> settle). The kernel itself is replaced by a host
stand-in with its contract (XXH3-64 of each (address, length) block, 0 under 241 bytes), so the
bookkeeping around it is checked without a GPU: digests land on the right tensors, a corrupted
tensor is named, and on a failure every hashing stream is drained before the destinations are
freed, and a background handle that reported a corrupted tensor never returns it. Runs in a subprocess so the stand-in never shadows a real cupy."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE = os.path.join(REPO, "tests", "fakecuda")

SCRIPT = textwrap.dedent("""
    import ctypes, sys
    import numpy as np
    import xxhash
    import cupy
    assert cupy.__version__ == "fake"
    import foxhunt_stream as fs
    from foxhunt_stream import settings
    from foxhunt_stream.cuda import devices as device
    from foxhunt_stream.cuda import digest as device_digest
    from foxhunt_stream.integrity import verifier as integrity
    from foxhunt_stream.engine import destinations, handle, inflight
    from foxhunt_stream.engine import loader
    from foxhunt_stream.io.checkpoint import open_checkpoint
    from foxhunt_stream.errors import ChecksumError
    from foxhunt_stream.engine.frameworks import Buffer

    log = []
    real_sync = cupy.cuda.Stream.synchronize
    cupy.cuda.Stream.synchronize = lambda self: log.append(("sync", self.ptr))

    class HostDigests:
        def __init__(self, values):
            self.values = np.array(values, np.uint64)

        def get(self):
            return self.values

    fail_at = [None]

    def host_spans_digests(spans, block, dev=0, stream=None):   # the kernel's contract, on the host
        launches = sum(1 for e in log if e[0] == "launch")
        if fail_at[0] is not None and launches == fail_at[0]:
            raise RuntimeError("launch failed")
        log.append(("launch", stream.ptr))
        table, first = device_digest.block_table(spans, block)
        n = first[-1]
        out = [xxhash.xxh3_64_intdigest(ctypes.string_at(int(a), int(l))) if l >= 241 else 0
               for a, l in zip(table[:n], table[n:])]
        return HostDigests(out), first

    real_spans_digests = device_digest.spans_digests
    device_digest.spans_digests = host_spans_digests
    integrity._device_bytes = lambda buf, off, n: np.frombuffer(ctypes.string_at(buf.ptr + off, n), np.uint8)

    tmp = sys.argv[1]
    rng = np.random.default_rng(0)
    # two files, two checksum block sizes: two launches; sizes leave short and long last blocks
    parts = [{f"a{i}": rng.standard_normal(3000 + 977 * i).astype(np.float32) for i in range(4)},
             {f"b{i}": rng.standard_normal(2500 + 1231 * i).astype(np.float32) for i in range(3)}]
    paths = [f"{tmp}/p0.safetensors", f"{tmp}/p1.safetensors"]
    fs.save_file(parts[0], paths[0], checksum="xxh3-64", checksum_block=4096)
    fs.save_file(parts[1], paths[1], checksum="xxh3-64", checksum_block=8192)
    tensors = {**parts[0], **parts[1]}
    gpu = device.Device("cuda", 0)

    def load(ck_paths, per_dest=False):
        ck = open_checkpoint(ck_paths)
        names = ck.file_order()
        s = settings.merge(chunk_bytes=4096, staging_bytes=4 * 8192, threads=3)
        assert s.verify_on == "auto"
        plan_, s2, policies, verifier = loader.prepare(ck, loader.selections(ck, names), s, gpu, verify=True)
        assert all(verifier.hashes_landed(d) for d in range(len(names)))
        arrays = [np.zeros(tensors[n].shape, np.float32) for n in names]
        bufs = [Buffer(gpu, a.nbytes, None, a.ctypes.data) for a in arrays]
        sources = loader.open_sources(ck, policies)
        landing = inflight.LoadInFlight(plan_, sources, destinations.Destinations.fixed(bufs, arrays), s2, check=verifier,
                                 per_dest=per_dest, on_end=lambda: loader.close_all(sources))
        real_release = landing.dests.release
        landing.dests.release = lambda: (log.append(("release",)), real_release())
        if per_dest:
            return names, handle.LoadHandle(landing, names)
        try:
            landing.finish()
        finally:
            loader.close_all(sources)
        return names, arrays

    # 1. all good: one launch per block size, on the same verify stream, every tensor checked
    names, arrays = load(paths)
    assert [e[0] for e in log].count("launch") == 2, log
    assert all(np.array_equal(a, tensors[n]) for a, n in zip(arrays, names))

    # 2. a corrupted tensor: ChecksumError naming it, destinations released
    bad = f"{tmp}/bad.safetensors"
    data = bytearray(open(paths[1], "rb").read())
    ck1 = open_checkpoint(paths[1])
    f, info = ck1.names["b2"]
    data[ck1.headers[f].data_start + info.start + 5000] ^= 0xFF
    open(bad, "wb").write(data)
    log.clear()
    try:
        load([paths[0], bad])
    except ChecksumError as e:
        assert e.tensor == "b2", e
    else:
        raise AssertionError("corruption not detected")
    assert ("release",) in log

    # 3. the second launch fails: the first one's stream is drained before the memory is freed
    log.clear()
    fail_at[0] = 1
    try:
        load(paths)
    except RuntimeError as e:
        assert "launch failed" in str(e)
    else:
        raise AssertionError("expected the launch to fail")
    launch = next(i for i, e in enumerate(log) if e[0] == "launch")
    release = log.index(("release",))
    assert launch < release
    assert ("sync", log[launch][1]) in log[launch:release], log

    # 4. a background handle (each tensor hashed as it lands): once wait(name) has reported a
    # corrupted tensor, result() must not hand it back with the others
    fail_at[0] = None
    log.clear()
    names, handle = load([paths[0], bad], per_dest=True)
    try:
        handle.wait("b2")
    except ChecksumError as e:
        assert e.tensor == "b2", e
    else:
        raise AssertionError("corruption not detected by wait()")
    try:
        got = handle.result()
    except ChecksumError as e:
        assert e.tensor == "b2", e
    else:
        raise AssertionError(f"result() returned {len(got)} tensors, the corrupted one among them")
    assert ("release",) in log

    # 5. no kernel here (the stand-in has no RawKernel, like a cupy without NVRTC): the real
    # spans_digests raises KernelUnavailable once, and the tensors are hashed from host copies
    import warnings
    device_digest.spans_digests = real_spans_digests
    log.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names, arrays = load(paths)
    assert all(np.array_equal(a, tensors[n]) for a, n in zip(arrays, names))
    assert any("host copies" in str(w.message) for w in caught), [str(w.message) for w in caught]
    try:
        load([paths[0], bad])
    except ChecksumError as e:
        assert e.tensor == "b2", e
    else:
        raise AssertionError("corruption not detected without the kernel")
    print("ok")
""")


def test_batched_landed_verification_on_a_host_stand_in(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "FOXHUNT_CUDART"}   # the stand-in's runtime, as chosen by default
    env["PYTHONPATH"] = os.pathsep.join([FAKE, REPO])
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("ok")
